"""Keep freed step tensors in the process heap instead of handing them back to the kernel.

A forward pass allocates and frees the same large activations in every layer of every step (a
1,024-token float32 prefill of the demo model: the gate/up projection's 12.6 MB output, its 6.3 MB
SiLU product, the 3.9 MB QKV, ...). glibc's malloc serves blocks above its mmap threshold (128 KiB
at start, raised as such blocks are freed) with fresh mmap()s, and gives the top of its heap back
once more than the trim threshold is free there. Either way the next layer's tensor lands on pages
the kernel must fault in and zero again: that prefill took ~91,700 minor page faults a step
(~375 MB), 0.1-0.2 s of system time on a ~1.1 s step (2-core Intel VM, float32). vLLM's CPU build
avoids the same by preloading tcmalloc.

`retain_freed_heap()` sets glibc's thresholds once, at engine start on the CPU: blocks up to 32 MiB
(glibc's cap) come from the heap, and the heap's top is kept up to 1 GiB. The process then holds
its peak heap (the largest step's activations) rather than returning it between steps, as any
caching allocator does. Nothing else changes: the same bytes are computed into memory that is
already mapped.

Best effort: glibc only (mallopt); HYBRIDKV_RETAIN_HEAP=0 leaves malloc as it was, and so does a
libc without mallopt (musl). The model runner logs which, and why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

from hybridkv.attention_backends.cpu_kernels.build import switch_on

ENV_SWITCH = "HYBRIDKV_RETAIN_HEAP"
M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD_BYTES = 1 << 30


@dataclass(frozen=True)
class HeapRetention:
    applied: bool
    reason: str


def retain_freed_heap() -> HeapRetention:
    """Raise glibc's mmap and trim thresholds (see the module docstring). Idempotent; returns
    whether it applied and why (for the engine's log line)."""
    if not switch_on(ENV_SWITCH):
        return HeapRetention(False, f"{ENV_SWITCH}=0")
    if not sys.platform.startswith("linux"):
        return HeapRetention(False, f"not Linux ({sys.platform})")
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return HeapRetention(False, "this libc has no mallopt")
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; setting either threshold also stops glibc's own adjustment of
    # both, so both are set.
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        return HeapRetention(False, "mallopt refused the thresholds")
    return HeapRetention(True, f"mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold "
                               f"{TRIM_THRESHOLD_BYTES >> 20} MiB")


def release_free_heap() -> bool:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim(0)): once, after the model
    load, whose freed tensors (checkpoint reads, weights copied onto huge pages or packed) the
    retention above would otherwise keep for the life of the process. True if it ran."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
