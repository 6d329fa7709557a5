"""BlockSpace: a pool of physical pages for one SpaceSpec, with refcounts.

A page is in exactly one of three states:
  free    -- on the free list, refcount 0, not referenced by the prefix index
  cached  -- referenced by the prefix index, refcount 0 (evictable)
  in use  -- refcount > 0 (held by running requests; may also be in the index)
so free + cached + in_use == capacity at all times (check_invariants()).

Page ids are 1..num_pages: page 0 (NULL_PAGE) is reserved in every space, never allocated and
never written, so the physical tensors hold num_physical_pages = num_pages + 1 pages.
"""
from __future__ import annotations

from collections import deque

from hybridkv.block_manager.space_spec import NULL_PAGE, SpaceSpec


class OutOfPagesError(RuntimeError):
    pass


class BlockSpace:
    def __init__(self, spec: SpaceSpec, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"space {spec.name!r} needs at least one page, got {num_pages}")
        spec.slots_per_page(page_size)  # validates the page size against the compression ratio
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_physical_pages = num_pages + 1  # + the reserved NULL_PAGE
        self.refcount = [0] * self.num_physical_pages
        self.in_index = [False] * self.num_physical_pages
        self._free: deque[int] = deque(range(NULL_PAGE + 1, self.num_physical_pages))
        self._num_in_use = 0
        self._num_cached_idle = 0

    # -- counts -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages held only by the prefix index (evictable)."""
        return self._num_cached_idle

    @property
    def num_in_use(self) -> int:
        return self._num_in_use

    def usage(self) -> float:
        return self._num_in_use / self.num_pages

    # -- page life ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(
                f"space {self.name!r} is out of pages: need {n}, {len(self._free)} free of {self.num_pages}"
            )
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        self._num_in_use += n
        return pages

    def incref(self, page: int) -> None:
        rc = self.refcount[page]
        if rc == 0:
            if not self.in_index[page]:
                raise AssertionError(f"space {self.name!r}: incref of free page {page}")
            self._num_cached_idle -= 1
            self._num_in_use += 1
        self.refcount[page] = rc + 1

    def decref(self, page: int) -> None:
        rc = self.refcount[page]
        if rc <= 0:
            raise AssertionError(f"space {self.name!r}: decref of page {page} with refcount {rc}")
        self.refcount[page] = rc - 1
        if rc == 1:
            self._num_in_use -= 1
            if self.in_index[page]:
                self._num_cached_idle += 1
            else:
                self._free.append(page)

    def add_to_index(self, page: int) -> None:
        """The prefix index now references this (in use) page."""
        if self.in_index[page] or self.refcount[page] == 0:
            raise AssertionError(f"space {self.name!r}: page {page} cannot join the index")
        self.in_index[page] = True

    def remove_from_index(self, page: int) -> None:
        """The prefix index drops this page; if nobody holds it, it becomes free."""
        if not self.in_index[page]:
            raise AssertionError(f"space {self.name!r}: page {page} is not in the index")
        self.in_index[page] = False
        if self.refcount[page] == 0:
            self._num_cached_idle -= 1
            self._free.append(page)

    # -- checks ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"space {self.name!r}: a page is on the free list twice"
        assert NULL_PAGE not in free and self.refcount[NULL_PAGE] == 0 and not self.in_index[NULL_PAGE], (
            f"space {self.name!r}: the reserved null page was handed out"
        )
        in_use = sum(1 for rc in self.refcount if rc > 0)
        cached = sum(1 for p in range(self.num_physical_pages) if self.refcount[p] == 0 and self.in_index[p])
        assert min(self.refcount) >= 0, f"space {self.name!r}: negative refcount"
        for p in free:
            assert self.refcount[p] == 0 and not self.in_index[p], (
                f"space {self.name!r}: free page {p} is still referenced"
            )
        assert in_use == self._num_in_use and cached == self._num_cached_idle, (
            f"space {self.name!r}: ledger drift (in_use {in_use} vs {self._num_in_use}, "
            f"cached {cached} vs {self._num_cached_idle})"
        )
        assert len(free) + cached + in_use == self.num_pages, (
            f"space {self.name!r}: free {len(free)} + cached {cached} + in use {in_use} != capacity {self.num_pages}"
        )
