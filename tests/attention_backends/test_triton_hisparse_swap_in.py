"""The fused HiSparse swap-in kernel (triton_attention/hisparse_swap_in.py) against the torch
reference (HotBuffers.assign + the copy in hisparse_reads.swap_in), on the CPU under
TRITON_INTERPRET=1: over a sequence of rounds on the same buffers (hits, misses, empty and LRU
victims, NO_ENTRY padding, inserts), both must return the same slots, leave the same slot map,
LRU clock and statistics, and the same hot-buffer bytes (a copy is exact). FP8 hot buffers
(kv_cache_dtype) too: raw bytes from an FP8 mirror, quantize_kv of the compressor's model-dtype
entries."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_triton_hybrid_v4.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hybridkv.attention_backends.hisparse_reads import swap_in  # noqa: E402
from hybridkv.attention_backends.triton_attention.hisparse_swap_in import triton_swap_in  # noqa: E402
from hybridkv.attention_backends.hisparse_buffers import NO_ENTRY, HotBuffers  # noqa: E402
from hybridkv.attention_backends.kv_cache_dtype import byte_view, quantize_kv  # noqa: E402


def _requests(g: torch.Generator, n: int, k: int, universe: int, pad: float) -> torch.Tensor:
    """[n, k] distinct entries per row drawn from [0, universe), some padded with NO_ENTRY."""
    rows = torch.stack([torch.randperm(universe, generator=g)[:k] for _ in range(n)])
    return rows.masked_fill(torch.rand(n, k, generator=g) < pad, NO_ENTRY)


def _source_on_another_device(monkeypatch) -> None:
    """The source counts as another device's (the host mirror of a CUDA engine): the kernel only
    decides and the misses are copied by a host gather."""
    from hybridkv.attention_backends import host_mirror
    from hybridkv.attention_backends.triton_attention import hisparse_swap_in

    monkeypatch.setattr(hisparse_swap_in, "crosses", lambda pool, compute: True)
    monkeypatch.setattr(host_mirror, "crosses", lambda pool, compute: True)


def _assert_rounds_agree(g: torch.Generator, size: int, k: int, source: torch.Tensor, hot_dtype: torch.dtype) -> None:
    """Twelve rounds of swap-ins on the same buffers by the torch reference and the fused kernel
    (hits, misses, empty and LRU victims, NO_ENTRY padding, inserts): after each, the same slots,
    slot map, LRU clock, statistics and hot-buffer bytes."""
    D = source.shape[1]
    layers, max_requests, universe = 2, 5, 3 * size
    ref, fused = HotBuffers(layers, max_requests, size, k), HotBuffers(layers, max_requests, size, k)
    for rid in ("a", "b", "c", "d"):
        assert ref.acquire(rid) == fused.acquire(rid)
    hot_ref = torch.zeros(ref.num_slots, D, dtype=hot_dtype)
    hot_fused = hot_ref.clone()
    for round_ in range(12):
        layer = round_ % layers
        rows = torch.randperm(4, generator=g)[: 1 + round_ % 4]  # distinct rows, varying count
        # A small universe makes later rounds hit what earlier ones placed.
        entries = _requests(g, rows.numel(), k, universe, pad=0.2 if round_ % 3 else 0.0)
        mslots = torch.randint(0, source.shape[0], entries.shape, generator=g)
        insert = round_ % 5 == 4
        want = swap_in(ref, layer, rows, entries, hot_ref, source, mslots, insert=insert)
        got = triton_swap_in(fused, layer, rows, entries, hot_fused, source, mslots, insert=insert)
        assert torch.equal(got, want), round_
        assert torch.equal(fused.entry, ref.entry) and torch.equal(fused.last_use, ref.last_use), round_
        assert torch.equal(byte_view(hot_fused), byte_view(hot_ref)), round_
        assert fused.clock == ref.clock and fused.stats == ref.stats, round_
    assert ref.stats.hits > 0 and ref.stats.loaded > 0  # both paths were exercised
    fused.check_invariants()
    for rid in ("a", "b"):
        assert fused.request_counts(rid) == ref.request_counts(rid)


@pytest.mark.parametrize("host_source", [False, True], ids=["same_device", "host_mirror"])
@pytest.mark.parametrize("size,k,D,slot_block", [(8, 3, 5, 128), (16, 16, 4, 4), (12, 5, 70, 4), (12, 5, 3, 8)])
def test_fused_swap_in_equals_the_reference_round_after_round(size, k, D, slot_block, host_source, monkeypatch):
    """slot_block below the buffer size makes the kernel's hit and rank loops span several blocks
    (and a last partial one)."""
    from hybridkv.attention_backends.triton_attention import hisparse_swap_in

    monkeypatch.setattr(hisparse_swap_in, "SLOT_BLOCK", slot_block)
    if host_source:
        _source_on_another_device(monkeypatch)
    g = torch.Generator().manual_seed(size * 100 + k)
    _assert_rounds_agree(g, size, k, torch.randn(200, D, generator=g), torch.float32)


FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("host_source", [False, True], ids=["same_device", "host_mirror"])
@pytest.mark.parametrize("source_dtype", ["fp8_mirror", torch.float32, torch.bfloat16],
                         ids=["fp8_mirror", "fresh_float32", "fresh_bfloat16"])
@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=["e4m3", "e5m2"])
def test_fused_swap_in_into_fp8_buffers_stores_the_reference_bytes(fmt, source_dtype, host_source, monkeypatch):
    """FP8 hot buffers: from an FP8 mirror the misses are its raw bytes; from the compressor's
    model-dtype entries they are quantize_kv's bytes (saturated: some values lie far beyond both
    formats' maxima, some in the subnormal range) -- as the torch swap-in stores them."""
    if host_source:
        _source_on_another_device(monkeypatch)
    g = torch.Generator().manual_seed(7)
    values = torch.randn(200, 70, generator=g) * 4
    values[::7, ::5] *= 1e5  # beyond e4m3's 448 and e5m2's 57344
    values[1::7] *= 1e-4  # FP8 subnormals
    source = quantize_kv(values, fmt) if source_dtype == "fp8_mirror" else values.to(source_dtype)
    _assert_rounds_agree(g, 12, 5, source, fmt)


def test_fused_swap_in_with_nothing_to_place_returns_empty_slots():
    buffers = HotBuffers(1, 2, 4, 2)
    out = triton_swap_in(buffers, 0, torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long),
                         torch.zeros(buffers.num_slots, 3), torch.zeros(4, 3), torch.empty(0, 2, dtype=torch.long))
    assert out.shape == (0, 2) and buffers.clock == 0
