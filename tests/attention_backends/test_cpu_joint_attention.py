"""The fused CPU joint attention (cpu_kernels/joint_attention.cpp, routed by
hybrid_v4.cpu_joint_attention) equals the torch joint softmax (hybrid_v4.torch_joint_attention)
to float32 rounding: every key-set form the backend builds (a prefill block's shared sliding
window with its mask, shared causal entries, per-row top-k and decode sets with masks, page-form
decode entries), rows that may read nothing (the sink alone), head counts off the kernel's
groups of 4, head sizes off the vector width, and one or two threads. A per-row set's columns a
row may not read are never read (NaN there changes nothing); bad slots are refused, not read."""
from __future__ import annotations

import pytest
import torch

from hybridkv.attention_backends import hybrid_v4
from hybridkv.attention_backends.cpu_kernels import kernels_enabled, load_joint_attention
from hybridkv.attention_backends.hybrid_metadata import KeySet
from hybridkv.attention_backends.hybrid_v4 import cpu_joint_attention, torch_joint_attention

kernel = load_joint_attention()
pytestmark = pytest.mark.skipif(not kernels_enabled(), reason="CPU kernels switched off (HYBRIDKV_CPU_KERNELS=0)")


@pytest.fixture(autouse=True)
def _built():
    # CI installs g++: a failed build fails these tests instead of skipping them.
    assert kernel is not None, "the CPU joint-attention kernel did not build on this machine (g++ and ninja installed?)"


