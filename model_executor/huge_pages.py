"""CPU tensors on transparent huge pages: the KV caches and the weights a decode step streams.

A decode step reads each weight and every key it scores once, mostly from DRAM. With 4 KiB pages
each 4 KiB of that costs a TLB miss and a page walk (a 540 MB fp32 model is 135k of them per
token; V4's indexer keys at 128k context are 2k per CSA layer per step). Linux backs memory with 2 MiB pages where a process
asks for them with madvise(MADV_HUGEPAGE) before first touching it ("madvise", the usual THP
setting; "always" needs no asking, "never" ignores it). PyTorch's allocator only asks when the
environment had THP_MEM_ALLOC_ENABLE=1 at import, so the engine asks itself, for the few large
tensors that matter: allocated 2 MiB-aligned and advised before anything is written. The weights
go side by side into a HugePageArena, small ones included, in the order a step reads them.

Best effort by design: off Linux, without libc's madvise, under HYBRIDKV_HUGE_PAGES=0, or (outside
an arena) for tensors under 2 MiB these are plain torch.empty / the tensor unchanged. The kernel may still
hand out small pages (no free huge page, THP "never"); nothing depends on getting them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
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


def lazy_zero_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) in an anonymous mapping of their own: the kernel hands out zero
    pages as they are first written, so the process's memory grows with the pages used, not with
    the pool's size. Small (4 KiB) pages, not huge ones: a pool is [layers, K/V, heads, slots,
    head] and one page of context touches every (layer, K/V, head) stripe, so 2 MiB pages would
    take 2 MiB per stripe for the first token (the demo model: 180 stripes, 360 MiB)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive


def host_kv_pool(*shape: int, dtype: torch.dtype, pinned: bool, prefault: bool = False) -> torch.Tensor:
    """A KV cache pool in host memory (HiSparse's C4 mirror, read by a forward that may run on
    another device), zeroed. pinned (a CUDA engine): page-locked, so copies to and from the
    device are DMA and may be asynchronous; pinned memory is committed in full here. Otherwise
    the CPU pool of kv_pool_on (taken as pages are written, or prefaulted)."""
    if pinned:
        return torch.zeros(*shape, dtype=dtype, pin_memory=True)
    return kv_pool_on("cpu", *shape, dtype=dtype, prefault=prefault)


def kv_pool_on(device: torch.device | str, *shape: int, dtype: torch.dtype, prefault: bool = False) -> torch.Tensor:
    """A KV cache pool on `device`, zeroed (the null page every masked or padded read points at
    must read as zeros). On the CPU its memory is taken lazily by default (lazy_zero_pages, small
    pages): a pool sized for a long context costs only the pages requests write, and the budget
    can be generous without holding the machine's memory from the start.

    With `prefault` (EngineConfig.kv_cache_prefault; `hybridkv serve`'s default) the pool is on
    huge pages and all of it is touched here instead (torch.zero_ on every compute thread), for
    a server that wants no step to pay a first-touch fault or a TLB miss per 4 KiB of keys read.
    Lazily taken pools cost a few percent on prefill-heavy work (2-core Zen 4, float32 demo model,
    benchmarks/offline_throughput.py, two alternating rounds: a 1,024-token prompt 1.47-1.50 s
    against 1.40, 32 x 128 tokens 12.9-13.1 s against 12.2-12.8). Each first write to a
    2 MiB page costs a fault that zeroes it (or 512 faults of 4 KiB), and a prefix-caching pool
    hands out never-used pages first, so until the pool has been walked once steps pay them.
    Measured on a 2-core Intel VM (AVX-512 + AMX), a 1,024-token prompt: the KV writes took 155 ms
    of a 1.31 s step on untouched huge pages, 29 ms on untouched small pages, ~3 ms on touched
    ones; touching 2 GiB at start took ~0.2 s there. Prefaulting also commits the pool's memory at
    start, so a pool that does not fit fails then, not in the middle of a request."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    if prefault:
        return huge_empty(*shape, dtype=dtype).zero_()
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:  # small pools: not worth a mapping of their own
        return torch.zeros(*shape, dtype=dtype)
    return lazy_zero_pages(nbytes).view(dtype).view(*shape)


def _may_rehome(t: torch.Tensor) -> bool:
    """Whether a copy of t may live on huge pages: a contiguous CPU tensor that owns its whole
    storage (a view into a larger tensor: a copy would break the sharing and double the memory),
    with huge pages on and madvise at hand."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and _madvise() is not None and huge_pages_enabled())


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor t in huge_empty storage of its own; t itself when it is
    small or may not be re-homed (_may_rehome). For weights: their first touch happened at load,
    so only a fresh copy can get huge pages. Many tensors a step reads one after another go
    through a HugePageArena instead, which also takes the small ones."""
    if t.numel() * t.element_size() < HUGE_PAGE_BYTES or not _may_rehome(t):
        return t
    out = huge_empty(*t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


ARENA_CHUNK_BYTES = 32 << 20
ARENA_ALIGN = 64  # a cache line: no tensor shares a line with the one before it


class HugePageArena:
    """Copies of many tensors, side by side on shared huge pages, in the order they are placed.

    What it is for: the weights a decode step streams. Most projections are under the 2 MiB
    that on_huge_pages asks of a tensor of its own (the demo model in bf16: q/k/v 1.1 MiB, o
    0.66, down 1.7), so they stayed on 4 KiB pages, and each call started its stream on cold
    TLB entries. Placed in forward order here, the step reads one run of 2 MiB pages. 2-core
    Zen 4, the demo model's 120 bf16 projections at one row, weights from memory, four
    alternating rounds: 24.1-28.4 GB/s each on its own, 29.0-32.7 GB/s in an arena (the same
    bytes in 2 calls: 32.5-34.1).

    Chunks of ARENA_CHUNK_BYTES (or one tensor's size, when larger) come from huge_empty; a
    tensor that does not fit the rest of a chunk opens the next, and the rest is never touched,
    so it costs address space, not memory. Each placed tensor is a view that keeps its chunk
    alive. Off the CPU, with huge pages off, and for views (_may_rehome), place returns the
    tensor itself."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8, starts on a 2 MiB boundary
        self._used = 0
        self.placed_bytes = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of t in the arena (same shape, dtype and values), or t itself."""
        if not _may_rehome(t):
            return t
        nbytes = t.numel() * t.element_size()
        start = -(-self._used // ARENA_ALIGN) * ARENA_ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            size = max(self.chunk_bytes, -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
            self._chunk, start = huge_empty(size, dtype=torch.uint8), 0
        self._used = start + nbytes
        self.placed_bytes += nbytes
        out = self._chunk[start:start + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


def move_parameters_to_huge_pages(module: torch.nn.Module, skip: frozenset[int] = frozenset()) -> int:
    """Re-home every CPU parameter and buffer of `module` on huge pages, side by side in module
    order in one HugePageArena (in place, same values; tied parameters stay tied), except the
    tensors whose id() is in `skip` (ones about to be released). Returns the bytes moved."""
    moved, seen, arena = 0, set(skip), HugePageArena()
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for t in getattr(sub, kind).values():
                if t is None or id(t) in seen:  # a tied tensor is one object: moved once
                    continue
                seen.add(id(t))
                data = t.data  # a new tensor object on every access: compare storages, not objects
                new = arena.place(data)
                if new.data_ptr() != data.data_ptr():
                    t.data = new
                    moved += new.numel() * new.element_size()
    return moved
