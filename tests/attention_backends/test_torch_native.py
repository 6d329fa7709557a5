"""The torch-native paged backend and its block-table metadata, against dense attention written
from the definition: random page assignments, released (NULL_PAGE) pages of a windowed space,
decodes mixed with prefill chunks, and tile sizes small enough that every path runs (one-tile
decode, split-KV decode with the log-sum-exp merge, SDPA is_causal, prefill tiles over several
key blocks merged by their log-sum-exp, masked edge blocks with fully masked rows). The pool outside the null page is NaN, standing in for the
uninitialised memory of a torch.empty pool: a masked read of it would poison the output."""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.attention_backends.metadata import (
    DEFAULT_TILES, StepSequences, TileSizes, build_attention_metadata, regenerated_rows,
)
from hybridkv.attention_backends import torch_native
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.block_manager.space_spec import NULL_PAGE, window_start

P, H, HKV, D = 4, 4, 2, 8
NUM_PAGES = 200  # real pages 1..NUM_PAGES; page 0 is the null page
SMALL_TILES = TileSizes(kv_chunk=8, decode_tile_keys=24, prefill_q_tile=5,
                        min_view_keys=P)


class _Step:
    """One step: the block table rows, cached K/V for the positions before each chunk, and the
    new tokens' q/k/v. Logical K/V per sequence and position are kept for the reference."""

    def __init__(self, spans: list[tuple[int, int]], window: int | None, seed: int, pages: str = "shuffled",
                 value_seed: int | None = None) -> None:
        """value_seed: other q/k/v over the same block tables (as the next layer of a step sees)."""
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed if value_seed is None else value_seed)
        self.spans, self.window = spans, window
        pool = list(range(NUM_PAGES, 0, -1))  # popped from the end: "consecutive" = ascending pages
        if pages == "shuffled":
            rng.shuffle(pool)
        elif pages == "runs":  # runs of 3 consecutive pages in random order: views and gathers mixed
            runs = [pool[i : i + 3] for i in range(0, NUM_PAGES, 3)]
            rng.shuffle(runs)
            pool = [x for r in runs for x in r]
        self.k_cache = torch.full((HKV, (NUM_PAGES + 1) * P, D), float("nan"))
        self.v_cache = torch.full((HKV, (NUM_PAGES + 1) * P, D), float("nan"))
        self.k_cache[:, :P] = 0  # the null page
        self.v_cache[:, :P] = 0
        tables, self.logical = [], []
        for start, n in spans:
            end = start + n
            table = [pool.pop() for _ in range(-(-end // P))]
            for i in range(window_start(start, window) // P):  # released: out of the window
                table[i] = NULL_PAGE
            keys = torch.randn(end, HKV, D, generator=g)
            vals = torch.randn(end, HKV, D, generator=g)
            for t in range(window_start(start, window), start):  # what earlier steps wrote
                slot = table[t // P] * P + t % P
                self.k_cache[:, slot], self.v_cache[:, slot] = keys[t], vals[t]
            tables.append(table)
            self.logical.append((keys, vals))
        self.seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
        self.q = torch.randn(sum(n for _, n in spans), H, D, generator=g)
        self.k = torch.cat([k[s : s + n] for (s, n), (k, _) in zip(spans, self.logical)])
        self.v = torch.cat([v[s : s + n] for (s, n), (_, v) in zip(spans, self.logical)])

    def reference(self) -> torch.Tensor:
        out, row = [], 0
        for (start, n), (keys, vals) in zip(self.spans, self.logical):
            for t in range(start, start + n):
                lo = window_start(t, self.window)
                k = keys[lo : t + 1].repeat_interleave(H // HKV, dim=1)  # [L, H, D]
                v = vals[lo : t + 1].repeat_interleave(H // HKV, dim=1)
                p = torch.softmax(torch.einsum("hd,lhd->hl", self.q[row], k) * D**-0.5, dim=-1)
                out.append(torch.einsum("hl,lhd->hd", p, v))
                row += 1
        return torch.stack(out)


# decodes first (one short, one long enough to split, one past its window), then prefill
# chunks: from position 0, after a cached prefix, long with a long prefix
SPANS = [(40, 1), (3, 1), (0, 1), (101, 1), (0, 12), (20, 15), (33, 40)]


def backend(decode: str) -> TorchNativeAttention:
    """decode="kernel": the C++ paged kernel reads K/V in place (it must build here: CI installs
    g++); "tiles": the torch path over the metadata's decode tiles."""
    be = TorchNativeAttention(cpu_kernels=decode == "kernel")
    assert (decode == "kernel") == (not be.needs_decode_tiles), "the CPU paged kernel did not build on this machine"
    return be


@pytest.mark.parametrize("decode", ["tiles", "kernel"])
@pytest.mark.parametrize("pages", ["shuffled", "runs", "consecutive"])
@pytest.mark.parametrize("window", [None, 7, 30])
@pytest.mark.parametrize("tiles", [DEFAULT_TILES, SMALL_TILES], ids=["default_tiles", "small_tiles"])
def test_backend_matches_dense_reference_over_random_pages(window, tiles, pages, decode):
    step = _Step(SPANS, window, seed=0 if window is None else window, pages=pages)
    be = backend(decode)
    step.seqs.decode_tiles = be.needs_decode_tiles
    meta = build_attention_metadata(step.seqs, {"full": window}, P, tiles)
    assert bool(meta.spaces["full"].decode_tiles) == (decode == "tiles"), "tiles built only for the torch path"
    got = be.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, "full", D**-0.5)
    assert not got.isnan().any(), "a masked key read uninitialised (NaN) pool memory"
    torch.testing.assert_close(got, step.reference(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [7, 30])
def test_edge_masks_kept_for_the_step_serve_every_layer(window):
    """A prefill tile's edge masks are built by the first layer and kept on the step's
    PrefillSeq (layer_memo); a second layer, with other q/k/v over the same tables, must still
    match the dense reference, and must not build new ones. (Windowed spaces: without a window
    a chunk after context takes _prefill_after_context, which builds no masks.)"""
    first = _Step(SPANS, window, seed=5)
    second = _Step(SPANS, window, seed=5, value_seed=6)
    be = backend("kernel")
    first.seqs.decode_tiles = be.needs_decode_tiles
    meta = build_attention_metadata(first.seqs, {"full": window}, P, SMALL_TILES)
    prefills = meta.spaces["full"].prefills
    got = be.forward(first.q, first.k, first.v, first.k_cache, first.v_cache, meta, "full", D**-0.5)
    torch.testing.assert_close(got, first.reference(), atol=1e-5, rtol=1e-5)
    kept = [dict(p.layer_memo) for p in prefills]
    assert any(k[0] == "edge" for memo in kept for k in memo), "no edge mask was kept for the step"
    got = be.forward(second.q, second.k, second.v, second.k_cache, second.v_cache, meta, "full", D**-0.5)
    torch.testing.assert_close(got, second.reference(), atol=1e-5, rtol=1e-5)
    assert [p.layer_memo.keys() for p in prefills] == [k.keys() for k in kept], "the second layer rebuilt masks"


@pytest.mark.parametrize("pages", ["shuffled", "consecutive"])
@pytest.mark.parametrize("tiles", [DEFAULT_TILES, SMALL_TILES], ids=["default_tiles", "small_tiles"])
def test_chunks_after_context_without_a_window_match_the_reference_in_one_or_two_passes(tiles, pages, monkeypatch):
    """No window, a chunk after cached context: a context of at most a quarter of the chunk runs
    as one causal call behind rows of zero queries (one call per chunk); a longer one as the
    chunk's causal call plus the context in kv_chunk blocks merged by log-sum-exp. Both must
    match the dense reference, and neither may take the masked query tiles."""
    spans = [(2, 1), (3, 40), (10, 40), (11, 40), (33, 20), (100, 3)]  # (10, 40): the boundary
    step = _Step(spans, None, seed=3, pages=pages)
    be = backend("kernel")
    step.seqs.decode_tiles = be.needs_decode_tiles
    meta = build_attention_metadata(step.seqs, {"full": None}, P, tiles)
    calls = []
    flash = torch_native._flash
    monkeypatch.setattr(torch_native, "_flash", lambda *a, **k: calls.append(1) or flash(*a, **k))
    got = be.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, "full", D**-0.5)
    assert not got.isnan().any(), "a key outside the context read uninitialised (NaN) pool memory"
    torch.testing.assert_close(got, step.reference(), atol=1e-5, rtol=1e-5)
    prefills = meta.spaces["full"].prefills
    short = [p for p in prefills if 4 * p.start <= p.query_end - p.query_start]
    assert len(short) == 2, "the spans no longer cover both paths"
    passes = sum(1 if p in short else 1 + len(p.key_blocks(0, p.start, tiles.kv_chunk, tiles.min_view_keys))
                 for p in prefills)
    assert len(calls) == passes, "a chunk took other calls than one pass, or one plus one per context block"
    assert not any(k[0] == "edge" for p in prefills for k in p.layer_memo), "a chunk built the tiles' edge masks"


def test_small_tiles_exercise_every_path():
    step = _Step(SPANS, None, seed=1)
    sm = build_attention_metadata(step.seqs, {"full": None}, P, SMALL_TILES).spaces["full"]
    assert sm.decode_split and len(sm.decode_tiles) > 1
    assert max(t.slots.numel() for t in sm.decode_tiles) <= SMALL_TILES.decode_tile_keys
    assert [p.own_kv for p in sm.prefills] == [True, False, False]


def test_key_blocks_read_runs_in_place_and_gather_the_rest():
    """A prefill's keys are cut at run boundaries: runs of at least min_view_keys consecutive
    slots become views (a slot), shorter runs merge into gathered blocks; together the blocks
    cover the key range exactly once, in order, none longer than the chunk."""
    for pages in ("shuffled", "runs", "consecutive"):
        step = _Step([(33, 40)], None, seed=3, pages=pages)
        p = build_attention_metadata(step.seqs, {"full": None}, P, SMALL_TILES).spaces["full"].prefills[0]
        for k0, k1, chunk, min_view in ((0, 73, 8, P), (5, 70, 1000, 2 * P), (0, 73, 73, 1)):
            blocks = p.key_blocks(k0, k1, chunk, min_view)
            assert [b[0] for b in blocks] == [k0] + [b[1] for b in blocks[:-1]] and blocks[-1][1] == k1
            for c0, c1, slot in blocks:
                assert c1 - c0 <= chunk
                if slot is not None:
                    assert p.key_slots[c0:c1].tolist() == list(range(slot, slot + c1 - c0))
            views = sum(c1 - c0 for c0, c1, s in blocks if s is not None)
            if pages == "consecutive":
                assert views == k1 - k0, "one run of consecutive pages must be read in place"
            if pages == "shuffled" and min_view > P:
                assert views <= P * 2, "random pages are short runs: gathered"


def test_all_decodes_only_and_one_tile_fast_path():
    step = _Step([(9, 1), (2, 1), (17, 1)], None, seed=2)
    meta = build_attention_metadata(step.seqs, {"full": None}, P)
    assert len(meta.spaces["full"].decode_tiles) == 1 and not meta.spaces["full"].decode_split
    got = backend("tiles").forward(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, "full", D**-0.5)
    torch.testing.assert_close(got, step.reference(), atol=1e-5, rtol=1e-5)


def test_slot_mapping_writes_each_new_token_through_its_block_table_row():
    step = _Step(SPANS, 7, seed=3)
    sm = build_attention_metadata(step.seqs, {"full": 7}, P).spaces["full"]
    table = step.seqs.block_tables["full"]
    want = [int(table[i, t // P]) * P + t % P for i, (s, n) in enumerate(SPANS) for t in range(s, s + n)]
    assert sm.slot_mapping.tolist() == want
    assert min(want) >= P  # never the null page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_plain_key_blocks_agree_including_fully_masked_rows(dtype):
    """_attend_block's two implementations (the CPU flash kernel; plain ops, what a CUDA tensor
    gets) give the same output and log-sum-exp; a row whose keys are all masked comes back as
    zeros from both (its log-sum-exp is not used: the caller gives it no weight)."""
    from hybridkv.attention_backends.torch_native import _attend_block

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g).to(dtype), torch.randn(1, 2, 11, 8, generator=g).to(dtype),
               torch.randn(1, 2, 11, 8, generator=g).to(dtype))
    allowed = torch.rand(6, 11, generator=g) > 0.4
    allowed[2] = False
    mask = torch.zeros(6, 11, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    fused, plain = _attend_block(q, k, v, mask, 0.3, fused=True), _attend_block(q, k, v, mask, 0.3, fused=False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused[0].float(), plain[0].float(), **tol)
    seen = allowed.any(-1)
    torch.testing.assert_close(fused[1][..., seen].float(), plain[1][..., seen].float(), **tol)
    assert fused[0][..., 2, :].abs().max() == 0 and plain[0][..., 2, :].abs().max() == 0
    ref = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * 0.3 + mask.float(), -1).nan_to_num(0) @ v.float()
    torch.testing.assert_close(plain[0].float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_paged_kernel_matches_the_tiles_on_long_gqa_decodes(dtype, window):
    """The C++ kernel against the torch path on what the engine runs: several decodes of
    different lengths (one far longer than a tile), 3 query heads per KV head, head size 64,
    page 16, in float32 and bfloat16 (float32 accumulation in both paths), pages in random
    order with the rest of the pool NaN (it must read only the sequence's own written keys)."""
    g = torch.Generator().manual_seed(7)
    P16, hkv, grp, d, pool = 16, 2, 3, 64, 400
    lens = [1, 17, 300, 2000]
    k_cache = torch.full((hkv, pool * P16, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[:, :P16] = 0
    v_cache[:, :P16] = 0
    perm = (torch.randperm(pool - 1, generator=g) + 1).tolist()
    tables = []
    for n in lens:
        pages = [perm.pop() for _ in range(-(-n // P16))]
        for t in range(window_start(n - 1, window), n):
            slot = pages[t // P16] * P16 + t % P16
            k_cache[:, slot] = torch.randn(hkv, d, generator=g).to(dtype)
            v_cache[:, slot] = torch.randn(hkv, d, generator=g).to(dtype)
        for i in range(window_start(n - 1, window) // P16):
            pages[i] = NULL_PAGE
        tables.append(pages)
    q = torch.randn(len(lens), hkv * grp, d, generator=g).to(dtype)
    outs = {}
    for decode in ("tiles", "kernel"):
        be = backend(decode)
        seqs = StepSequences.from_page_lists([1] * len(lens), lens, {"full": tables})
        seqs.decode_tiles = be.needs_decode_tiles
        meta = build_attention_metadata(seqs, {"full": window}, P16)
        # The new keys were already written above: forward writes them again to the same slots.
        k_new = torch.stack([k_cache[:, tables[i][(n - 1) // P16] * P16 + (n - 1) % P16] for i, n in enumerate(lens)])
        v_new = torch.stack([v_cache[:, tables[i][(n - 1) // P16] * P16 + (n - 1) % P16] for i, n in enumerate(lens)])
        outs[decode] = be.forward(q, k_new, v_new, k_cache, v_cache, meta, "full", d**-0.5)
    assert not outs["kernel"].float().isnan().any(), "the kernel read a key outside the sequence's window"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["kernel"].float(), outs["tiles"].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [-1, 5])
@pytest.mark.parametrize("D", [8, 32, 64])  # 8: the plain loops; 32 / 64: the vectorized block loops
def test_cpu_paged_kernel_groups_of_consecutive_queries_are_causal(window, D):
    """A kernel group of several rows (consecutive positions of one sequence, the shape of a short
    prefill chunk) gives each row only the keys up to its own position and inside its own window,
    against attention written from the definition; keys after the last row are NaN (unwritten)."""
    from hybridkv.attention_backends.cpu_kernels import load_paged_attention

    kernel = load_paged_attention()
    assert kernel is not None, "the CPU paged kernel did not build on this machine"
    g = torch.Generator().manual_seed(5)
    pages = 50
    k_cache = torch.randn(HKV, pages * P, D, generator=g)
    v_cache = torch.randn(HKV, pages * P, D, generator=g)
    row_pages = (torch.randperm(pages - 1, generator=g)[:12] + 1).to(torch.int32)
    positions = torch.tensor([20, 21, 22], dtype=torch.int32)
    for t in range(23, 12 * P):  # not written yet: a read would poison the output
        slot = int(row_pages[t // P]) * P + t % P
        k_cache[:, slot] = float("nan")
        v_cache[:, slot] = float("nan")
    q = torch.randn(3, H, D, generator=g)
    got = kernel(q, k_cache, v_cache, row_pages.view(1, -1), torch.tensor([0, 3], dtype=torch.int32),
                 torch.tensor([0], dtype=torch.int32), positions, P, window, D**-0.5)
    want = []
    for i, p in enumerate(positions.tolist()):
        lo = 0 if window < 0 else max(0, p - window + 1)
        slots = torch.tensor([int(row_pages[t // P]) * P + t % P for t in range(lo, p + 1)])
        k = k_cache[:, slots].repeat_interleave(H // HKV, 0)
        v = v_cache[:, slots].repeat_interleave(H // HKV, 0)
        want.append(torch.einsum("hl,hld->hd", (torch.einsum("hd,hld->hl", q[i], k) * D**-0.5).softmax(-1), v))
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-5)


def _prefill_kernel_case(spans, window, dtype, d, grp, hkv=2, page=16, seed=0):
    """Caches with the keys of each (start, n) chunk and its visible prefix written on random pages
    (the rest of the pool NaN), the kernel's group tensors, and attention from the definition
    (float64) for every query row."""
    g = torch.Generator().manual_seed(seed)
    pool = 1 + sum(-(-(s + n) // page) for s, n in spans)
    k_cache = torch.full((hkv, (pool + 1) * page, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = (torch.randperm(pool, generator=g) + 1).tolist()
    h = hkv * grp
    tables, want, starts, positions = [], [], [0], []
    q = torch.randn(sum(n for _, n in spans), h, d, generator=g).to(dtype)
    row = 0
    for start, n in spans:
        end = start + n
        pages = [perm.pop() for _ in range(-(-end // page))]
        keys = torch.randn(end, hkv, d, generator=g).to(dtype)
        vals = torch.randn(end, hkv, d, generator=g).to(dtype)
        for t in range(window_start(start, window), end):
            slot = pages[t // page] * page + t % page
            k_cache[:, slot], v_cache[:, slot] = keys[t], vals[t]
        for t in range(start, end):
            lo = window_start(t, window)
            k = keys[lo : t + 1].double().repeat_interleave(grp, dim=1)
            v = vals[lo : t + 1].double().repeat_interleave(grp, dim=1)
            p = torch.softmax(torch.einsum("hd,lhd->hl", q[row].double(), k) * d**-0.5, dim=-1)
            want.append(torch.einsum("hl,lhd->hd", p, v))
            positions.append(t)
            row += 1
        tables.append(pages)
        starts.append(row)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [NULL_PAGE] * (width - len(t)) for t in tables], dtype=torch.int32)
    args = (q, k_cache, v_cache, table, torch.tensor(starts, dtype=torch.int32),
            torch.arange(len(spans), dtype=torch.int32), torch.tensor(positions, dtype=torch.int32), page,
            -1 if window is None else window, d**-0.5)
    return args, torch.stack(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("d, grp", [(16, 1), (64, 3), (128, 4)])
def test_cpu_prefill_kernel_matches_attention_from_the_definition(dtype, window, d, grp):
    """The C++ prefill kernel, several chunks in one call: from position 0 (1, 7 and 300 queries:
    within one query tile, over several tiles and 64-key blocks), and after a cached prefix (a
    short chunk late in a long context, a long one after a short prefix). Each row sees the keys
    up to its own position inside its window and nothing else: unwritten slots and pages outside
    the chunks are NaN, so a stray read poisons the output."""
    from hybridkv.attention_backends.cpu_kernels import load_prefill_attention

    kernel = load_prefill_attention()
    assert kernel is not None, "the CPU prefill kernel did not build on this machine"
    spans = [(0, 1), (0, 7), (0, 300), (1000, 37), (50, 200)]
    args, want = _prefill_kernel_case(spans, window, dtype, d, grp)
    got = kernel(*args)
    assert not got.float().isnan().any(), "the kernel read a key outside a row's causal window"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("loader, dtype", [
    ("load_paged_attention", torch.float32), ("load_paged_attention", torch.bfloat16),
    ("load_prefill_attention", torch.float32), ("load_prefill_attention", torch.bfloat16),
    ("load_prefill_attention_bf16", torch.bfloat16),
])
def test_cpu_attention_kernels_read_q_through_its_strides(loader, dtype):
    """The backend hands the kernels q as a view into the fused QKV output (rows further apart
    than H x D) without copying it: each kernel reads it through its strides and returns a
    contiguous result bit-identical to the one for a contiguous copy of q."""
    from hybridkv.attention_backends import cpu_kernels

    kernel = getattr(cpu_kernels, loader)()
    if kernel is None:
        pytest.skip(f"{loader}: this CPU has no such kernel")
    args, _ = _prefill_kernel_case([(0, 40), (30, 9)], None, dtype, 64, 3)
    q = args[0]
    qkv = torch.cat([q, torch.full((q.shape[0], 4, q.shape[2]), float("nan"), dtype=dtype)], dim=1)
    view = qkv[:, : q.shape[1]]  # the query heads of each row, then 4 heads of NaN the kernel must not read
    assert not view.is_contiguous()
    got = kernel(view, *args[1:])
    assert got.is_contiguous() and torch.equal(got, kernel(q.contiguous(), *args[1:]))


@pytest.mark.slow
def test_cpu_prefill_kernel_built_for_avx2_matches_attention_from_the_definition(monkeypatch):
    """The kernel as an AVX2-only CPU (e.g. AMD Zen 3) builds it: 8 lanes and the scalar-exp
    softmax loops that the AVX-512 build replaces with its vector exp. Built here with the AVX2
    flags whatever this CPU has, and held to the same definition as the native build."""
    from pathlib import Path

    from hybridkv.attention_backends.cpu_kernels import _PAGED_GROUPS, build

    monkeypatch.setattr(build, "isa_flags", lambda: ("avx2", ["-mavx2", "-mfma", "-mf16c"]))
    source = Path(build.__file__).with_name("prefill_attention.cpp")
    module = build.build_cpu_extension("hybridkv_prefill_attention", source, ["prefill_attention"],
                                       "CPU prefill-attention kernel (AVX2 build)", headers=(_PAGED_GROUPS,))
    assert module is not None, "the prefill kernel did not build for AVX2"
    for window in (None, 70):
        args, want = _prefill_kernel_case([(0, 300), (50, 200)], window, torch.float32, 64, 3)
        got = module.prefill_attention(*args)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def assert_same_bits_on_one_and_two_threads(kernel, dtype) -> None:
    """A prefill kernel's output on one thread and on two is the same bits (a long chunk from 0
    and a short one after a prefix)."""
    args, _ = _prefill_kernel_case([(0, 500), (200, 64)], None, dtype, 64, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*args)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(kernel(*args), one), "the output depends on the thread count"
    finally:
        torch.set_num_threads(threads)


def test_cpu_prefill_kernel_output_does_not_depend_on_the_thread_count():
    """Work items go to threads largest first from a shared counter: the split may differ from
    run to run, the result may not (each item owns its rows)."""
    from hybridkv.attention_backends.cpu_kernels import load_prefill_attention

    assert_same_bits_on_one_and_two_threads(load_prefill_attention(), torch.float32)


def _mixed_step(spans, dtype, page, d, hkv=2, grp=3, seed=3):
    """q, k, v of a step over `spans` (start, new tokens), random caches (every slot written) and
    block tables of shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    pool = 1 + sum(-(-(s + n) // page) for s, n in spans)
    k_cache = torch.randn(hkv, (pool + 1) * page, d, generator=g).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = (torch.randperm(pool, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-(s + n) // page))] for s, n in spans]
    T = sum(n for _, n in spans)
    q = torch.randn(T, hkv * grp, d, generator=g).to(dtype)
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, tables


@pytest.mark.parametrize("kernel", ["float32", "bf16_via_float32_kernel", "bf16_kernel"])
@pytest.mark.parametrize("window", [None, 40])
def test_rows_attended_alone_get_the_bits_the_whole_step_gives_them(kernel, window, monkeypatch):
    """A model's last layer asks only for the rows it samples (out_rows): every row's K/V is
    still written, and each chosen row's output is bit for bit the one the whole step computes
    for it -- through the prefill kernel as one-row groups (a chunk's last row), runs of rows
    (a whole chunk, as prompt logprobs would read), regenerated rows (a request recomputed after
    a preemption: the paged kernel), decodes, and no row at all (chunks that sample nothing)."""
    from hybridkv.attention_backends import torch_native

    dtype = torch.float32 if kernel == "float32" else torch.bfloat16
    monkeypatch.setattr(torch_native, "_native_bf16_matmuls", lambda: kernel == "bf16_kernel")
    be = TorchNativeAttention()
    page, d = 16, 64
    if kernel == "bf16_kernel" and be._prefill_bf16 is None:
        pytest.skip("this CPU has no bf16 dot products for the bf16 prefill kernel")
    # decodes, then chunks: from 0, after a prefix, long after a long prefix, a short one late,
    # and a resumed request whose chunk runs past its 70-token prompt (rows at 70..79 regenerated)
    spans = [(40, 1), (130, 1), (0, 90), (64, 33), (300, 120), (500, 7), (60, 20)]
    q, k, v, k_cache, v_cache, tables = _mixed_step(spans, dtype, page, d)
    seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
    seqs.decode_tiles = be.needs_decode_tiles
    seqs.prompt_lens = [0, 0, 90, 97, 420, 507, 70]
    meta = build_attention_metadata(seqs, {"full": window}, page)
    assert meta.regenerated is not None and meta.regenerated[0].tolist() == list(range(262, 272))
    kc, vc = k_cache.clone(), v_cache.clone()
    whole = be.forward(q, k, v, kc, vc, meta, "full", d**-0.5)
    ends = (meta.query_start_loc[1:] - 1).tolist()  # each sequence's last row: 0, 1, 91, 124, 244, 251, 271
    cases = {
        "sampled": ends,
        "some chunks sample nothing": [0, 1, 124, 271],
        "a whole chunk and last rows": [0, 1] + list(range(92, 125)) + [244, 271],
        "regenerated rows among others": [1, 91, 255, 262, 263, 270],
        "prefill rows only": [91, 244],
        "no row": [],
    }
    for name, rows in cases.items():
        out_rows = torch.tensor(rows, dtype=torch.long)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        got = be.forward(q, k, v, kc2, vc2, meta, "full", d**-0.5, out_rows)
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc), f"{name}: every row's K/V must be written"
        assert got.shape == (len(rows), *q.shape[1:]), name
        assert torch.equal(got, whole[out_rows]), f"{name}: rows attended alone changed their bits"


@pytest.mark.parametrize("loader", ["load_paged_attention", "load_prefill_attention"])
def test_cpu_kernels_refuse_groups_that_do_not_cover_q(loader):
    """The kernels index q, their output and the block table by the groups unchecked in their
    loops, so a call whose groups miss q's rows or name a row past the table is an error, not a
    write past the output."""
    from hybridkv.attention_backends import cpu_kernels

    kernel = getattr(cpu_kernels, loader)()
    args, _ = _prefill_kernel_case([(0, 40), (30, 9)], None, torch.float32, 64, 3)
    q, k_cache, v_cache, table, starts, rows, positions, *rest = args
    assert kernel(*args).shape == q.shape
    with pytest.raises(RuntimeError, match="group_start must run from 0"):
        kernel(q[:10], k_cache, v_cache, table, starts, rows, positions[:10], *rest)
    with pytest.raises(RuntimeError, match="one position per query row"):
        kernel(q, k_cache, v_cache, table, starts, rows, positions[:10], *rest)
    with pytest.raises(RuntimeError, match="not a row of the block table"):
        kernel(q, k_cache, v_cache, table, starts, rows + table.shape[0], positions, *rest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_prefills_through_the_cpu_kernel_match_the_sdpa_path_in_a_mixed_step(dtype, window, monkeypatch):
    """A step of decodes and prefill chunks (from 0, after a prefix) with the engine's shapes (head
    size 64, 3 query heads per KV head): the backend sends the prefills to the C++ kernel, and
    the result equals the SDPA / tile path's (cpu_kernels=False). bfloat16 goes to the kernel
    only on CPUs without bf16 dot products; the test poses as one."""
    from hybridkv.attention_backends import torch_native

    monkeypatch.setattr(torch_native, "_native_bf16_matmuls", lambda: False)
    page, d = 16, 64
    spans = [(40, 1), (130, 1), (0, 90), (64, 33), (300, 120)]
    q, k, v, k_cache, v_cache, tables = _mixed_step(spans, dtype, page, d)
    outs = {}
    for name, kernels in (("kernel", True), ("torch", False)):
        be = TorchNativeAttention(cpu_kernels=kernels)
        assert (be._prefill_kernel is not None) == kernels, "the CPU prefill kernel did not build on this machine"
        seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
        seqs.decode_tiles = be.needs_decode_tiles
        meta = build_attention_metadata(seqs, {"full": window}, page)
        kc, vc = k_cache.clone(), v_cache.clone()
        calls = []
        if kernels:
            kernel = be._prefill_kernel
            be._prefill_kernel = lambda *a: calls.append(1) or kernel(*a)
        outs[name] = be.forward(q, k, v, kc, vc, meta, "full", d**-0.5)
        assert len(calls) == kernels, "the prefills did not go to the C++ kernel exactly once for the step"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["kernel"].float(), outs["torch"].float(), atol=tol, rtol=tol)


def test_the_prefill_kernel_follows_the_dtype_and_the_cpu(monkeypatch):
    """float32: the float32 kernel. bfloat16: that kernel too where the CPU has no bf16 dot
    products; where it has them, the bf16 kernel (built only where there is AMX or AVX512-BF16)
    for head sizes that are multiples of 64, else SDPA (None)."""
    from hybridkv.attention_backends import torch_native

    be = TorchNativeAttention()
    q, kc = torch.zeros(4, 6, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    for native in (True, False):
        monkeypatch.setattr(torch_native, "_native_bf16_matmuls", lambda: native)
        want = be._prefill_bf16 if native else be._prefill_kernel
        assert be._prefill_kernel_for(q, kc) is want
        assert be._prefill_kernel_for(q.float(), kc.float()) is be._prefill_kernel, "float32 always takes the kernel"
    monkeypatch.setattr(torch_native, "_native_bf16_matmuls", lambda: True)
    assert be._prefill_kernel_for(q[..., :32], kc[..., :32]) is None, "bf16 head size 32 stays on SDPA"
    assert be._prefill_kernel_for(torch.zeros(4, 6, 8), torch.zeros(2, 32, 8)) is None, "head size 8 is not whole vectors"


@pytest.mark.parametrize("D", [64, 128])
def test_cpu_paged_kernel_in_bfloat16_loses_only_the_output_rounding(D):
    """bf16 decodes (with AVX512-BF16, scores by vdpbf16ps on the stored rows; elsewhere widened to
    float32) against the same kernel on the same values in float32: each output differs by at most
    its bf16 rounding (2^-8 relative) plus float32 summation noise, so the bf16 path computes in
    float32 throughout and rounds nothing but its result."""
    from hybridkv.attention_backends.cpu_kernels import load_paged_attention

    kernel = load_paged_attention()
    g = torch.Generator().manual_seed(11)
    hkv, grp, page, n = 3, 3, 16, 6
    lens = [1, 17, 95, 300, 64, 129]
    pages = sum(-(-x // page) for x in lens)
    k_cache = torch.randn(hkv, (pages + 1) * page, D, generator=g).bfloat16()
    v_cache = torch.randn_like(k_cache).bfloat16()
    perm = (torch.randperm(pages, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-x // page))] for x in lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(n, hkv * grp, D, generator=g).bfloat16()
    rows = torch.arange(n + 1, dtype=torch.int32)
    pos = torch.tensor([x - 1 for x in lens], dtype=torch.int32)
    got = kernel(q, k_cache, v_cache, table, rows, rows[:n], pos, page, -1, D**-0.5).float()
    want = kernel(q.float(), k_cache.float(), v_cache.float(), table, rows, rows[:n], pos, page, -1, D**-0.5)
    assert ((got - want).abs() <= want.abs() * 2.0**-8 + 1e-5).all(), (got - want).abs().max()


def test_regenerated_rows_are_the_prefill_rows_at_generated_positions():
    """Decodes first (never counted), then a prompt chunk, a resumed request whose chunk crosses
    its prompt's end (positions 5..8 of a 7-token prompt: rows 7 and 8 of the flat batch, at
    positions 7 and 8), and one wholly past its prompt (rows 9 and 10)."""
    seqs = StepSequences.from_page_lists([1, 1, 3, 4, 2], [10, 20, 3, 9, 14], {"full": [[1]] * 5})
    assert regenerated_rows(seqs) is None, "prompt lengths unknown: nothing is regenerated"
    seqs.prompt_lens = [5, 5, 8, 7, 3]
    rows, seq, pos = regenerated_rows(seqs)
    assert rows.tolist() == [7, 8, 9, 10] and seq.tolist() == [3, 3, 4, 4] and pos.tolist() == [7, 8, 12, 13]
    assert rows.dtype == torch.long and seq.dtype == pos.dtype == torch.int32
    seqs.prompt_lens = [5, 5, 8, 9, 20]
    assert regenerated_rows(seqs) is None
