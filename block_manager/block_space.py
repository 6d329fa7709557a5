"""BlockSpace: a pool of physical pages for one SpaceSpec, with refcounts.

A page is in exactly one of three states:
  free    -- on the free list, refcount 0, not referenced by the prefix index
  cached  -- referenced by the prefix index, refcount 0 (evictable)
  in use  -- refcount > 0 (held by running requests; may also be in the index)
so free + cached + in_use == capacity at all times (check_invariants()).

Page ids are 1..num_pages: page 0 (NULL_PAGE) is reserved in every space, never allocated and
never written, so the physical tensors hold num_physical_pages = num_pages + 1 pages.

Where pages come from matters for speed, not correctness: attention reads a run of consecutive
pages in place (a view of the cache) but must gather scattered ones (a copy of every key, every
layer, every step). So a request that grows by a chunk continues its last page's run when the
pages after it are free (`after=`), and single-page growth -- a decode, whose reads are gathered
anyway -- takes the most recently freed page (`tail=True`), leaving the front of the free list
to start long runs. Without this, a long prompt prefilled a few tokens per step beside a stream
got a stream page every few pages and was gathered whole on every step.
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
        # The free list, oldest first. A page taken out of order (continuing a run) stays in it
        # as a stale entry until popped or compacted: _is_free is the truth, _num_free the count.
        self._free: deque[int] = deque(range(NULL_PAGE + 1, self.num_physical_pages))
        self._is_free = bytearray(self.num_physical_pages)
        self._is_free[NULL_PAGE + 1:] = b"\x01" * num_pages
        self._num_free = num_pages
        self._num_in_use = 0
        self._num_cached_idle = 0

    # -- counts -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_free(self) -> int:
        return self._num_free

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
    def allocate(self, n: int, after: int | None = None, tail: bool = False) -> list[int]:
        """n free pages, refcount 1. after: a page the caller holds; the pages right after it are
        taken first while they are free (its run goes on). The rest come from the front of the
        free list (the oldest freed), or from its back with tail=True (the newest), in ascending
        order."""
        if n > self._num_free:
            raise OutOfPagesError(
                f"space {self.name!r} is out of pages: need {n}, {self._num_free} free of {self.num_pages}"
            )
        is_free, pages = self._is_free, []
        if after is not None and after > NULL_PAGE:
            p = after + 1
            while len(pages) < n and p < self.num_physical_pages and is_free[p]:
                is_free[p] = 0  # its entry in _free goes stale
                pages.append(p)
                p += 1
        pop = self._free.pop if tail else self._free.popleft
        listed = []
        while len(pages) + len(listed) < n:
            p = pop()
            if is_free[p]:
                is_free[p] = 0
                listed.append(p)
        # Ascending: the free list holds pages in the order they were freed or evicted (an evicted
        # prefix comes back deepest page first, i.e. descending), and a request's pages in address
        # order let the kernels that read them in place stream forward through memory (a 128k
        # prefill after a finished 64k one otherwise read half its indexer keys page by page backwards).
        listed.sort()
        pages += listed
        for p in pages:
            self.refcount[p] = 1
        self._num_free -= n
        self._num_in_use += n
        return pages

    def _release(self, page: int) -> None:
        """page becomes free (the newest entry of the free list)."""
        self._is_free[page] = 1
        self._num_free += 1
        self._free.append(page)
        if len(self._free) > 2 * self._num_free + 1024:
            # Stale entries (pages taken to continue a run) outnumber the free pages: keep each
            # free page once, at its oldest position. Amortised O(1) per page freed.
            self._free = deque(dict.fromkeys(p for p in self._free if self._is_free[p]))

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
                self._release(page)

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
            self._release(page)

    # -- checks ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free = {p for p in range(self.num_physical_pages) if self._is_free[p]}
        assert len(free) == self._num_free, f"space {self.name!r}: free count {self._num_free} != {len(free)}"
        assert free <= set(self._free), f"space {self.name!r}: a free page is missing from the free list"
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
