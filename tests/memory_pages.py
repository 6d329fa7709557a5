"""How much of a tensor's memory is resident: what the tests of lazily taken memory measure."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch


def resident_fraction(t: torch.Tensor) -> float:
    """The fraction of the memory pages under t's storage that are resident, by mincore(2).

    Per page, over exactly the tensor's bytes: the Rss of the mapping at data_ptr would not do,
    because the allocator's region may be split into several mappings (an earlier madvise on
    part of it) or be larger than the tensor."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages
