"""The fused CPU lightning indexer (cpu_kernels/indexer_topk.cpp, routed by
hybrid_v4.cpu_indexer_topk) picks exactly what the torch indexer (hybrid_v4.indexer_topk) picks.

Integer-valued queries, weights and keys make every score exact whatever the summation order,
so the two must agree entry for entry, ties included (ReLU makes exact ties common): shared
slot lists and page-form decode rows, causal prefixes shorter than k, every head-vector count
the kernel is compiled for, row chunks and entry segments split over threads, float32,
bfloat16 and FP8 keys. On random data the scores round differently, so there the kernel's choice is
checked against float64 scores to rounding. FP8 keys (kv_cache_dtype) are widened exactly as the
kernel reads them, so they select exactly what their float32 widening selects."""
from __future__ import annotations

import pytest
import torch

from hybridkv.attention_backends import hybrid_v4
from hybridkv.attention_backends.cpu_kernels import kernels_enabled, load_indexer_topk
from hybridkv.attention_backends.hybrid_metadata import INDEXER, KeySet
from hybridkv.attention_backends.hybrid_v4 import HybridV4Attention, IndexerQuery, cpu_indexer_topk, indexer_topk
from hybridkv.attention_backends.kv_cache_dtype import quantize_kv

kernel = load_indexer_topk()
FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
pytestmark = pytest.mark.skipif(not kernels_enabled(), reason="CPU kernels switched off (HYBRIDKV_CPU_KERNELS=0)")


@pytest.fixture(autouse=True)
def _built():
    # CI installs g++: a failed build fails these tests instead of skipping them.
    assert kernel is not None, "the CPU indexer kernel did not build on this machine (g++ and ninja installed?)"


def _exact(g, *shape):
    return torch.randint(-2, 3, shape, generator=g).float()


def _query(g, n, heads, c, cache, k):
    return IndexerQuery(_exact(g, n, heads, c), _exact(g, n, heads) / 4, cache, INDEXER, k, 0.25)


@pytest.mark.parametrize("heads,c", [(1, 8), (3, 5), (4, 16), (8, 64), (16, 16), (20, 12), (64, 16)])
def test_shared_slots_pick_exactly_the_torch_entries(heads, c, threads):
    """Prefill form: one slot list shared by the block's rows, each row a causal prefix of it
    (some shorter than k, one empty), rows spanning several row chunks."""
    g = torch.Generator().manual_seed(heads * 100 + c)
    n, L, slots = 37, 700, 900
    cache = _exact(g, slots, c)
    for k in (1, 7, 64):
        iq = _query(g, n, heads, c, cache, k)
        visible = torch.randint(0, L + 1, (n,), generator=g)
        visible[:3] = torch.tensor([0, 3, L])
        for slot_list in (torch.randperm(slots, generator=g)[:L], torch.arange(100, 100 + L)):
            ks = KeySet(slot_list, visible=visible)
            got = cpu_indexer_topk(iq, slice(0, n), ks, k)
            assert torch.equal(got, indexer_topk(iq, slice(0, n), ks, k)), (heads, c, k)


def test_rows_of_a_larger_batch_are_taken_from_the_rows_slice():
    g = torch.Generator().manual_seed(1)
    n, heads, c, L, k = 30, 8, 16, 300, 9
    cache = _exact(g, 400, c)
    iq = _query(g, n, heads, c, cache, k)
    ks = KeySet(torch.randperm(400, generator=g)[:L], visible=torch.randint(0, L + 1, (12,), generator=g))
    rows = slice(10, 22)
    assert torch.equal(cpu_indexer_topk(iq, rows, ks, k), indexer_topk(iq, rows, ks, k))


