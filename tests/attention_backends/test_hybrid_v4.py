"""The hybrid (DeepSeek-V4) attention backend and its per-step metadata, against a dense
reference written from the math, with random page assignments, released SWA pages and
decodes mixed with prefill chunks in one step."""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.attention_backends.hybrid_metadata import (
    C4, C128, INDEXER, STATE, SWA, HybridLayout, build_hybrid_metadata,
)
from hybridkv.attention_backends.hybrid_v4 import HybridV4Attention, IndexerQuery, joint_softmax_attention, select_topk
from hybridkv.attention_backends.metadata import StepSequences
from hybridkv.block_manager.space_spec import NULL_PAGE
from tiny_deepseek_v4 import single_thread

P, W, CSA, HCA = 8, 5, 2, 4  # page size, sliding window, ratios (P is a multiple of both)
H, D, NI, CI, TOPK = 3, 16, 4, 8, 3
SPACES = {SWA: 1, STATE: 1, C4: CSA, INDEXER: CSA, C128: HCA}


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
                if space in (SWA, STATE):  # pages wholly before the window are released
                    window = W if space == SWA else 2 * CSA if HCA < 2 * CSA else HCA
                    for i in range(max(0, start - window + 1) // P):
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


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_backend_matches_dense_reference_over_random_pages(kind):
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
    step = _Step([(36, 1), (7, 1), (20, 15), (0, 12), (3, 300)], seed=4)
    meta = build_hybrid_metadata(step.seqs, HybridLayout(P, W, CSA, HCA))
    state = torch.full((65 * P,), -1, dtype=torch.long)
    for i, (start, n) in enumerate(step.spans):
        for t in range(max(0, start - 2 * HCA), start + n):
            page = step.tables[STATE][i][t // P]
            if page != NULL_PAGE:
                state[page * P + t % P] = t
    # The step's state slot mapping covers exactly the new tokens, in order.
    new_positions = [t for s, n in step.spans for t in range(s, s + n)]
    assert state[meta.state_slot_mapping].tolist() == new_positions
    for kind, ratio, overlap, spaces in (("csa", CSA, True, (C4, INDEXER)), ("hca", HCA, False, (C128,))):
        plan = meta.plans[kind]
        want_windows = [(i, w) for i, (s, n) in enumerate(step.spans) for w in range(s // ratio, (s + n) // ratio)]
        assert plan.num_entries == len(want_windows)
        for e, (i, w) in enumerate(want_windows):
            assert plan.positions[e].item() == w * ratio
            first = w * ratio - (ratio if overlap else 0)
            rows = [first + j for j in range(plan.row_slots.shape[1])]
            assert plan.row_valid[e].tolist() == [r >= 0 for r in rows]
            got = state[plan.row_slots[e]].tolist()
            assert [x for x, r in zip(got, rows) if r >= 0] == [r for r in rows if r >= 0]
            for space in spaces:
                assert plan.out_slots[space][e].item() == step.slot(i, space, w)
