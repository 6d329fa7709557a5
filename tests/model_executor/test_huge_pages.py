"""huge_pages: large CPU tensors start on a 2 MiB boundary and are advised MADV_HUGEPAGE before
first touch; small ones, views and the off switch stay plain; an arena lays tensors of any size
side by side on advised huge pages; moving weights keeps their values and their ties."""
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridkv.model_executor import huge_pages
from memory_pages import resident_fraction
from hybridkv.model_executor.huge_pages import (
    ARENA_ALIGN, HUGE_PAGE_BYTES, HugePageArena, huge_empty, kv_pool_on, move_parameters_to_huge_pages, on_huge_pages,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or huge_pages._madvise() is None or not THP.exists()
    or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to never",
)


def vma_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds addr."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            continue
        if inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@linux_thp
def test_large_tensor_is_aligned_and_advised_before_first_touch():
    t = huge_empty(3, 1 << 20, dtype=torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0, "storage must start on a huge-page boundary"
    # VM_HUGEPAGE shows as "hg" in VmFlags once madvise(MADV_HUGEPAGE) took effect
    assert "hg" in vma_flags(t.data_ptr() + HUGE_PAGE_BYTES).get("VmFlags", "").split()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


def test_small_tensor_and_the_off_switch_are_plain(monkeypatch):
    small = huge_empty(16, 16, dtype=torch.float32)
    assert small.shape == (16, 16) and small.untyped_storage().nbytes() == 16 * 16 * 4
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    big = huge_empty(1 << 20, dtype=torch.float32)
    assert big.untyped_storage().nbytes() == 4 << 20, "off: a plain torch.empty, no padding"
    w = torch.randn(1 << 20)
    assert on_huge_pages(w) is w


@linux_thp
def test_on_huge_pages_copies_owners_and_leaves_views_alone():
    owner = torch.randn(1 << 20)  # 4 MiB
    moved = on_huge_pages(owner)
    assert moved is not owner and torch.equal(moved, owner) and moved.data_ptr() % HUGE_PAGE_BYTES == 0
    view = torch.randn(2 << 20)[: 1 << 20]  # half of a larger storage: a copy would double memory
    assert on_huge_pages(view) is view
    transposed = torch.randn(1024, 2048).t()  # not contiguous: copying would change its strides
    assert on_huge_pages(transposed) is transposed


@linux_thp
def test_move_parameters_keeps_values_and_ties():
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 4096, bias=False), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied, 4 MiB
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = move_parameters_to_huge_pages(model)
    assert moved == (4096 * 256 + 8 * 8 + 8) * 4, "the tied weight moves once, the small ones too"
    assert model[1].weight is model[0].weight
    assert model[0].weight.data_ptr() % HUGE_PAGE_BYTES == 0
    assert model[2].weight.data_ptr() > model[0].weight.data_ptr(), "parameters are laid out in module order"
    assert "hg" in vma_flags(model[2].bias.data_ptr()).get("VmFlags", "").split(), "a small parameter was not advised"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