def test_page_form_decode_rows_pick_exactly_the_torch_entries(threads):
    """Decode form: each row its own pages (runs, scattered, a partial last page, nothing
    visible), long enough that a lone row's entries are split into segments across threads
    and their top-k sets merged."""
    g = torch.Generator().manual_seed(7)
    spp, heads, c, num_pages = 16, 8, 32, 400
    cache = _exact(g, num_pages * spp, c)
    width = 150
    runs = torch.arange(10, 10 + width)
    scattered = torch.randperm(num_pages - 1, generator=g)[:width] + 1
    for k in (1, 16, 100):
        for rows, visible in (([runs], [width * spp]), ([scattered], [width * spp - 5]),
                              ([runs, scattered, runs.flip(0), torch.ones(width, dtype=torch.long)],
                               [2000, width * spp, 77, 0])):
            pages = torch.stack(rows)
            vis = torch.tensor(visible)
            n = pages.shape[0]
            iq = _query(g, n, heads, c, cache, k)
            ks = KeySet(pages=pages, slots_per_page=spp, length=int(vis.max()), visible=vis)
            got = cpu_indexer_topk(iq, slice(0, n), ks, k)
            assert torch.equal(got, indexer_topk(iq, slice(0, n), ks, k)), (k, visible)


def test_bfloat16_keys_are_widened_exactly():
    g = torch.Generator().manual_seed(3)
    n, heads, c, L, k = 20, 16, 16, 500, 12
    cache = _exact(g, 600, c).bfloat16()
    iq = _query(g, n, heads, c, cache, k)
    ks = KeySet(torch.randperm(600, generator=g)[:L], visible=torch.randint(0, L + 1, (n,), generator=g))
    assert torch.equal(cpu_indexer_topk(iq, slice(0, n), ks, k), indexer_topk(iq, slice(0, n), ks, k))


@pytest.mark.parametrize("dtype", [torch.float32, *FP8_FORMATS], ids=["float32", "e4m3", "e5m2"])
def test_random_data_picks_the_top_k_to_rounding(dtype, threads):
    """Real-valued scores round differently from the torch matmul, so compare with float64:
    every picked entry scores at least the true k-th score (minus rounding), the picks are
    distinct, visible and ascending. FP8 keys: the values the cache stores, widened in float64."""
    g = torch.Generator().manual_seed(11)
    n, heads, c, L, k = 64, 8, 64, 3000, 64
    cache = quantize_kv(torch.randn(L, c, generator=g), dtype)
    q, w = torch.randn(n, heads, c, generator=g), torch.randn(n, heads, generator=g) / heads ** 0.5
    iq = IndexerQuery(q, w, cache, INDEXER, k, c ** -0.5)
    visible = torch.randint(k, L + 1, (n,), generator=g)
    ks = KeySet(torch.arange(L), visible=visible)
    got = cpu_indexer_topk(iq, slice(0, n), ks, k)
    exact = torch.einsum("nh,nhl->nl", w.double(), torch.einsum("nhc,lc->nhl", q.double(), cache.double()).relu()) * c ** -0.5
    exact = exact.masked_fill(~ks.mask, float("-inf"))
    kth = exact.topk(k, dim=1).values[:, -1:]
    assert bool((got[:, 1:] > got[:, :-1]).all()), "indices must be distinct and ascending"
    assert bool((got < visible[:, None]).all())
    assert bool((exact.gather(1, got) >= kth - 1e-5).all())
    agree = (got == indexer_topk(iq, slice(0, n), ks, k)).float().mean().item()
    assert agree > 0.99, agree  # rounding may swap a near-tie at the boundary, rarely


