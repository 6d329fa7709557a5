"""CPU tensors on transparent huge pages: the KV caches and the weights a decode step streams.

A decode step reads each weight and every key it scores once, mostly from DRAM. With 4 KiB pages
each 4 KiB of that costs a TLB miss and a page walk (a 540 MB fp32 model is 135k of them per
token; V4's indexer keys at 128k context are 2k per CSA layer per step). Linux backs memory with 2 MiB pages where a process
asks for them with madvise(MADV_HUGEPAGE) before first touching it ("madvise", the usual THP
setting; "always" needs no asking, "never" ignores it). PyTorch's allocator only asks when the
environment had THP_MEM_ALLOC_ENABLE=1 at import, so the engine asks itself, for the few large
tensors that matter: allocated 2 MiB-aligned and advised before anything is written.

Best effort by design: off Linux, without libc's madvise, under HYBRIDKV_HUGE_PAGES=0, or for
tensors under 2 MiB these are plain torch.empty / the tensor unchanged. The kernel may still
hand out small pages (no free huge page, THP "never"); nothing depends on getting them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys
from functools import lru_cache

import torch

from hybridkv.attention_backends.cpu_kernels.build import switch_on

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ENV_SWITCH = "HYBRIDKV_HUGE_PAGES"


def huge_pages_enabled() -> bool:
    """False when HYBRIDKV_HUGE_PAGES is 0/false/off/no (the A/B switch)."""
    return switch_on(ENV_SWITCH)  # the same rule as HYBRIDKV_CPU_KERNELS


@lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None off Linux or when it cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(*shape, dtype=dtype) on the CPU whose storage starts on a 2 MiB boundary and
    was advised MADV_HUGEPAGE before first touch (see the module docstring for when it is not)."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE_BYTES or madvise is None or not huge_pages_enabled():
        return torch.empty(*shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES  # a multiple of torch's 64-byte alignment
    if madvise(raw.data_ptr() + offset, nbytes, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): small pages", ctypes.get_errno())
    return raw[offset:offset + nbytes].view(dtype).view(*shape)


def kv_pool_on(device: torch.device | str, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A KV cache pool on `device`, zeroed: through huge_empty on the CPU, and touched here, once,
    at engine start (torch.zero_ faults it in on every compute thread).

    Why not leave it untouched until a step writes it: each first write to a 2 MiB page then
    costs the step a page fault that zeroes 2 MiB (or 512 faults of 4 KiB), and a prefix-caching
    pool hands out never-used pages first, so every step faults until the whole pool has been
    walked once. Measured on the 2-core Intel VM (AVX-512 + AMX), workload c (1,024 prompt
    tokens): the KV writes took 155 ms of a 1.31 s step on untouched huge pages, 29 ms on
    untouched small pages, ~3 ms on touched ones. Touching 2 GiB at start takes ~0.2 s there
    (up to ~3 s the first time a fresh VM's memory is used at all). It also commits the pool's
    memory at start, so a pool that does not fit fails then, not in the middle of a request."""
    if torch.device(device).type == "cpu":
        return huge_empty(*shape, dtype=dtype).zero_()
    return torch.zeros(*shape, dtype=dtype, device=device)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor t in huge_empty storage; t itself when it is small, not on
    the CPU, huge pages are off, or t does not own its whole storage (a view into a larger
    tensor: a copy would break the sharing and double the memory). For weights: their first
    touch happened at load, so only a fresh copy can get huge pages."""
    nbytes = t.numel() * t.element_size()
    if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or nbytes < HUGE_PAGE_BYTES
            or _madvise() is None or not huge_pages_enabled() or not t.is_contiguous()
            or t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes):
        return t
    out = huge_empty(*t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


def move_parameters_to_huge_pages(module: torch.nn.Module) -> int:
    """Re-home every large CPU parameter and buffer of `module` on huge pages (in place, same
    values; tied parameters stay tied). Returns the bytes moved."""
    moved, seen = 0, set()
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for t in getattr(sub, kind).values():
                if t is None or id(t) in seen:  # a tied tensor is one object: moved once
                    continue
                seen.add(id(t))
                data = t.data  # a new tensor object on every access: compare storages, not objects
                new = on_huge_pages(data)
                if new.data_ptr() != data.data_ptr():
                    t.data = new
                    moved += new.numel() * new.element_size()
    return moved