@linux_thp
def test_an_arena_lays_tensors_side_by_side_on_advised_huge_pages():
    """Each placed tensor is a copy (same shape, dtype, values), starts on a cache line right
    after the one before it, on memory advised MADV_HUGEPAGE; the first starts a 2 MiB page; one
    that does not fit the rest of a chunk opens the next; one larger than a chunk gets a chunk of
    its own size."""
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    sources = [torch.randn(7, 13), torch.randn(100).to(torch.bfloat16), torch.arange(5, dtype=torch.int32),
               torch.randn(3, 64, 64)]
    placed = [arena.place(t) for t in sources]
    for src, got in zip(sources, placed):
        assert got is not src and got.shape == src.shape and got.dtype == src.dtype and torch.equal(got, src)
        assert got.is_contiguous() and got.data_ptr() % ARENA_ALIGN == 0
        assert "hg" in vma_flags(got.data_ptr()).get("VmFlags", "").split(), "an arena tensor was not advised"
    assert placed[0].data_ptr() % HUGE_PAGE_BYTES == 0, "the first chunk does not start a huge page"
    for before, after in zip(placed, placed[1:]):
        end = before.data_ptr() + before.numel() * before.element_size()
        assert after.data_ptr() == -(-end // ARENA_ALIGN) * ARENA_ALIGN, "placed tensors are not side by side"
    rest = HUGE_PAGE_BYTES - (placed[-1].data_ptr() + placed[-1].numel() * 4 - placed[0].data_ptr())
    too_big_for_the_rest = arena.place(torch.ones(rest // 4 + 16))
    assert too_big_for_the_rest.data_ptr() % HUGE_PAGE_BYTES == 0, "a tensor past the chunk's end must open a chunk"
    larger_than_a_chunk = arena.place(torch.ones(HUGE_PAGE_BYTES // 2 + 1))
    assert larger_than_a_chunk.data_ptr() % HUGE_PAGE_BYTES == 0 and bool(larger_than_a_chunk.eq(1).all())
    assert arena.placed_bytes == sum(t.numel() * t.element_size() for t in sources + [too_big_for_the_rest,
                                                                                      larger_than_a_chunk])


def test_an_arena_leaves_views_and_the_off_switch_alone(monkeypatch):
    arena = HugePageArena()
    view = torch.randn(64)[8:]  # part of a larger storage: a copy would break the sharing
    assert arena.place(view) is view
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    small = torch.randn(16)
    assert arena.place(small) is small


@linux_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_streamed_weight_copies_share_one_arena_in_forward_order(dtype):
    """pack_linear_weights puts the copy each linear's decode path streams into one arena, in
    module order (forward order), small weights included."""
    from hybridkv.model_executor.layers import pack_linear_weights

    model = nn.Sequential(*(nn.Linear(64, 96) for _ in range(4))).to(dtype)
    if pack_linear_weights(model) == 0:
        pytest.skip(f"no prepacked linear for {dtype} weights on this CPU")
    copies = [getattr(m.forward, "blocked_packed", None) for m in model]
    copies = [c if c is not None else getattr(m.forward, "packed", None) for c, m in zip(copies, model)]
    if not all(isinstance(c, torch.Tensor) and c.layout == torch.strided for c in copies):
        pytest.skip(f"this CPU's {dtype} linear keeps only oneDNN's opaque copy")
    starts = [c.data_ptr() for c in copies]
    assert starts == sorted(starts), "the copies are not in forward order"
    assert starts[-1] - starts[0] < HUGE_PAGE_BYTES, "the small copies do not share the arena's pages"
    for c in copies:
        assert "hg" in vma_flags(c.data_ptr()).get("VmFlags", "").split(), "a streamed copy was not advised"
    x = torch.randn(3, 64).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for m in model:
        torch.testing.assert_close(m(x).float(), torch.nn.functional.linear(x, m.weight, m.bias).float(),
                                   rtol=tol, atol=tol)


def test_a_refused_or_missing_madvise_still_gives_a_working_tensor(monkeypatch):
    """madvise failing (EINVAL under THP "never" on some kernels) or absent (not Linux): the
    tensor is still the right shape and holds what is written; only the pages differ."""
    monkeypatch.setattr(huge_pages, "_madvise", lambda: (lambda addr, length, advice: -1))
    t = huge_empty(1 << 20, dtype=torch.float32)
    t.copy_(torch.arange(1 << 20, dtype=torch.float32))
    assert t.shape == (1 << 20,) and float(t[-1]) == (1 << 20) - 1
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)
    plain = huge_empty(1 << 20, dtype=torch.float32)
    assert plain.untyped_storage().nbytes() == 4 << 20, "no madvise: a plain torch.empty"
    w = torch.randn(1 << 20)
    assert on_huge_pages(w) is w


def test_kv_pool_on_other_devices_is_zeroed_torch_tensor():
    t = kv_pool_on("meta", 4, 4, dtype=torch.float16)
    assert t.device.type == "meta" and t.shape == (4, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_prefaulted_kv_pool_is_resident_and_zero_when_it_is_made(monkeypatch, switch):
    """With prefault (a server's default) no step pays a first-touch page fault in the pool:
    kv_pool_on touches every page (huge or small) when the engine starts, and the pool reads as
    zeros (the null page every padded read points at must be zero)."""
    monkeypatch.setenv(huge_pages.ENV_SWITCH, switch)
    pool = kv_pool_on("cpu", 2, 3, 1 << 20, dtype=torch.float32, prefault=True)  # 24 MiB
    assert pool.shape == (2, 3, 1 << 20) and pool.dtype == torch.float32
    assert resident_fraction(pool) == 1.0, "every page of the pool must be resident"
    assert not pool.any(), "the pool must start zeroed"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_lazy_kv_pool_costs_only_the_pages_written(monkeypatch, switch):
    """By default a pool's memory is taken as pages are written: a fresh pool is (almost) not
    resident, reads as zeros, and writing one slice makes about that slice resident."""
    monkeypatch.setenv(huge_pages.ENV_SWITCH, switch)
    pool = kv_pool_on("cpu", 8, 1 << 20, dtype=torch.float32)  # 32 MiB
    assert pool.shape == (8, 1 << 20) and pool.dtype == torch.float32
    assert resident_fraction(pool) < 0.1, "a fresh lazy pool must not be resident"
    pool[1].fill_(1.0)  # 4 MiB of 32
    assert 0.12 <= resident_fraction(pool) <= 0.13, "writing 1/8 of the pool must make 1/8 resident"
    assert not pool[0].any() and not pool[2:].any() and bool((pool[1] == 1).all())
    del pool  # the mapping goes with the last view
    small = kv_pool_on("cpu", 4, 16, dtype=torch.float16)
    assert not small.any() and small.dtype == torch.float16


@linux_thp
def test_the_blocked_linear_copy_a_decode_streams_is_on_huge_pages():
    """BlockedLinearWeight's column-block copy is what a decode step reads, not the parameter:
    it must be 2 MiB-aligned and advised like the parameters, and give F.linear's result."""
    from hybridkv.model_executor.layers import BlockedLinearWeight, blocked_linear_for

    weight = torch.randn(1536, 576)  # 3.5 MiB packed
    if (ops := blocked_linear_for(weight)) is None:
        pytest.skip("the blocked linear serves AVX-512 CPUs with a compiler only")
    linear = BlockedLinearWeight(weight, None, ops)
    assert linear.packed.data_ptr() % HUGE_PAGE_BYTES == 0, "the blocked copy is not on a 2 MiB boundary"
    assert "hg" in vma_flags(linear.packed.data_ptr()).get("VmFlags", "").split(), "the blocked copy was not advised"
    x = torch.randn(3, 576)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
