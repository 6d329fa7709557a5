"""KVCacheManager: allocates every block space of a request together (DESIGN.md §3, §5).

The engine asks it three things: how much of a prompt is already cached (`match_prefix`),
to make room for the next tokens of a request (`allocate`), and to release a request
(`free`). Per request it keeps one page table per space; page i of every space holds the
data of tokens [i*P, (i+1)*P). Pages of windowed spaces that fell out of the request's
window are released early and their table entries set to NULL_PAGE.

With prefix caching on, every request holds one lock receipt on the shadow index
(block_manager/shadow_index.py): a full lock on the path to its last recorded page (its
*anchor*) and an SWA lock on exactly the recorded pages it still holds in windowed spaces.
`_relock` moves that receipt whenever the anchor or the held window changes, so the SWA part
is released as soon as the request has computed past it. Cross-invariant (check_invariants):
an indexed page some request holds is protected by a lock in the index.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from block_manager.block_space import BlockSpace
from block_manager.eviction_policy import EvictionPolicy
from block_manager.shadow_index import NULL_PAGE, LockReceipt, ShadowIndex, ShadowNode
from block_manager.space_spec import SpaceSpec

logger = logging.getLogger(__name__)

__all__ = ["NULL_PAGE", "KVCacheManager", "PrefixHit"]


@dataclass
class PrefixHit:
    """A prefix hit: nodes of the shadow index, tokens they cover, and per space how many of
    those tokens the space serves from cache (windowed spaces only serve their last window;
    the tokens before it are never read again)."""

    nodes: list[ShadowNode]
    num_tokens: int
    per_space_tokens: dict[str, int] = field(default_factory=dict)
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0


@dataclass
class RequestPages:
    tables: dict[str, list[int]]
    namespace: Hashable = None
    priority: int = 0  # eviction priority of the pages it inserts (the "priority" eviction policy)
    num_inserted_pages: int = 0  # whole pages already recorded in the prefix index
    num_released_pages: dict[str, int] = field(default_factory=dict)  # windowed spaces
    anchor: ShadowNode | None = None  # node of the last recorded page
    receipt: LockReceipt | None = None


class KVCacheManager:
    def __init__(
        self,
        specs: Sequence[SpaceSpec],
        num_pages: dict[str, int],
        page_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        windowed_match: bool = True,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"block_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.specs = {s.name: s for s in specs}
        self.spaces = {s.name: BlockSpace(s, num_pages[s.name], page_size) for s in specs}
        self.enable_prefix_caching = enable_prefix_caching
        self.index = (
            ShadowIndex(self.spaces, page_size, EvictionPolicy(eviction_policy), windowed_match)
            if enable_prefix_caching
            else None
        )
        self._requests: dict[str, RequestPages] = {}
        # Counters for metrics (tokens).
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_hits_per_space = {name: 0 for name in self.spaces}

    # -- prefix cache --------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None, touch: bool = True) -> PrefixHit:
        """Longest cached SWA-valid page-aligned prefix, never covering the last token (its logits are needed)."""
        if self.index is None:
            return PrefixHit([], 0, {name: 0 for name in self.spaces})
        max_pages = (len(token_ids) - 1) // self.page_size
        m = self.index.match(token_ids, namespace, max_pages=max_pages, touch=touch)
        n = len(m.nodes)
        per_space = {}
        for name in self.spaces:
            first = self.index.first_window_page(name, n) if name in self.index.windows else 0
            per_space[name] = (n - first) * self.page_size
        return PrefixHit(m.nodes, m.num_tokens, per_space, m.device_tokens, m.host_tokens, m.storage_tokens)

    def record_query(self, num_prompt_tokens: int, hit: PrefixHit | None) -> None:
        self.prefix_queries += num_prompt_tokens
        if hit is not None:
            self.prefix_hits += hit.num_tokens
            for name, n in hit.per_space_tokens.items():
                self.prefix_hits_per_space[name] += n

    # -- allocation ----------------------------------------------------------------------------
    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit: PrefixHit | None = None,
        namespace: Hashable = None,
        priority: int = 0,
    ) -> bool:
        """Make the request's tables cover its first num_tokens tokens in every space.

        The first call for a request may pass a prefix hit, whose pages it then shares (in a
        windowed space only the pages of its window; older entries are NULL_PAGE) and locks
        before anything is evicted to make room. Returns False (and changes nothing) when the
        pages cannot be found even after evicting cached pages: the scheduler then preempts
        someone or waits.
        """
        req = self._requests.get(request_id)
        new_request = req is None
        if new_request:
            req = RequestPages(tables={name: [] for name in self.spaces}, namespace=namespace, priority=priority)
            if hit is not None and hit.nodes:
                n = len(hit.nodes)
                for name, table in req.tables.items():
                    windowed = self.specs[name].windowed
                    first = self.index.first_window_page(name, n) if windowed else 0
                    for i, node in enumerate(hit.nodes):
                        page = node.shadows[name]
                        if i < first:
                            table.append(NULL_PAGE)
                            continue
                        if page is None:
                            raise AssertionError(f"prefix hit reads a tombstoned {name!r} page {i}")
                        self.spaces[name].incref(page)
                        table.append(page)
                    if windowed:
                        req.num_released_pages[name] = first
                req.num_inserted_pages = n
                req.anchor = hit.nodes[-1]
                self._relock(req)
        needs = {
            name: self.specs[name].pages_for(num_tokens, self.page_size) - len(table)
            for name, table in req.tables.items()
        }
        if not self._make_room(needs):
            if new_request:
                self._release(req)
            return False
        for name, n in needs.items():
            if n > 0:
                req.tables[name].extend(self.spaces[name].allocate(n))
        self._requests[request_id] = req
        return True

    def _make_room(self, needs: dict[str, int]) -> bool:
        for name, n in needs.items():
            space = self.spaces[name]
            short = n - space.num_free
            if short > 0 and self.index is not None:
                self.index.evict(name, short)
        return all(n <= self.spaces[name].num_free for name, n in needs.items())

    def pages_needed(self, num_tokens: int, max_chunk_tokens: int | None = None) -> dict[str, int]:
        """Most pages one request of num_tokens holds at once in each space, when it is
        computed in chunks of at most max_chunk_tokens (default: one page). A windowed space
        holds its window plus the chunk being computed (released after each step)."""
        P = self.page_size
        chunk = max_chunk_tokens or P
        out = {}
        for name, space in self.spaces.items():
            need = space.spec.pages_for(num_tokens, P)
            if space.spec.windowed:
                need = min(need, -(-(space.spec.window - 1 + chunk) // P) + 1)
            out[name] = need
        return out

    def spaces_short_for(self, num_tokens: int, max_chunk_tokens: int | None = None) -> list[str]:
        """Spaces too small for one request of num_tokens, as 'name (need N pages, have M)'."""
        return [
            f"{name} (needs {n} pages, has {self.spaces[name].num_pages})"
            for name, n in self.pages_needed(num_tokens, max_chunk_tokens).items()
            if n > self.spaces[name].num_pages
        ]

    def cache_computed_pages(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record the request's whole computed pages in the prefix index (so others can share them).

        Pages the tree already holds replace the request's own copies (freed here); pages the
        request already released go in as tombstones; its live pages heal tombstones."""
        if self.index is None:
            return
        req = self._requests[request_id]
        full = num_computed_tokens // self.page_size
        if full <= req.num_inserted_pages:
            return
        res = self.index.insert(
            token_ids[: full * self.page_size],
            {name: table[:full] for name, table in req.tables.items()},
            req.namespace,
            start=req.anchor,
            priority=req.priority,
        )
        for name, dups in res.duplicates.items():
            table, space = req.tables[name], self.spaces[name]
            for i, tree_page in dups:
                space.incref(tree_page)  # take the tree's copy first, then drop ours
                space.decref(table[i])
                table[i] = tree_page
        req.num_inserted_pages = full
        req.anchor = res.last_node
        self._relock(req)

    def mark_boundary(self, request_id: str) -> None:
        """The request's recorded prefix ends a prompt or a turn: a likely future match point,
        whose windowed tail eviction keeps as long as it can."""
        req = self._requests.get(request_id)
        if self.index is not None and req is not None and req.anchor is not None:
            self.index.mark_boundary(req.anchor)

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free windowed-space pages no future token of this request can read."""
        req = self._requests[request_id]
        for name, table in req.tables.items():
            window = self.specs[name].window
            if window is None:
                continue
            # The next query is at position num_computed_tokens; it reads [pos - window + 1, pos].
            first_needed = max(0, num_computed_tokens - window + 1)
            upto = min(first_needed // self.page_size, len(table))
            start = req.num_released_pages.get(name, 0)
            for i in range(start, upto):
                if table[i] != NULL_PAGE:
                    self.spaces[name].decref(table[i])
                table[i] = NULL_PAGE
            req.num_released_pages[name] = max(start, upto)
        self._relock(req)

    def _relock(self, req: RequestPages) -> None:
        """Point the request's lock at its anchor, SWA-locking exactly the recorded windowed
        pages it still holds; released early (SWA part only) once it holds none of them."""
        if self.index is None or req.anchor is None:
            return
        end = req.anchor.depth
        held_from = min((req.num_released_pages.get(n, 0) for n in self.index.windows), default=end)
        swa_tokens = max(0, end - held_from) * self.page_size
        old = req.receipt
        if old is not None and old.anchor is req.anchor:
            if swa_tokens == (old.swa_tokens if old.swa_held else 0):
                return
            if swa_tokens == 0:
                self.index.release_swa(old)
                return
        req.receipt = self.index.lock(req.anchor, swa_tokens)
        if old is not None:
            self.index.unlock(old)

    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._release(req)

    def _release(self, req: RequestPages) -> None:
        if req.receipt is not None:
            self.index.unlock(req.receipt)
            req.receipt = None
        for name, table in req.tables.items():
            space = self.spaces[name]
            # Release in reverse so the tail of a sequence is evicted before its head.
            for page in reversed(table):
                if page != NULL_PAGE:
                    space.decref(page)
            table.clear()

    # -- introspection ---------------------------------------------------------------------
    def page_table(self, request_id: str, space: str) -> list[int]:
        return self._requests[request_id].tables[space]

    def num_requests(self) -> int:
        return len(self._requests)

    def usage(self) -> dict[str, float]:
        return {name: s.usage() for name, s in self.spaces.items()}

    def reset_prefix_cache(self) -> int:
        return self.index.clear() if self.index is not None else 0

    def check_invariants(self) -> None:
        for space in self.spaces.values():
            space.check_invariants()
        if self.index is not None:
            self.index.check_invariants()
        held: dict[str, dict[int, int]] = {name: {} for name in self.spaces}
        for req in self._requests.values():
            for name, table in req.tables.items():
                for page in table:
                    if page != NULL_PAGE:
                        held[name][page] = held[name].get(page, 0) + 1
            if self.index is not None:
                self._check_request_against_index(req)
        for name, space in self.spaces.items():
            for page in range(space.num_pages):
                assert space.refcount[page] == held[name].get(page, 0), (
                    f"space {name!r}: page {page} refcount {space.refcount[page]} but "
                    f"{held[name].get(page, 0)} request tables hold it"
                )
        if self.index is not None:
            for node in self.index.nodes():
                for name, page in node.shadows.items():
                    if page is not None and self.spaces[name].refcount[page] > 0:
                        locked = node.swa_lock_ref if name in self.index.windows else node.full_lock_ref
                        assert locked, f"space {name!r}: page {page} is held by a request but unlocked in the index"

    def _check_request_against_index(self, req: RequestPages) -> None:
        """The request's recorded pages are the tree's pages, and its receipt covers them."""
        if req.anchor is None:
            assert req.num_inserted_pages == 0 and req.receipt is None
            return
        assert req.anchor.depth == req.num_inserted_pages, "anchor depth differs from the recorded page count"
        assert req.receipt is not None and req.receipt.anchor is req.anchor, "request lock is not on its anchor"
        for node in req.anchor.path():
            i = node.depth - 1
            for name, table in req.tables.items():
                if table[i] != NULL_PAGE:
                    assert node.shadows[name] == table[i], (
                        f"space {name!r}: request holds page {table[i]} for recorded page {i}, tree has {node.shadows[name]}"
                    )

    def assert_idle(self) -> None:
        """No request holds a page: every page is free or cached, every refcount is zero."""
        self.check_invariants()
        assert not self._requests, f"requests still hold pages: {list(self._requests)}"
        for space in self.spaces.values():
            assert space.num_in_use == 0, f"space {space.name!r}: {space.num_in_use} pages still in use"
