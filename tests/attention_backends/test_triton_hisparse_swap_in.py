"""The fused HiSparse swap-in kernel (triton_attention/hisparse_swap_in.py) against the torch
reference (HotBuffers.assign + the copy in hisparse_reads.swap_in), on the CPU under
TRITON_INTERPRET=1: over a sequence of rounds on the same buffers (hits, misses, empty and LRU
victims, NO_ENTRY padding, inserts), both must return the same slots, leave the same slot map,
LRU clock and statistics, and the same hot-buffer bytes (a copy is exact)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_triton_hybrid_v4.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hybridkv.attention_backends.hisparse_reads import swap_in  # noqa: E402
from hybridkv.attention_backends.triton_attention.hisparse_swap_in import triton_swap_in  # noqa: E402
from hybridkv.attention_backends.hisparse_buffers import NO_ENTRY, HotBuffers  # noqa: E402


def _requests(g: torch.Generator, n: int, k: int, universe: int, pad: float) -> torch.Tensor:
    """[n, k] distinct entries per row drawn from [0, universe), some padded with NO_ENTRY."""
    rows = torch.stack([torch.randperm(universe, generator=g)[:k] for _ in range(n)])
    return rows.masked_fill(torch.rand(n, k, generator=g) < pad, NO_ENTRY)


@pytest.mark.parametrize("host_source", [False, True], ids=["same_device", "host_mirror"])
@pytest.mark.parametrize("size,k,D,slot_block", [(8, 3, 5, 128), (16, 16, 4, 4), (12, 5, 70, 4), (12, 5, 3, 8)])
def test_fused_swap_in_equals_the_reference_round_after_round(size, k, D, slot_block, host_source, monkeypatch):
    """slot_block below the buffer size makes the kernel's hit and rank loops span several blocks
    (and a last partial one). host_source: the source counts as another device's (the host mirror
    of a CUDA engine), so the kernel only decides and the misses are copied by a host gather."""
    from hybridkv.attention_backends import host_mirror
    from hybridkv.attention_backends.triton_attention import hisparse_swap_in

    monkeypatch.setattr(hisparse_swap_in, "SLOT_BLOCK", slot_block)
    if host_source:
        monkeypatch.setattr(hisparse_swap_in, "crosses", lambda pool, compute: True)
        monkeypatch.setattr(host_mirror, "crosses", lambda pool, compute: True)
    g = torch.Generator().manual_seed(size * 100 + k)
    layers, max_requests, universe = 2, 5, 3 * size
    ref, fused = HotBuffers(layers, max_requests, size, k), HotBuffers(layers, max_requests, size, k)
    for rid in ("a", "b", "c", "d"):
        assert ref.acquire(rid) == fused.acquire(rid)
    mirror = torch.randn(200, D, generator=g)
    hot_ref = torch.zeros(ref.num_slots, D)
    hot_fused = hot_ref.clone()
    for round_ in range(12):
        layer = round_ % layers
        rows = torch.randperm(4, generator=g)[: 1 + round_ % 4]  # distinct rows, varying count
        # A small universe makes later rounds hit what earlier ones placed.
        entries = _requests(g, rows.numel(), k, universe, pad=0.2 if round_ % 3 else 0.0)
        mslots = torch.randint(0, mirror.shape[0], entries.shape, generator=g)
        insert = round_ % 5 == 4
        want = swap_in(ref, layer, rows, entries, hot_ref, mirror, mslots, insert=insert)
        got = triton_swap_in(fused, layer, rows, entries, hot_fused, mirror, mslots, insert=insert)
        assert torch.equal(got, want), round_
        assert torch.equal(fused.entry, ref.entry) and torch.equal(fused.last_use, ref.last_use), round_
        assert torch.equal(hot_fused, hot_ref), round_
        assert fused.clock == ref.clock and fused.stats == ref.stats, round_
    assert ref.stats.hits > 0 and ref.stats.loaded > 0  # both paths were exercised
    fused.check_invariants()
    for rid in ("a", "b"):
        assert fused.request_counts(rid) == ref.request_counts(rid)


def test_fused_swap_in_with_nothing_to_place_returns_empty_slots():
    buffers = HotBuffers(1, 2, 4, 2)
    out = triton_swap_in(buffers, 0, torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long),
                         torch.zeros(buffers.num_slots, 3), torch.zeros(4, 3), torch.empty(0, 2, dtype=torch.long))
    assert out.shape == (0, 2) and buffers.clock == 0
