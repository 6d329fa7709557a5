"""The Triton DeepSeek-V4 kernels (triton_attention/hybrid_v4.py) against the torch-native
reference (attention_backends/hybrid_v4.py), on the CPU under TRITON_INTERPRET=1.

Tolerance, float32 everywhere: rtol 1e-5 with atol 1e-6 (values are O(1), so atol only
covers entries near zero). The indexer's top-k picks exactly the reference's entries on
exact (integer) data, ties included, and the same sets on random data.

FP8 caches (kv_cache_dtype, e4m3 and e5m2): the row writes store write_slots' bytes, and the
kernels reading FP8 keys match the reference reading the same caches, to the same tolerance.
"""
from __future__ import annotations

import os
import random

# Before triton is imported: the interpreter is chosen when a function is decorated with
# @triton.jit, and triton.language's own helpers (tl.sum, ...) are decorated on import.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hybridkv.attention_backends.hybrid_metadata import (  # noqa: E402
    C4, C128, INDEXER, STATE_C4, STATE_C128, SWA, HybridLayout, KeySet, build_hybrid_metadata,
)
from hybridkv.attention_backends.hybrid_v4 import (  # noqa: E402
    HybridV4Attention, IndexerQuery, indexer_scores, indexer_topk, joint_softmax_attention,
)
from hybridkv.attention_backends.kv_cache_dtype import quantize_kv  # noqa: E402
from hybridkv.attention_backends.metadata import StepSequences  # noqa: E402
from hybridkv.attention_backends.triton_attention import hybrid_v4 as tv4  # noqa: E402
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
FP8_FORMATS = pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])

P, W, CSA_R, HCA_R = 8, 5, 2, 4  # page size, sliding window, ratios (P is a multiple of both)
H, D, NI, CI, TOPK = 3, 16, 4, 8, 3
SPACES = {SWA: 1, STATE_C4: 1, STATE_C128: 1, C4: CSA_R, INDEXER: CSA_R, C128: HCA_R}


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture
def small_blocks(monkeypatch):
    """16-key kernel blocks and 5-entry indexer key blocks: every list spans several."""
    monkeypatch.setattr(tv4, "ATTENTION_BLOCK_N", 16)
    monkeypatch.setattr(tv4, "INDEXER_BLOCK_N", 16)
    monkeypatch.setattr(tv4, "INDEXER_KEY_BLOCK", 5)
    monkeypatch.setattr(tv4, "INDEXER_BLOCK_ELEMS", 0)


def _key_set(g: torch.Generator, n: int, L: int, slots: int, shared: bool, prefix: bool) -> KeySet:
    """Random slots; a causal prefix (counts include 0 and L) or a random explicit mask."""
    s = torch.randint(0, slots, (L,) if shared else (n, L), generator=g)
    if prefix:
        visible = torch.randint(0, L + 1, (n,), generator=g)
        visible[0], visible[-1] = 0, L
        return KeySet(s, visible=visible)
    return KeySet(s, explicit_mask=torch.rand(n, L, generator=g) > 0.4)


