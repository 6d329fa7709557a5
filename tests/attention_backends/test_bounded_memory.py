"""Attention working memory does not grow with the longest context in the batch.

One step of the torch-native backend with the tiny Llama's attention shape (4 query heads, 2 KV
heads, head_dim 16, page 16): 64 short decodes beside one long-context decode, plus a 512-token
prefill chunk continuing another long prefix (a prefix hit). The long contexts are 8k and then
32k tokens. The peak of the backend call is measured from the profiler's allocation events
(torch.profiler, profile_memory=True: the running sum of every allocation and free, in time
order), with the metadata built beforehand (it is per step, shared by all layers, and holds one
8-byte slot per key read).

The bound (TileSizes defaults, float32):
    peak <= decode tile + prefill tile + the step's own tensors, where
    decode tile  = decode_tile_keys x (2 x Hkv x D x 4   gathered K and V
                                       + 4 x H x 4)      scores, masked scores, probabilities
    prefill tile = prefill_q_tile x kv_chunk x H x 4 x 4 (scores, mask, exp, ...)
                   + kv_chunk x 2 x Hkv x D x 4          one key chunk of K and V
    step tensors = 8 x T x H x D x 4 + 4 x B x H x D x 4 (outputs, split-KV accumulators)
None of these terms depends on the context length; the dense gather this replaces
([Hkv, B, longest, D] for K alone) would be 272 MB at 32k. The CPU paged kernel (cpu_kernels/),
which reads K/V in place, needs less: per thread, (queries x query heads per KV head) x (256-key
score block + 2 x D + 2) float32 of scratch, allocated through torch so the profiler counts it.
So does the CPU prefill kernel (rows = at most 96 query rows of a tile, padded to whole vectors:
2 x rows x D + 64 x (rows + D) + 3 x rows floats per thread).
"""
from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hybridkv.attention_backends.metadata import DEFAULT_TILES, StepSequences, build_attention_metadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.block_manager.block_table import BlockTable

P, H, HKV, D = 16, 4, 2, 16
NUM_DECODES, PREFILL_CHUNK = 64, 512


def peak_allocated_bytes(fn) -> int:
    """Peak of the running sum of CPU allocations minus frees while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def _bound(num_tokens: int, num_seqs: int) -> int:
    t, f32 = DEFAULT_TILES, 4
    decode_tile = t.decode_tile_keys * (2 * HKV * D * f32 + 4 * H * f32)
    prefill_tile = t.prefill_q_tile * t.kv_chunk * H * f32 * 4 + t.kv_chunk * 2 * HKV * D * f32
    step = 8 * num_tokens * H * D * f32 + 4 * num_seqs * H * D * f32
    return decode_tile + prefill_tile + step


def _step(long_len: int):
    """Caches, block tables and q/k/v of one step; short contexts are the same for every long_len."""
    rng = random.Random(0)
    short = [rng.randint(20, 400) for _ in range(NUM_DECODES)]
    # (start, new tokens): the short decodes, the long-context decode, the prefill after a long prefix
    spans = [(c - 1, 1) for c in short] + [(long_len - 1, 1), (long_len, PREFILL_CHUNK)]
    pages_per_seq = [-(-(s + n) // P) for s, n in spans]
    num_pages = sum(pages_per_seq)
    pool = list(range(1, num_pages + 1))
    rng.shuffle(pool)
    table = BlockTable(max_pages_per_row=max(pages_per_seq), initial_rows=len(spans))
    rows = []
    for n in pages_per_seq:
        row = table.add_row()
        table.append(row, [pool.pop() for _ in range(n)])
        rows.append(row)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(HKV, (num_pages + 1) * P, D, generator=g)
    v_cache = torch.randn(HKV, (num_pages + 1) * P, D, generator=g)
    k_cache[:, :P] = 0  # the null page
    v_cache[:, :P] = 0
    ctx = [s + n for s, n in spans]
    tables = {"full": table.rows(torch.tensor(rows), -(-max(ctx) // P))}  # int32, as the runner selects them
    seqs = StepSequences([n for _, n in spans], ctx, tables)
    T = sum(n for _, n in spans)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV))
    return seqs, (q, k, v, k_cache, v_cache), len(spans)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # allocations of other intra-op threads would blur the peak
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("decode", ["tiles", "kernel"])
def test_decode_beside_a_long_context_peaks_independently_of_its_length(one_thread, decode):
    backend = TorchNativeAttention(cpu_kernels=decode == "kernel")
    assert backend.needs_decode_tiles == (decode == "tiles"), "the CPU paged kernel did not build here"
    peaks = {}
    for long_len in (8192, 32768):
        seqs, (q, k, v, kc, vc), num_seqs = _step(long_len)
        seqs.decode_tiles = backend.needs_decode_tiles
        meta = build_attention_metadata(seqs, {"full": None}, P)
        if decode == "tiles":
            assert meta.spaces["full"].decode_split  # the long decode is split over several items
        backend.forward(q, k, v, kc, vc, meta, "full", D**-0.5)  # warm-up
        peaks[long_len] = peak_allocated_bytes(lambda: backend.forward(q, k, v, kc, vc, meta, "full", D**-0.5))
        bound = _bound(q.shape[0], num_seqs)
        assert peaks[long_len] <= bound, f"{long_len}: peak {peaks[long_len]} > bound {bound}"
    dense_k = HKV * (NUM_DECODES + 1) * 32768 * D * 4
    assert peaks[32768] < dense_k / 10
    # Same work outside the long sequences; the long ones only add more tiles, one at a time.
    assert abs(peaks[32768] - peaks[8192]) <= 0.05 * peaks[8192], peaks
