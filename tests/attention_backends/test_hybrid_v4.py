"""The hybrid (DeepSeek-V4) attention backend and its per-step metadata, against a dense
reference written from the math, with random page assignments, released SWA pages and
decodes mixed with prefill chunks in one step."""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.attention_backends.hybrid_metadata import (
    C4, C128, INDEXER, STATE_C4, STATE_C128, SWA, HybridLayout, build_hybrid_metadata,
)
from hybridkv.attention_backends import hybrid_v4
from hybridkv.attention_backends.hybrid_metadata import KeySet
from hybridkv.attention_backends.hybrid_v4 import (
    HybridV4Attention, IndexerQuery, blockwise_topk, indexer_scores, indexer_topk, joint_softmax_attention,
    online_joint_attention, select_topk,
)
from hybridkv.attention_backends.metadata import StepSequences
from hybridkv.block_manager.space_spec import NULL_PAGE
from tiny_deepseek_v4 import single_thread

P, W, CSA, HCA = 8, 5, 2, 4  # page size, sliding window, ratios (P is a multiple of both)
H, D, NI, CI, TOPK = 3, 16, 4, 8, 3
SPACES = {SWA: 1, STATE_C4: 1, STATE_C128: 1, C4: CSA, INDEXER: CSA, C128: HCA}
RINGS = {STATE_C4: 2 * CSA, STATE_C128: HCA}  # rows per window: each state space's window and ring
WINDOWS = {SWA: W, **RINGS}


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _dense_attention(q, keys, sink, scale):
    """q [H, D], keys [L, D] (also the values), sink [H]: softmax over [q·k, sink]."""
    logits = torch.cat([keys @ q.t() * scale, sink[None, :]], dim=0)  # [L+1, H]
    p = torch.softmax(logits, dim=0)[:-1]
    return (p.t() @ keys)  # [H, D]


def test_joint_softmax_equals_dense_softmax_with_sink():
    g = torch.Generator().manual_seed(0)
    n, L1, L2 = 4, 7, 5
    q = torch.randn(n, H, D, generator=g)
    k1 = torch.randn(L1, D, generator=g)  # shared by the queries
    k2 = torch.randn(n, L2, D, generator=g)  # one list per query
    m1 = torch.rand(n, L1, generator=g) > 0.3
    m1[:, 0] = True
    m2 = torch.rand(n, L2, generator=g) > 0.5
    sink = torch.randn(H, generator=g)
    got = joint_softmax_attention(q, [(k1, m1), (k2, m2)], sink, 0.25)
    for i in range(n):
        keys = torch.cat([k1[m1[i]], k2[i][m2[i]]])
        torch.testing.assert_close(got[i], _dense_attention(q[i], keys, sink, 0.25), atol=1e-6, rtol=0)


def test_select_topk_breaks_ties_towards_the_lower_index():
    s = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, float("-inf")], [5.0, 5.0, 5.0, 5.0, 1.0, 2.0]])
    assert select_topk(s, 3).tolist() == [[0, 1, 3], [0, 1, 2]]
    few = torch.tensor([[2.0, float("-inf"), float("-inf"), 1.0]])
    assert sorted(select_topk(few, 3)[0].tolist()) == [0, 1, 3]  # -inf ones come last, lowest index first
    g = torch.Generator().manual_seed(1)
    r = torch.randn(5, 40, generator=g)
    assert torch.equal(select_topk(r, 7).sort().values, torch.topk(r, 7).indices.sort().values)