@pytest.mark.parametrize("L", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("shared", [True, False])
def test_indexer_scores_equal_the_reference(L, shared, small_blocks):
    g = torch.Generator().manual_seed(L * 2 + shared)
    n, heads, c, slots = 6, 5, 12, 90  # heads and dim below the kernel's 16-wide tiles
    iq = IndexerQuery(torch.randn(n, heads, c, generator=g), torch.randn(n, heads, generator=g),
                      torch.randn(slots, c, generator=g), INDEXER, TOPK, c**-0.5)
    ks = _key_set(g, n, L, slots, shared, prefix=True)
    for lo, hi in ((0, L), (L // 3, L), (0, (L + 1) // 2)):
        got = tv4.indexer_block_scores(iq, slice(0, n), ks, lo, hi)
        want = indexer_scores(iq.q, iq.weights, iq.keys[ks.slots[..., lo:hi]], iq.scale)
        want = want.masked_fill(~ks.column_mask(lo, hi), float("-inf"))
        torch.testing.assert_close(got, want, **TOL)


def test_indexer_topk_picks_exactly_the_reference_entries_on_exact_data(small_blocks):
    """Integer queries, keys and quarter weights make every score exact in any summation
    order: the kernel's top-k must then be the reference's, ties (many) and -inf padding included."""
    g = torch.Generator().manual_seed(5)
    n, heads, c, L, slots = 8, 4, 8, 40, 100
    iq = IndexerQuery(torch.randint(-2, 3, (n, heads, c), generator=g).float(),
                      torch.randint(-2, 3, (n, heads), generator=g).float() / 4,
                      torch.randint(-2, 3, (slots, c), generator=g).float(), INDEXER, 7, 0.25)
    for shared in (True, False):
        ks = _key_set(g, n, L, slots, shared, prefix=True)
        for k in (1, 7, L):
            want = indexer_topk(iq, slice(0, n), ks, k)
            for key_block in (None, 23):  # 5 (small_blocks) and 23 entries per key block
                assert torch.equal(tv4.triton_indexer_topk(iq, slice(0, n), ks, k, key_block), want)


@FP8_FORMATS
@pytest.mark.parametrize("shared", [True, False])
def test_indexer_scores_over_fp8_keys_equal_the_reference(fmt, shared, small_blocks):
    g = torch.Generator().manual_seed(11 + shared)
    n, heads, c, slots, L = 6, 5, 12, 90, 40
    keys = quantize_kv(torch.randn(slots, c, generator=g), fmt)
    iq = IndexerQuery(torch.randn(n, heads, c, generator=g), torch.randn(n, heads, generator=g), keys, INDEXER,
                      TOPK, c**-0.5)
    ks = _key_set(g, n, L, slots, shared, prefix=True)
    got = tv4.indexer_block_scores(iq, slice(0, n), ks, 0, L)
    want = indexer_scores(iq.q, iq.weights, keys[ks.slots], iq.scale).masked_fill(~ks.column_mask(0, L), float("-inf"))
    torch.testing.assert_close(got, want, **TOL)


@FP8_FORMATS
def test_indexer_topk_over_fp8_keys_picks_exactly_the_reference_entries_on_exact_data(fmt, small_blocks):
    """Small integers are FP8 values: the scores are exact in any order, so the top-k over an
    FP8 key cache is exactly the reference's over the same cache, ties included."""
    g = torch.Generator().manual_seed(6)
    n, heads, c, L, slots = 8, 4, 8, 40, 100
    iq = IndexerQuery(torch.randint(-2, 3, (n, heads, c), generator=g).float(),
                      torch.randint(-2, 3, (n, heads), generator=g).float() / 4,
                      torch.randint(-2, 3, (slots, c), generator=g).float().to(fmt), INDEXER, 7, 0.25)
    for shared in (True, False):
        ks = _key_set(g, n, L, slots, shared, prefix=True)
        for k in (1, 7):
            assert torch.equal(tv4.triton_indexer_topk(iq, slice(0, n), ks, k), indexer_topk(iq, slice(0, n), ks, k))


@pytest.mark.parametrize("dim, dtype", [(16, torch.float32), (300, torch.float32), (24, torch.bfloat16)])
def test_row_write_kernel_equals_index_copy(dim, dtype, monkeypatch):
    """V4's cache writes (SWA keys, compressor state rows, pooled entries): every row lands in
    its slot in the cache's dtype and no other slot changes; rows wider than one column block
    (300 > 256) are written in several; a non-contiguous source (a column slice) too."""
    g = torch.Generator().manual_seed(dim)
    slots_n, rows = 40, 9
    cache = torch.full((slots_n, dim), float("nan"), dtype=dtype)
    slots = torch.randperm(slots_n, generator=g)[:rows]
    src = torch.randn(rows, dim + 3, generator=g)[:, 1 : dim + 1]  # fp32 rows, strided
    want = cache.clone()
    HybridV4Attention.write(want, slots, src)
    tv4.TritonHybridV4Attention.write(cache, slots, src)
    assert torch.equal(cache[slots], want[slots])
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots] = False
    assert cache[untouched].isnan().all(), "a slot no row was meant for was written"
    tv4.TritonHybridV4Attention.write(cache, slots[:0], src[:0])  # an empty step writes nothing
    with pytest.raises(ValueError, match="rows for"):
        tv4.TritonHybridV4Attention.write(cache, slots[:2], src)


@FP8_FORMATS
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_row_write_into_fp8_stores_the_bytes_of_write_slots(fmt, src_dtype):
    """Rows in the model dtype into an FP8 cache (300 columns: two column blocks; a strided
    source): saturated beyond the format's maximum, rounded to nearest even, subnormals
    included -- write_slots' bytes -- and no other slot's bytes change."""
    g = torch.Generator().manual_seed(4)
    slots_n, rows, dim = 40, 9, 300
    src = (torch.randn(rows, dim + 3, generator=g) * 4)[:, 1 : dim + 1]
    src[:, ::7] *= 1e5  # beyond e4m3's 448 and e5m2's 57344
    src[::3] *= 1e-4  # FP8 subnormals
    src = src.to(src_dtype)
    cache = torch.full((slots_n, dim), 0x7F, dtype=torch.uint8).view(fmt)  # NaN bytes
    slots = torch.randperm(slots_n, generator=g)[:rows]
    want = cache.clone()
    HybridV4Attention.write(want, slots, src)
    tv4.TritonHybridV4Attention.write(cache, slots, src)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots] = False
    assert (cache.view(torch.uint8)[untouched] == 0x7F).all(), "a slot no row was meant for was written"


@pytest.mark.parametrize("lengths", [(5, 0), (15, 17), (16, 16), (9, 40)])
@pytest.mark.parametrize("layout", ["shared", "per_query"])
def test_attention_kernel_equals_the_joint_softmax(lengths, layout, small_blocks):
    """Window keys (explicit mask) then entries (causal prefix or explicit mask, as after
    top-k), ragged lengths around the 16-key block edge; rows with no visible entry at all."""
    g = torch.Generator().manual_seed(sum(lengths) + len(layout))
    n, heads, slots = 7, 20, 120  # heads > 16: two head blocks
    shared = layout == "shared"
    q = torch.randn(n, heads, D, generator=g)
    cache = torch.randn(slots, D, generator=g)
    entry_cache = torch.randn(slots, D, generator=g)
    sink = torch.randn(heads, generator=g)
    swa = _key_set(g, n, lengths[0], slots, shared, prefix=False)
    for prefix in (True, False):
        entries = _key_set(g, n, lengths[1], slots, shared, prefix) if lengths[1] else None
        got = tv4.hybrid_attention(q, sink, 0.3, cache, swa, entry_cache, entries)
        sets = [(cache[swa.slots], swa.mask)]
        if entries is not None:
            sets.append((entry_cache[entries.slots], entries.mask))
        torch.testing.assert_close(got, joint_softmax_attention(q, sets, sink, 0.3), **TOL)


@FP8_FORMATS
@pytest.mark.parametrize("layout", ["shared", "per_query"])
def test_attention_kernel_over_fp8_caches_equals_the_joint_softmax_of_the_widened_keys(fmt, layout, small_blocks):
    g = torch.Generator().manual_seed(8 + len(layout))
    n, heads, slots = 7, 20, 120
    shared = layout == "shared"
    q = torch.randn(n, heads, D, generator=g)
    cache = quantize_kv(torch.randn(slots, D, generator=g), fmt)
    entry_cache = quantize_kv(torch.randn(slots, D, generator=g), fmt)
    sink = torch.randn(heads, generator=g)
    swa = _key_set(g, n, 15, slots, shared, prefix=False)
    for prefix in (True, False):
        entries = _key_set(g, n, 40, slots, shared, prefix)
        got = tv4.hybrid_attention(q, sink, 0.3, cache, swa, entry_cache, entries)
        sets = [(cache[swa.slots].float(), swa.mask), (entry_cache[entries.slots].float(), entries.mask)]
        torch.testing.assert_close(got, joint_softmax_attention(q, sets, sink, 0.3), **TOL)


def _step(spans: list[tuple[int, int]], seed: int):
    """Metadata and random caches for one step: (cached prefix, new tokens) per sequence, decodes first."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tables = {}
    for space in SPACES:
        free = rng.sample(range(1, 65), 64)  # page 0 is the null page
        tables[space] = [[free.pop() for _ in range(-(-(s + q) // P))] for s, q in spans]
    seqs = StepSequences.from_page_lists([q for _, q in spans], [s + q for s, q in spans], tables)
    meta = build_hybrid_metadata(seqs, HybridLayout(P, W, CSA_R, HCA_R))
    caches = {space: torch.randn(65 * P // r, CI if space == INDEXER else D, generator=g)
              for space, r in SPACES.items() if space not in (STATE_C4, STATE_C128)}
    for cache in caches.values():
        cache[: cache.shape[0] // 65] = 0  # the null page
    return meta, caches


# Decodes: past the window; at its edge (pos W-1) with fewer C4 entries than top-k; before
# the first entry; exactly top-k entries. Prefill chunks: empty prefix, a prefix hit at a page
# boundary, one mid-page and crossing several pages and the window.
SPANS = [(36, 1), (4, 1), (0, 1), (5, 1), (0, 13), (8, 9), (21, 30)]


def _both_backends_over_mixed_steps(kind: str, fmt: torch.dtype | None = None):
    """(reference output, Triton output, metadata, indexer query) of one mixed step of a layer
    kind; fmt: the caches as an FP8 cache of that format stores them (both backends read the same
    bytes)."""
    meta, caches = _step(SPANS, seed={"sliding": 0, "hca": 1, "csa": 2}[kind])
    if fmt is not None:
        caches = {space: quantize_kv(cache, fmt) for space, cache in caches.items()}
    T = meta.num_tokens
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    iq = IndexerQuery(torch.randn(T, NI, CI, generator=g), torch.randn(T, NI, generator=g), caches[INDEXER],
                      INDEXER, TOPK, CI**-0.5)
    args = {"sliding": (), "hca": (caches[C128], C128), "csa": (caches[C4], C4, iq)}[kind]
    want = HybridV4Attention().forward(q, caches[SWA], meta, sink, D**-0.5, *args)
    got = tv4.TritonHybridV4Attention().forward(q, caches[SWA], meta, sink, D**-0.5, *args)
    return want, got, meta, iq


@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_backend_equals_the_reference_over_mixed_steps(kind, blocks, request):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    want, got, meta, iq = _both_backends_over_mixed_steps(kind)
    torch.testing.assert_close(got, want, **TOL)
    if kind == "csa":  # random scores: the same entry sets as the reference
        for blk in meta.blocks:
            rows, iks = slice(blk.start, blk.end), blk.entries[INDEXER]
            k = min(TOPK, iks.length)
            if k:
                got_idx = tv4.triton_indexer_topk(iq, rows, iks, k)
                assert torch.equal(got_idx.sort().values, indexer_topk(iq, rows, iks, k).sort().values)


@FP8_FORMATS
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_backend_over_fp8_caches_equals_the_reference_over_mixed_steps(kind, fmt, small_blocks):
    """The swa, c4, c128 and indexer caches in FP8 (as the writes store them)."""
    want, got, _, _ = _both_backends_over_mixed_steps(kind, fmt)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL)


def _drive(llm, prompts: dict[str, list[int]], max_tokens: int, budget: int) -> tuple[dict, dict]:
    """Greedy generation step by step under a token budget: per request the logits of every
    computed position and the generated tokens."""
    from hybridkv.engine.sampling_params import SamplingParams

    eng = llm.engine
    eng.scheduler.config.max_num_batched_tokens = budget
    eng.runner.captured_logits = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    user_id = {}
    for rid, ids in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
        (seq_id,) = eng.sequence_ids(rid)
        user_id[seq_id] = rid
    tokens = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    logits = {user_id[sid]: torch.cat(c) for sid, c in eng.runner.captured_logits.items()}
    eng.runner.captured_logits = None
    return logits, tokens


@pytest.mark.slow
def test_tiny_v4_triton_backend_matches_torch_native(tmp_path):
    """Tiny V4 (sliding, CSA, HCA, CSA layers; window 16, C4 top-8, C128 ratio 16, pages of 32):
    two prompts prefilled in 24-token chunks next to each other's decodes, then a third that
    hits the first one's cached prefix (two pages). Logits within 1e-4 at every computed
    position, greedy tokens equal."""
    from hybridkv.entrypoints import LLM

    path = build_v4_checkpoint(str(tmp_path / "v4"))
    g = torch.Generator().manual_seed(1)
    a, b, tail = (torch.randint(3, 200, (n,), generator=g).tolist() for n in (90, 37, 11))
    results = {}
    for backend in ("torch_native", "triton"):
        llm = LLM(path, dtype="float32", block_size=32, max_model_len=256, max_num_seqs=4, attention_backend=backend)
        assert all(type(attn.backend) is (tv4.TritonHybridV4Attention if backend == "triton" else HybridV4Attention)
                   for attn in llm.engine.runner.model.attention_layers())
        first = _drive(llm, {"a": a, "b": b}, max_tokens=6, budget=24)
        hit = _drive(llm, {"c": a[:64] + tail}, max_tokens=4, budget=24)
        assert hit[0]["c"].shape[0] == len(tail) + 3  # the two cached pages were not recomputed
        results[backend] = first, hit
    for want, got in zip(results["torch_native"], results["triton"]):
        assert got[1] == want[1]
        for rid in want[0]:
            torch.testing.assert_close(got[0][rid], want[0][rid], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_tiny_v4_triton_backend_with_hisparse_equals_torch_native_without(tmp_path, monkeypatch):
    """HiSparse under the Triton backend: the indexer's top-k, the fused swap-in kernel (hits,
    LRU victims, slot map, copy from the mirror) and the attention over the hot buffer. A buffer
    of twice top-k over ~50 C4 entries misses often; greedy tokens and logits must be those of
    torch-native without HiSparse, and the fused kernel must be what ran."""
    from hybridkv.attention_backends.triton_attention import hisparse_swap_in
    from hybridkv.entrypoints import LLM

    calls = []
    real = hisparse_swap_in.triton_swap_in

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tv4.TritonHybridV4Attention, "swap_in", staticmethod(spy))
    path = build_v4_checkpoint(str(tmp_path / "v4"))
    g = torch.Generator().manual_seed(2)
    prompts = {"a": torch.randint(3, 200, (200,), generator=g).tolist(), "b": torch.randint(3, 200, (45,), generator=g).tolist()}
    kw = dict(dtype="float32", block_size=32, max_model_len=320, max_num_seqs=4)
    want = _drive(LLM(path, **kw), prompts, max_tokens=8, budget=64)
    llm = LLM(path, attention_backend="triton", enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **kw)
    got = _drive(llm, prompts, max_tokens=8, budget=64)
    assert calls, "the fused swap-in kernel did not run"
    st = llm.engine.runner.hot_buffers.stats
    assert st.loaded > 0 and st.hits > 0, st
    assert got[1] == want[1]
    for rid in want[0]:
        torch.testing.assert_close(got[0][rid], want[0][rid], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype, fmt", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)],
                         ids=["e4m3", "e5m2"])
def test_tiny_v4_triton_backend_over_fp8_generates_the_tokens_of_torch_native_over_fp8(tmp_path, kv_cache_dtype, fmt):
    """FP8 swa, c4, c128 and indexer caches and hot buffers under the Triton backend with HiSparse
    (its row writes, indexer, attention and the fused swap-in: raw bytes from the FP8 mirror,
    quantized new entries) generate the greedy tokens of torch-native over the same
    kv_cache_dtype without HiSparse, which reads the same bytes from the c4 pool. Logits are not
    compared: a value within float32 rounding of the midpoint of two FP8 values may be stored as
    either by the two backends (one SWA byte in e5m2 here), which moves later logits by ~1e-3."""
    from hybridkv.entrypoints import LLM

    path = build_v4_checkpoint(str(tmp_path / "v4"))
    g = torch.Generator().manual_seed(2)
    prompts = {"a": torch.randint(3, 200, (150,), generator=g).tolist(), "b": torch.randint(3, 200, (45,), generator=g).tolist()}
    kw = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    want = _drive(LLM(path, **kw), prompts, max_tokens=6, budget=64)
    llm = LLM(path, attention_backend="triton", enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **kw)
    layers = llm.engine.runner.model.attention_layers()
    assert {layer.cache.swa.dtype for layer in layers} == {fmt}
    assert {layer.cache.hot.dtype for layer in layers if layer.cache.hot is not None} == {fmt}
    got = _drive(llm, prompts, max_tokens=6, budget=64)
    st = llm.engine.runner.hot_buffers.stats
    assert st.loaded > 0 and st.hits > 0, st
    assert got[1] == want[1]
