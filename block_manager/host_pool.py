"""HostPool: the host-tier (L2) pages of one block space, as bookkeeping.

A host page belongs to at most one node of the shadow index (its host shadow in this space) or
is free; there are no refcounts, because requests never read host pages: a hit on the host is
loaded back into device pages first. The bytes live in the model runner's host buffers
(model_executor/host_kv_cache.py); this class only says which page ids are taken.
Host page ids are 0..num_pages-1 (the host has no null page: nothing reads a host page unasked).
"""
from __future__ import annotations

from collections import deque


class OutOfHostPagesError(RuntimeError):
    pass


class HostPool:
    def __init__(self, name: str, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"host pool of space {name!r} needs at least one page, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfHostPagesError(f"host pool of space {self.name!r} is full ({self.num_pages} pages)")
        page = self._free.popleft()
        self._used[page] = True
        return page

    def free(self, page: int) -> None:
        if not self._used[page]:
            raise AssertionError(f"host pool {self.name!r}: page {page} freed twice")
        self._used[page] = False
        self._free.append(page)

    def is_used(self, page: int) -> bool:
        return self._used[page]

    def check_invariants(self, referenced: set[int]) -> None:
        """referenced: the host pages the index holds in this space (exactly the used ones)."""
        free = set(self._free)
        assert len(free) == len(self._free), f"host pool {self.name!r}: a page is on the free list twice"
        used = {p for p in range(self.num_pages) if self._used[p]}
        assert not (free & used), f"host pool {self.name!r}: pages both free and used: {sorted(free & used)[:5]}"
        assert len(free) + len(used) == self.num_pages, f"host pool {self.name!r}: ledger drift"
        assert used == referenced, (
            f"host pool {self.name!r}: used pages differ from the index's host shadows "
            f"(leaked {sorted(used - referenced)[:5]}, unaccounted {sorted(referenced - used)[:5]})"
        )