class _Step:
    """Random page tables for a step with decodes and prefill chunks, plus logical contents."""

    def __init__(self, spans: list[tuple[int, int]], seed: int) -> None:
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.spans = spans  # (start, num_new_tokens) per sequence, decodes first
        pools = {s: list(range(1, 65)) for s in SPACES}  # page 0 is the null page
        for pool in pools.values():
            rng.shuffle(pool)
        self.tables: dict[str, list[list[int]]] = {s: [] for s in SPACES}
        for start, q in spans:
            end = start + q
            for space, r in SPACES.items():
                n = -(-(end // r) // (P // r))
                table = [pools[space].pop() for _ in range(n)]
                if space in WINDOWS:  # pages wholly before the window are released
                    for i in range(max(0, start - WINDOWS[space] + 1) // P):
                        table[i] = NULL_PAGE
                self.tables[space].append(table)
        self.seqs = StepSequences.from_page_lists([q for _, q in spans], [s + q for s, q in spans], self.tables)
        self.swa = torch.randn(65 * P, D, generator=g)
        self.c4 = torch.randn(65 * P // CSA, D, generator=g)
        self.c128 = torch.randn(65 * P // HCA, D, generator=g)
        self.index_keys = torch.randn(65 * P // CSA, CI, generator=g)
        for cache in (self.swa, self.c4, self.c128, self.index_keys):
            cache[: cache.shape[0] // 65] = 0  # the null page: zeros, as the model allocates it

    def slot(self, i: int, space: str, idx: int) -> int:
        per_page = P // SPACES[space]
        page = self.tables[space][i][idx // per_page]
        assert page != NULL_PAGE
        return page * per_page + idx % per_page


@pytest.mark.parametrize("key_block", [None, 1, 7])  # None: the defaults (one key block here)
# CSA layers run the indexer: the fused CPU kernel where it builds, and its torch fallback
@pytest.mark.parametrize("kind,indexer", [("sliding", None), ("hca", None), ("csa", "kernel"), ("csa", "torch")])
# the joint softmax: the fused CPU kernel where it builds, and its torch fallback
@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_backend_matches_dense_reference_over_random_pages(kind, indexer, attention, key_block, monkeypatch):
    if indexer == "torch":
        monkeypatch.setattr(hybrid_v4, "load_indexer_topk", lambda: None)
    if attention == "torch":
        monkeypatch.setattr(hybrid_v4, "load_joint_attention", lambda: None)
    if key_block is not None:  # indexer top-k (merged blockwise) and entry attention read in many key blocks
        monkeypatch.setattr(hybrid_v4, "INDEXER_ROW_SCORES", 0)
        monkeypatch.setattr(hybrid_v4, "INDEXER_KEY_BLOCK", key_block)
        monkeypatch.setattr(hybrid_v4, "INDEXER_BLOCK_ELEMS", 0)
        monkeypatch.setattr(hybrid_v4, "ENTRY_KEY_BLOCK", key_block)
    # two decodes (one far past its window), then prefill chunks: from 0, mid-sequence, long
    step = _Step([(36, 1), (9, 1), (20, 15), (0, 12), (3, 300)], seed={"sliding": 0, "hca": 1, "csa": 2}[kind])
    meta = build_hybrid_metadata(step.seqs, HybridLayout(P, W, CSA, HCA))
    T = meta.num_tokens
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    scale = D**-0.5
    iq = IndexerQuery(torch.randn(T, NI, CI, generator=g), torch.randn(T, NI, generator=g), step.index_keys,
                      INDEXER, TOPK, CI**-0.5)
    backend = HybridV4Attention()
    if kind == "sliding":
        got = backend.forward(q, step.swa, meta, sink, scale)
    elif kind == "hca":
        got = backend.forward(q, step.swa, meta, sink, scale, step.c128, C128)
    else:
        got = backend.forward(q, step.swa, meta, sink, scale, step.c4, C4, iq)
    row = 0
    for i, (start, n) in enumerate(step.spans):
        end = start + n
        # Logical (position-ordered) contents of this sequence, read through its page tables.
        swa = {j: step.swa[step.slot(i, SWA, j)] for j in range(max(0, start - W + 1), end)}
        c128 = torch.stack([step.c128[step.slot(i, C128, w)] for w in range(end // HCA)] or [torch.zeros(D)])
        c4 = torch.stack([step.c4[step.slot(i, C4, w)] for w in range(end // CSA)] or [torch.zeros(D)])
        ikeys = torch.stack([step.index_keys[step.slot(i, INDEXER, w)] for w in range(end // CSA)] or [torch.zeros(CI)])
        for t in range(start, end):
            keys = [swa[j] for j in range(max(0, t - W + 1), t + 1)]
            if kind == "hca":
                keys += list(c128[: (t + 1) // HCA])
            if kind == "csa" and (t + 1) // CSA:
                n_causal = (t + 1) // CSA
                scores = (torch.relu(iq.q[row] @ ikeys[:n_causal].t()) * CI**-0.5 * iq.weights[row][:, None]).sum(0)
                # top-k, ties (ReLU makes exact zeros common) to the lower entry index
                chosen = sorted(range(n_causal), key=lambda w: (-scores[w].item(), w))[:TOPK]
                keys += [c4[w] for w in chosen]
            want = _dense_attention(q[row], torch.stack(keys), sink, scale)
            torch.testing.assert_close(got[row], want, atol=1e-5, rtol=0, msg=f"seq {i} position {t}")
            row += 1
    assert row == T


def test_compression_plan_reads_the_right_state_rows_and_writes_the_right_entries():
    """Every closing window pools its rows in window order: rows new this step from the step's
    own rows, earlier rows from the state ring (a page keeps its last 2m / m rows at slot
    t % ring), and each ring keeps exactly each sequence's last rows, in slots no read needs."""
    step = _Step([(36, 1), (7, 1), (20, 15), (0, 12), (3, 300), (13, 1)], seed=4)
    meta = build_hybrid_metadata(step.seqs, HybridLayout(P, W, CSA, HCA))
    new_positions = [t for s, n in step.spans for t in range(s, s + n)]
    for kind, ratio, overlap, spaces, state_space in (("csa", CSA, True, (C4, INDEXER), STATE_C4),
                                                      ("hca", HCA, False, (C128,), STATE_C128)):
        ring = RINGS[state_space]
        plan = meta.plans[kind]
        assert plan.state_space == state_space
        # What the ring holds before the step: each held page's last `ring` earlier positions.
        state = torch.full((65 * ring,), -1, dtype=torch.long)
        for i, (start, n) in enumerate(step.spans):
            for t in range(max(0, start - ring), start):
                page = step.tables[state_space][i][t // P]
                if page != NULL_PAGE:
                    state[page * ring + t % P % ring] = t
        # The ring keeps each sequence's and each page's last `ring` positions (of those new this
        # step): a page end is where a prefix hit resumes.
        kept = [t for s, n in step.spans for t in range(s, s + n) if t >= s + n - ring or t % P >= P - ring]
        assert [new_positions[r] for r in plan.write_rows.tolist()] == kept
        assert len(set(plan.write_slots.tolist())) == len(kept), "two kept rows share a ring slot"
        # Every page's last `ring` positions are in its ring after the step.
        after = state.clone()
        after[plan.write_slots] = torch.tensor(new_positions)[plan.write_rows]
        for i, (s, n) in enumerate(step.spans):
            for t in range(s, s + n):
                page = step.tables[state_space][i][t // P]
                if t >= s + n - ring or t % P >= P - ring:
                    assert after[page * ring + t % P % ring] == t, (kind, i, t)
        want_windows = [(i, w) for i, (s, n) in enumerate(step.spans) for w in range(s // ratio, (s + n) // ratio)]
        assert plan.num_entries == len(want_windows)
        fresh = torch.tensor(new_positions)[:, None]
        got_rows = plan.gather_rows(state[:, None], fresh)[..., 0]
        for e, (i, w) in enumerate(want_windows):
            assert plan.positions[e].item() == w * ratio
            first = w * ratio - (ratio if overlap else 0)
            rows = [first + j for j in range(plan.row_slots.shape[1])]
            assert plan.row_valid[e].tolist() == [r >= 0 for r in rows]
            got = got_rows[e].tolist()
            assert [x for x, r in zip(got, rows) if r >= 0] == [r for r in rows if r >= 0], (kind, i, w)
            for space in spaces:
                assert plan.out_slots[space][e].item() == step.slot(i, space, w)


def _tied_scores(g: torch.Generator, n: int, L: int) -> torch.Tensor:
    """Scores with many exact ties (ReLU zeros, a coarse grid) and masked (-inf) entries:
    random masks, causal-prefix masks, and rows with fewer finite entries than k."""
    scores = torch.relu(torch.randn(n, L, generator=g)).mul(2).round().div(2)  # ~half exact zeros
    scores = scores.masked_fill(torch.rand(n, L, generator=g) < 0.2, float("-inf"))
    visible = torch.randint(0, L + 1, (n,), generator=g)
    visible[:3] = torch.tensor([0, 1, 2])  # almost nothing visible: masked entries must fill the top-k
    causal = torch.arange(L)[None, :] < visible[:, None]
    return torch.where(causal, scores, float("-inf"))


@pytest.mark.parametrize("merge_width", [1, 256])
@pytest.mark.parametrize("k", [1, 5, 64])
@pytest.mark.parametrize("key_block", [1, 3, 16, 63, 64, 128, 200, 1000])
def test_blockwise_topk_equals_one_shot_select_topk(k, key_block, merge_width, monkeypatch):
    monkeypatch.setattr(hybrid_v4, "MERGE_WIDTH", merge_width)
    g = torch.Generator().manual_seed(k * 1000 + key_block)
    n, L = 40, 300
    scores = _tied_scores(g, n, L)
    want = select_topk(scores, k)
    got = blockwise_topk(lambda lo, hi: scores[:, lo:hi], n, L, k, key_block)
    assert torch.equal(got, want)  # the same entries, in the same (ascending) order


@pytest.mark.parametrize("selection", ["row_scores", "row_groups", "blockwise"])
def test_indexer_topk_equals_one_shot_over_shared_and_per_query_keys(selection, monkeypatch):
    """Integer-valued queries and keys make every score exact whatever the matmul shape, so
    the indexer must pick exactly the one-shot entries (ties abound) whether it holds a row
    block's scores whole, splits the rows into groups, or merges key block by key block."""
    if selection == "row_groups":
        monkeypatch.setattr(hybrid_v4, "MIN_SCORE_ROWS", 2)
        monkeypatch.setattr(hybrid_v4, "INDEXER_ROW_SCORES", 5 * 500)  # groups of 5 rows
    elif selection == "blockwise":
        monkeypatch.setattr(hybrid_v4, "INDEXER_ROW_SCORES", 0)
    g = torch.Generator().manual_seed(5)
    n, heads, c, L, slots, k = 24, 4, 8, 500, 700, 16
    q = torch.randint(-2, 3, (n, heads, c), generator=g).float()
    weights = torch.randint(-2, 3, (n, heads), generator=g).float() / 4
    cache = torch.randint(-2, 3, (slots, c), generator=g).float()
    iq = IndexerQuery(q, weights, cache, INDEXER, k, 0.25)
    visible = torch.randint(0, L + 1, (n,), generator=g)
    shared = KeySet(torch.randperm(slots, generator=g)[:L], visible=visible)
    per_query = KeySet(torch.randint(0, slots, (n, L), generator=g), visible=visible)
    for ks in (shared, per_query):
        full = indexer_scores(q, weights, cache[ks.slots], 0.25).masked_fill(~ks.mask, float("-inf"))
        want = select_topk(full, k)
        for key_block in (1, 17, 128, L):
            assert torch.equal(indexer_topk(iq, slice(0, n), ks, k, key_block), want)


def _reference_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """select_topk's rule by brute force: sort by (score descending, index ascending)."""
    out = []
    for row in scores.tolist():
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        out.append(sorted(order))
    return torch.tensor(out, dtype=torch.long)


@pytest.mark.parametrize("tied", [False, True])
def test_select_topk_fast_and_tie_paths_follow_the_one_order(tied):
    """select_topk takes torch.topk's set when it is unique and the tie rule otherwise: both
    must give the (score desc, index asc) order's first k, in ascending index order."""
    g = torch.Generator().manual_seed(11)
    for k in (1, 4, 30):
        scores = _tied_scores(g, 16, 60) if tied else torch.randn(16, 60, generator=g)
        assert torch.equal(select_topk(scores, k), _reference_topk(scores, k))


def test_blockwise_topk_with_a_growing_context_merges_rarely_and_keeps_the_one_shot_answer(monkeypatch):
    """The candidate path (entries above the running k-th score, merged every MERGE_WIDTH
    pending columns) over long random rows: the answer is the one-shot one, and after the first
    block only a few merges run, each over a small fraction of what was scored."""
    g = torch.Generator().manual_seed(3)
    n, L, k, key_block = 8, 16384, 16, 512
    scores = torch.randn(n, L, generator=g)
    widths = []
    real_merge = hybrid_v4.merge_topk

    def counting_merge(rs, ri, bs, bi, kk):
        widths.append(bs.shape[1])
        return real_merge(rs, ri, bs, bi, kk)

    monkeypatch.setattr(hybrid_v4, "merge_topk", counting_merge)
    got = blockwise_topk(lambda lo, hi: scores[:, lo:hi], n, L, k, key_block)
    assert torch.equal(got, select_topk(scores, k))
    blocks = L // key_block
    assert widths[0] == key_block and len(widths) <= blocks // 4, widths
    assert sum(widths[1:]) < (L - key_block) // 8, widths


def test_page_form_key_set_reads_the_same_keys_and_slots_as_the_slot_form():
    """Decode entry lists come as page-table rows: slots_of / slots / read_unmasked must agree
    with the per-entry slot list for every column a query may read, and give the null slot
    for the others."""
    g = torch.Generator().manual_seed(9)
    spp, n, pages_per_row, num_pages, c = 4, 5, 6, 40, 3
    pages = torch.stack([torch.randperm(num_pages - 1, generator=g)[:pages_per_row] + 1 for _ in range(n)])
    visible = torch.tensor([0, 3, 4, 17, 24])
    L = int(visible.max())
    cache = torch.randn(num_pages * spp, c, generator=g)
    ks = KeySet(pages=pages, slots_per_page=spp, length=L, visible=visible)
    w = torch.arange(L)
    want = torch.where(w[None, :] < visible[:, None], pages[:, w // spp] * spp + w % spp, 0)
    assert torch.equal(ks.slots, want)
    idx = torch.randint(0, L, (n, 7), generator=g)
    assert torch.equal(ks.slots_of(idx), want.gather(1, idx))
    for lo, hi in ((0, L), (3, 9), (8, 12), (13, 24)):
        got = ks.read_unmasked(cache, lo, hi)
        ok = ks.column_mask(lo, hi)
        assert torch.equal(got[ok], cache[want[:, lo:hi]][ok])
    iq = IndexerQuery(torch.randn(n, 2, c, generator=g), torch.randn(n, 2, generator=g), cache, INDEXER, 4, 0.5)
    slot_form = KeySet(want, visible=visible)
    for key_block in (1, 5, 64):
        assert torch.equal(indexer_topk(iq, slice(0, n), ks, 4, key_block), indexer_topk(iq, slice(0, n), slot_form, 4, key_block))


def test_shared_key_set_over_consecutive_slots_reads_a_view_equal_to_the_gather():
    """A prefill key block whose slots are consecutive is read as a view of the cache (no copy);
    any other slot list is gathered. Both must be exactly cache[slots]."""
    cache = torch.randn(50, 3)
    for slots in (torch.arange(7, 27), torch.tensor([7, 8, 9, 11, 12]), torch.tensor([9, 8, 7]),
                  torch.tensor([4]), torch.tensor([5, 6, 7, 6, 9])):
        ks = KeySet(slots, visible=torch.tensor([slots.numel()]))
        for lo, hi in ((0, slots.numel()), (1, slots.numel()), (0, 0)):
            got = ks.read_unmasked(cache, lo, hi)
            assert torch.equal(got, cache[slots[lo:hi]])
            run = hi - lo >= 1 and bool((slots[lo + 1 : hi] - slots[lo : hi - 1] == 1).all())
            assert (got.data_ptr() == cache[int(slots[lo]):].data_ptr()) == run if hi > lo else True


@pytest.mark.parametrize("run_entries", [1, 24, 10**9])
def test_decode_rows_scored_in_place_over_page_runs_pick_the_gathered_entries(run_entries, monkeypatch):
    """Decode rows whose pages are runs of consecutive pages are scored on views of the key
    cache (paged_decode_scores), the others gathered: with integer-exact data both must give
    exactly the one-shot scores and top-k of the per-entry slot list, whatever the split
    (every row in place, some, none), with rows of one run, several runs, scattered pages,
    a partial last page and no entries at all."""
    monkeypatch.setattr(hybrid_v4, "IN_PLACE_RUN_ENTRIES", run_entries)
    g = torch.Generator().manual_seed(13)
    spp, heads, c, num_pages, k = 8, 3, 5, 64, 6
    rows = [list(range(10, 18)),  # one run of 8 pages
            list(range(30, 34)) + list(range(2, 6)),  # two runs
            [40, 7, 51, 3, 60, 20, 9, 44],  # scattered
            list(range(20, 28)),  # one run, partial last page
            [1] * 8]  # nothing visible
    pages = torch.tensor(rows)
    visible = torch.tensor([64, 64, 61, 59, 0])
    n, L = pages.shape[0], int(visible.max())
    cache = torch.randint(-2, 3, (num_pages * spp, c), generator=g).float()
    q = torch.randint(-2, 3, (n, heads, c), generator=g).float()
    weights = torch.randint(-2, 3, (n, heads), generator=g).float() / 4
    ks = KeySet(pages=pages, slots_per_page=spp, length=L, visible=visible)
    slot_form = KeySet(ks.slots, visible=visible)
    full = indexer_scores(q, weights, cache[slot_form.slots], 0.25).masked_fill(~slot_form.mask, float("-inf"))
    assert torch.equal(hybrid_v4.paged_decode_scores(q, weights, cache, ks, 0.25, key_block=16), full)
    iq = IndexerQuery(q, weights, cache, INDEXER, k, 0.25)
    assert torch.equal(indexer_topk(iq, slice(0, n), ks, k), select_topk(full, k))


def test_online_joint_attention_equals_one_pass_softmax():
    g = torch.Generator().manual_seed(6)
    n, L1, L2, slots = 5, 9, 70, 200
    q = torch.randn(n, H, D, generator=g)
    cache = torch.randn(slots, D, generator=g)
    swa = KeySet(torch.randint(0, slots, (L1,), generator=g), explicit_mask=torch.rand(n, L1, generator=g) > 0.4)
    visible = torch.tensor([0, 3, 20, 69, 70])  # one query sees no entry at all
    entries = KeySet(torch.randint(0, slots, (L2,), generator=g), visible=visible)
    sink = torch.randn(H, generator=g)
    want = joint_softmax_attention(q, [(cache[swa.slots], swa.mask), (cache[entries.slots], entries.mask)], sink, 0.3)
    for key_block in (1, 8, 64, 128):
        got = online_joint_attention(q, [(cache, swa), (cache, entries)], sink, 0.3, key_block)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_long_prefill_intermediates_are_bounded_by_the_block_sizes(kind, monkeypatch):
    """A long prefill chunk over a long cached prefix: the largest indexer score tensor and the
    largest attention logits stay within rows_block x heads x key_block (recorded at every
    call), the metadata holds no [rows, entries] mask, and the output equals the one-shot
    computation (key blocks longer than any entry list)."""
    from hybridkv.attention_backends.hybrid_metadata import PREFILL_BLOCK_ROWS

    key_block = 16
    step = _Step([(200, 300)], seed=7)  # 250 C4 entries / 125 C128 entries seen by the last rows
    meta = build_hybrid_metadata(step.seqs, HybridLayout(P, W, CSA, HCA))
    for blk in meta.blocks:
        for ks in blk.entries.values():
            assert ks.explicit_mask is None  # a causal prefix count, never a [rows, entries] mask
    T = meta.num_tokens
    g = torch.Generator().manual_seed(8)
    q = torch.randn(T, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    iq = IndexerQuery(torch.randn(T, NI, CI, generator=g), torch.randn(T, NI, generator=g), step.index_keys,
                      INDEXER, TOPK, CI**-0.5)
    cache, space = (step.c4, C4) if kind == "csa" else (step.c128, C128)

    # The torch indexer's score tensors and attention logits are what the block sizes bound (the
    # fused CPU kernels hold none: a packed key block and a top-k buffer per row; a row's logits).
    monkeypatch.setattr(hybrid_v4, "load_indexer_topk", lambda: None)
    monkeypatch.setattr(hybrid_v4, "load_joint_attention", lambda: None)

    def run(block: int) -> torch.Tensor:
        monkeypatch.setattr(hybrid_v4, "INDEXER_KEY_BLOCK", block)
        monkeypatch.setattr(hybrid_v4, "INDEXER_BLOCK_ELEMS", 0)  # the key block alone sets the width
        monkeypatch.setattr(hybrid_v4, "ENTRY_KEY_BLOCK", block)
        return HybridV4Attention().forward(q, step.swa, meta, sink, D**-0.5, cache, space,
                                           iq if kind == "csa" else None)

    one_shot = run(1 << 20)
    largest = {"scores": 0, "logits": 0}
    real_scores, real_logits = hybrid_v4.indexer_scores, hybrid_v4._logits

    def scores_spy(qa, w, keys, scale):
        largest["scores"] = max(largest["scores"], qa.shape[0] * qa.shape[1] * keys.shape[-2])
        return real_scores(qa, w, keys, scale)

    def logits_spy(qa, keys, scale):
        largest["logits"] = max(largest["logits"], qa.shape[0] * qa.shape[1] * keys.shape[-2])
        return real_logits(qa, keys, scale)

    monkeypatch.setattr(hybrid_v4, "indexer_scores", scores_spy)
    monkeypatch.setattr(hybrid_v4, "_logits", logits_spy)
    got = run(key_block)
    rows = min(PREFILL_BLOCK_ROWS, T)
    if kind == "csa":
        assert 0 < largest["scores"] <= rows * NI * key_block  # vs rows x NI x 250 entries one-shot
        # CSA attention reads the window plus the top-k: bounded by construction
        assert largest["logits"] <= rows * H * max(W + rows, TOPK)
    else:
        assert largest["scores"] == 0
        # the sliding set is read as one block (window + rows keys), the entries in key blocks
        assert largest["logits"] <= rows * H * max(W + rows, key_block)
    # The same selection (CSA: exactly the same keys) and the same attention up to rounding.
    torch.testing.assert_close(got, one_shot, atol=1e-5, rtol=0)