def _prefill_sets(g, n: int, window: int, entries: int, ratio: int, start: int, D: int):
    """A prefill block of n rows from position `start`: the shared sliding-window keys with their
    causal window mask, and shared causal entries (row t reads (t + 1) // ratio of them)."""
    swa_cache = torch.randn(4 * (window + n) + 50, D, generator=g)
    entry_cache = torch.randn(2 * entries + 20, D, generator=g)
    qpos = torch.arange(start, start + n)
    kpos = torch.arange(max(0, start - window + 1), start + n)
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
    swa = KeySet(torch.randperm(swa_cache.shape[0], generator=g)[: kpos.numel()], explicit_mask=mask)
    visible = ((qpos + 1) // ratio).clamp(max=entries)
    ent = KeySet(torch.randperm(entry_cache.shape[0], generator=g)[:entries], visible=visible)
    return (swa_cache, swa), (entry_cache, ent)


def _per_row_set(g, n: int, L: int, D: int, p_readable: float = 0.7):
    cache = torch.randn(3 * L + 10, D, generator=g)
    mask = torch.rand(n, L, generator=g) < p_readable
    return cache, KeySet(torch.randint(0, cache.shape[0], (n, L), generator=g), explicit_mask=mask)


def _check(q, sources, sink, scale=0.3):
    got = cpu_joint_attention(q, sources, sink, scale)
    want = torch_joint_attention(q, sources, sink, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    return got


@pytest.mark.parametrize("H,D", [(4, 32), (1, 8), (3, 20), (5, 64), (8, 36), (16, 128)])
def test_prefill_block_sets_equal_the_torch_softmax(H, D, threads):
    """Shared window keys with a mask plus shared causal entries (HCA prefill), and the same window
    plus per-row top-k entries (CSA prefill); the first rows see no entries at all."""
    g = torch.Generator().manual_seed(H * 1000 + D)
    n = 37
    swa, ent = _prefill_sets(g, n, window=16, entries=30, ratio=4, start=0, D=D)
    q = torch.randn(n, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    _check(q, [swa], sink)  # sliding layers
    _check(q, [swa, ent], sink)  # HCA
    _check(q, [swa, _per_row_set(g, n, 9, D)], sink)  # CSA: top-k columns per row


def test_long_shared_entries_and_mid_sequence_blocks(threads):
    """A block deep in a sequence: a window wider than the block, hundreds of causal entries."""
    g = torch.Generator().manual_seed(5)
    n, H, D = 256, 4, 32
    swa, ent = _prefill_sets(g, n, window=128, entries=600, ratio=4, start=2000, D=D)
    _check(torch.randn(n, H, D, generator=g), [swa, ent], torch.randn(H, generator=g))


def test_decode_sets_in_slot_and_page_form(threads):
    """Decode rows: per-row window slots with a mask, and compressed entries in page form (the
    block-table rows; the kernel reads the per-column slots built from them)."""
    g = torch.Generator().manual_seed(6)
    n, H, D, spp = 9, 4, 32, 8
    swa = _per_row_set(g, n, 16, D, p_readable=0.8)
    entry_cache = torch.randn(40 * spp, D, generator=g)
    pages = torch.stack([torch.randperm(39, generator=g)[:6] + 1 for _ in range(n)])
    visible = torch.randint(0, 6 * spp + 1, (n,), generator=g)
    visible[0] = 0
    ent = KeySet(pages=pages, slots_per_page=spp, length=6 * spp, visible=visible)
    _check(torch.randn(n, H, D, generator=g), [swa, (entry_cache, ent)], torch.randn(H, generator=g))


def test_a_row_that_may_read_nothing_gets_zero():
    """Every column masked: the sink alone takes the softmax and its value is zero."""
    g = torch.Generator().manual_seed(7)
    cache, ks = _per_row_set(g, 3, 10, 16)
    ks.explicit_mask[1] = False
    got = _check(torch.randn(3, 2, 16, generator=g), [(cache, ks)], torch.randn(2, generator=g))
    assert torch.equal(got[1], torch.zeros(2, 16))


def test_per_row_columns_a_row_may_not_read_are_never_read():
    """NaN in every slot no row may read (the torch path reads masked slots and multiplies them by
    a zero weight, so it must be given finite ones): the kernel's output is unchanged and finite."""
    g = torch.Generator().manual_seed(8)
    n, H, D = 11, 4, 32
    cache, ks = _per_row_set(g, n, 20, D, p_readable=0.5)
    q, sink = torch.randn(n, H, D, generator=g), torch.randn(H, generator=g)
    want = cpu_joint_attention(q, [(cache, ks)], sink, 0.3)
    readable = ks.slots[ks.explicit_mask].unique()
    poisoned = torch.full_like(cache, float("nan"))
    poisoned[readable] = cache[readable]
    got = cpu_joint_attention(q, [(poisoned, ks)], sink, 0.3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_slot_outside_the_cache_is_refused():
    g = torch.Generator().manual_seed(9)
    cache, ks = _per_row_set(g, 4, 6, 8)
    ks.slots[2, 3] = cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_joint_attention(torch.randn(4, 2, 8, generator=g), [(cache, ks)], torch.randn(2, generator=g), 0.3)


def test_routing_falls_back_to_torch_where_the_kernel_does_not_apply(monkeypatch):
    """bfloat16, more columns than the kernel takes, or no kernel: the torch path runs."""
    g = torch.Generator().manual_seed(10)
    cache, ks = _per_row_set(g, 5, 12, 16)
    q, sink = torch.randn(5, 2, 16, generator=g), torch.randn(2, generator=g)
    calls = []
    real = hybrid_v4.torch_joint_attention
    monkeypatch.setattr(hybrid_v4, "torch_joint_attention", lambda *a: calls.append(1) or real(*a))
    cpu_joint_attention(q, [(cache, ks)], sink, 0.3)
    assert not calls  # float32 on the CPU: the kernel
    out = cpu_joint_attention(q.bfloat16(), [(cache.bfloat16(), ks)], sink, 0.3)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    monkeypatch.setattr(hybrid_v4, "FUSED_ATTENTION_MAX_COLUMNS", 11)
    cpu_joint_attention(q, [(cache, ks)], sink, 0.3)
    assert len(calls) == 2


@pytest.mark.parametrize("shift", [1, 3, 8, 13])
def test_a_rows_output_does_not_depend_on_where_its_keys_sit_in_the_block(shift):
    """The same rows over the same keys, with the shared list shifted by `shift` leading columns
    they may not read (a prefill block that starts elsewhere when the chunks split at other
    positions): bit-identical outputs, so a prompt's result does not depend on its chunking."""
    g = torch.Generator().manual_seed(11)
    n, H, D, L = 20, 4, 32, 150
    cache = torch.randn(400, D, generator=g)
    slots = torch.randperm(400, generator=g)
    mask = torch.rand(n, L, generator=g) < 0.9
    mask[:, :5] = False
    ents = torch.randn(60, D, generator=g)
    entries = KeySet(torch.arange(40), visible=torch.randint(0, 41, (n,), generator=g))
    q, sink = torch.randn(n, H, D, generator=g), torch.randn(H, generator=g)
    base = KeySet(slots[shift : shift + L].clone(), explicit_mask=mask)
    moved = KeySet(slots[: shift + L].clone(), explicit_mask=torch.cat([torch.zeros(n, shift, dtype=torch.bool), mask], 1))
    a = cpu_joint_attention(q, [(cache, base), (ents, entries)], sink, 0.3)
    b = cpu_joint_attention(q, [(cache, moved), (ents, entries)], sink, 0.3)
    assert torch.equal(a, b)