def test_the_backend_routes_supported_key_sets_to_the_kernel_and_the_rest_to_torch(monkeypatch):
    """HybridV4Attention.topk is cpu_indexer_topk: a causal shared or page-form key set runs the
    kernel; an explicit-mask key set, per-query slot lists or too many heads run indexer_topk."""
    g = torch.Generator().manual_seed(5)
    calls = []
    real = hybrid_v4.indexer_topk
    monkeypatch.setattr(hybrid_v4, "indexer_topk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert HybridV4Attention.topk is cpu_indexer_topk
    n, c, L, k = 4, 8, 50, 5
    cache = _exact(g, 64, c)
    visible = torch.tensor([50, 10, 3, 0])
    iq = _query(g, n, 4, c, cache, k)
    HybridV4Attention.topk(iq, slice(0, n), KeySet(torch.arange(L), visible=visible), k)
    pages = torch.tensor([[1, 2, 3, 4, 5, 6, 7]] * n)
    HybridV4Attention.topk(iq, slice(0, n), KeySet(pages=pages, slots_per_page=8, length=L, visible=visible), k)
    assert calls == []
    HybridV4Attention.topk(iq, slice(0, n), KeySet(torch.arange(L).expand(n, L), visible=visible), k)
    HybridV4Attention.topk(iq, slice(0, n), KeySet(torch.arange(L), explicit_mask=torch.ones(n, L, dtype=torch.bool)), k)
    wide = _query(g, n, hybrid_v4.FUSED_INDEXER_MAX_HEADS + 1, c, cache, k)
    HybridV4Attention.topk(wide, slice(0, n), KeySet(torch.arange(L), visible=visible), k)
    assert len(calls) == 3


def test_bad_arguments_raise_errors_that_name_them():
    q, w, cache = torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(10, 8)
    slots, empty, vis = torch.arange(10), torch.empty(0, dtype=torch.long), torch.tensor([10, 5])
    with pytest.raises(RuntimeError, match="k must be in"):
        kernel(q, w, cache, slots, empty, 0, vis, 10, 11, 1.0)
    with pytest.raises(RuntimeError, match="visible"):
        kernel(q, w, cache, slots, empty, 0, torch.tensor([11, 5]), 10, 3, 1.0)
    with pytest.raises(RuntimeError, match="key_cache"):
        kernel(q, w, torch.zeros(10, 7), slots, empty, 0, vis, 10, 3, 1.0)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16, float8_e4m3fn or float8_e5m2, got Half"):
        kernel(q, w, cache.half(), slots, empty, 0, vis, 10, 3, 1.0)
    with pytest.raises(RuntimeError, match="sees past its pages"):
        kernel(q, w, cache, empty, torch.tensor([[0], [1]]), 4, torch.tensor([5, 4]), 10, 3, 1.0)


def _shared_and_page_form_key_sets(g, n: int, spp: int, num_pages: int):
    """A shared causal slot list (prefill) and per-row pages (decode: runs and scattered pages),
    both with rows that see fewer entries than k and one that sees none."""
    L = 40 * spp
    visible = torch.randint(0, L + 1, (n,), generator=g)
    visible[:2] = torch.tensor([0, 5])
    yield KeySet(torch.randperm(num_pages * spp, generator=g)[:L], visible=visible)
    pages = torch.stack([torch.randperm(num_pages - 1, generator=g)[:40] + 1 if r % 2 else torch.arange(1, 41)
                         for r in range(n)])
    yield KeySet(pages=pages, slots_per_page=spp, length=L, visible=visible)


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("heads,c", [(4, 16), (20, 12), (64, 32)])
def test_fp8_keys_pick_exactly_the_torch_entries(fmt, heads, c, threads):
    """Integer-valued keys (exact in both formats) in an FP8 cache, shared and page-form key sets:
    the torch indexer on the same cache picks the same entries, ties included."""
    g = torch.Generator().manual_seed(heads * 100 + c)
    n, spp, num_pages = 21, 16, 60
    cache = _exact(g, num_pages * spp, c).to(fmt)
    for k in (1, 9, 64):
        iq = _query(g, n, heads, c, cache, k)
        for ks in _shared_and_page_form_key_sets(g, n, spp, num_pages):
            assert torch.equal(cpu_indexer_topk(iq, slice(0, n), ks, k), indexer_topk(iq, slice(0, n), ks, k)), k


def _every_finite_value(g, fmt, shape) -> torch.Tensor:
    """An FP8 tensor of random finite bytes of the format: subnormals, zeros, the largest values."""
    byte = torch.arange(256, dtype=torch.uint8)
    finite = byte[torch.isfinite(byte.view(fmt).float())]
    return finite[torch.randint(0, finite.numel(), shape, generator=g)].view(fmt)


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("heads,c", [(8, 64), (3, 20), (64, 32)])
def test_fp8_keys_pick_exactly_what_their_float32_widening_picks(fmt, heads, c, threads):
    """Keys of every finite byte value, random queries and weights: the kernel over the FP8 cache
    and over that cache widened to float32 (cache.float()) computes the same scores to the bit, so
    it picks the same entries, in both forms. (c 20: vector loads and a scalar tail.)"""
    g = torch.Generator().manual_seed(heads * 100 + c + 1)
    n, spp, num_pages = 21, 16, 60
    cache = _every_finite_value(g, fmt, (num_pages * spp, c))
    for k in (1, 64):
        q, w = torch.randn(n, heads, c, generator=g), torch.randn(n, heads, generator=g)
        fp8, widened = (IndexerQuery(q, w, keys, INDEXER, k, c ** -0.5) for keys in (cache, cache.float()))
        for ks in _shared_and_page_form_key_sets(g, n, spp, num_pages):
            assert torch.equal(cpu_indexer_topk(fp8, slice(0, n), ks, k), cpu_indexer_topk(widened, slice(0, n), ks, k))


def test_fp8_keys_run_the_kernel_and_other_dtypes_the_torch_indexer(monkeypatch):
    """e4m3 and e5m2 key caches go to the kernel like float32 and bfloat16 ones; a float16 cache,
    which the kernel does not read, runs indexer_topk."""
    g = torch.Generator().manual_seed(6)
    calls = []
    real = hybrid_v4.indexer_topk
    monkeypatch.setattr(hybrid_v4, "indexer_topk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    n, c, L, k = 4, 8, 50, 5
    cache = _exact(g, 64, c)
    ks = KeySet(torch.arange(L), visible=torch.tensor([50, 10, 3, 0]))
    for dtype in (torch.float32, torch.bfloat16, *FP8_FORMATS):
        cpu_indexer_topk(_query(g, n, 4, c, cache.to(dtype), k), slice(0, n), ks, k)
    assert calls == []
    iq = _query(g, n, 4, c, cache.half(), k)
    assert torch.equal(cpu_indexer_topk(iq, slice(0, n), ks, k), real(iq, slice(0, n), ks, k))
    assert len(calls) == 1


@pytest.mark.slow
@pytest.mark.parametrize("isa,flags", [("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("base", [])])
def test_fp8_reads_of_the_avx2_and_plain_builds_are_exact(monkeypatch, isa, flags):
    """The kernel as an AVX2-only CPU builds it (8 lanes, F16C's 8-lane widening) and as the plain
    build does (no F16C: c10's conversion lane by lane): FP8 keys pick what the torch indexer
    picks and what their float32 widening picks."""
    from pathlib import Path

    from hybridkv.attention_backends.cpu_kernels import build

    monkeypatch.setattr(build, "isa_flags", lambda: (isa, flags))
    module = build.build_cpu_extension("hybridkv_indexer_topk", Path(build.__file__).with_name("indexer_topk.cpp"),
                                       ["indexer_topk"], f"CPU lightning-indexer kernel ({isa} build)")
    assert module is not None, f"the indexer kernel did not build for {isa}"
    monkeypatch.setattr(hybrid_v4, "load_indexer_topk", lambda: module.indexer_topk)
    for fmt in FP8_FORMATS:
        test_fp8_keys_pick_exactly_the_torch_entries(fmt, 20, 12, None)
        for heads, c in ((8, 64), (3, 20), (64, 32)):
            test_fp8_keys_pick_exactly_what_their_float32_widening_picks(fmt, heads, c, None)
