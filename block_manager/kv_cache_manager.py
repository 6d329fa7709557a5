"""KVCacheManager: allocates every block space of a request together (DESIGN.md §3, §5).

The engine asks it three things: how much of a prompt is already cached (`match_prefix`),
to make room for the next tokens of a request (`allocate`), and to release a request
(`free`). Per request it keeps one page table per space; page i of every space holds the
data of tokens [i*P, (i+1)*P). Pages of windowed spaces that fell out of the request's
window are released early and their table entries set to NULL_PAGE.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from block_manager.block_space import BlockSpace
from block_manager.prefix_index import PageNode, PrefixIndex
from block_manager.space_spec import SpaceSpec

logger = logging.getLogger(__name__)

NULL_PAGE = -1  # table entry of a released (out-of-window) page


@dataclass
class PrefixHit:
    nodes: list[PageNode]
    num_tokens: int


@dataclass
class RequestPages:
    tables: dict[str, list[int]]
    namespace: Hashable = None
    num_inserted_pages: int = 0  # whole pages already recorded in the prefix index
    num_released_pages: dict[str, int] = field(default_factory=dict)  # windowed spaces


class KVCacheManager:
    def __init__(
        self,
        specs: Sequence[SpaceSpec],
        num_pages: dict[str, int],
        page_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"block_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.specs = {s.name: s for s in specs}
        self.spaces = {s.name: BlockSpace(s, num_pages[s.name], page_size) for s in specs}
        windowed = [s.name for s in specs if s.windowed]
        if enable_prefix_caching and windowed:
            # Caching a windowed space needs tombstoned shadows (shadow prefix index issue).
            logger.info(
                "prefix caching is off: this model has windowed block spaces %s, which the "
                "page prefix index cannot cache yet", windowed,
            )
            enable_prefix_caching = False
        self.enable_prefix_caching = enable_prefix_caching
        self.index = PrefixIndex(self.spaces, page_size) if enable_prefix_caching else None
        self._requests: dict[str, RequestPages] = {}
        # Counters for metrics (tokens).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- prefix cache --------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> PrefixHit:
        """Longest cached page-aligned prefix, never covering the last token (its logits are needed)."""
        if self.index is None:
            return PrefixHit([], 0)
        max_pages = (len(token_ids) - 1) // self.page_size
        nodes = self.index.match(token_ids, namespace, max_pages=max_pages)
        return PrefixHit(nodes, len(nodes) * self.page_size)

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation ----------------------------------------------------------------------------
    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit: PrefixHit | None = None,
        namespace: Hashable = None,
    ) -> bool:
        """Make the request's tables cover its first num_tokens tokens in every space.

        The first call for a request may pass a prefix hit, whose pages it then shares.
        Returns False (and changes nothing) when the pages cannot be found even after
        evicting cached pages: the scheduler then preempts someone or waits.
        """
        req = self._requests.get(request_id)
        new_request = req is None
        if new_request:
            req = RequestPages(tables={name: [] for name in self.spaces}, namespace=namespace)
            if hit is not None and hit.nodes:
                for node in hit.nodes:
                    for name, page in node.shadows.items():
                        self.spaces[name].incref(page)
                        req.tables[name].append(page)
                req.num_inserted_pages = len(hit.nodes)
        needs = {
            name: self.specs[name].pages_for(num_tokens, self.page_size) - len(table)
            for name, table in req.tables.items()
        }
        if not self._make_room(needs):
            if new_request:
                self._release_tables(req)
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
            if n > space.num_free:
                return False
        return True

    def can_fit(self, num_tokens: int, max_chunk_tokens: int | None = None) -> bool:
        """Whether a new request of num_tokens could ever fit into an empty cache."""
        return not self.spaces_short_for(num_tokens, max_chunk_tokens)

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
        """Record the request's whole computed pages in the prefix index (so others can share them)."""
        if self.index is None:
            return
        req = self._requests[request_id]
        full = num_computed_tokens // self.page_size
        if full <= req.num_inserted_pages:
            return
        self.index.insert(
            token_ids[: full * self.page_size],
            {name: table[:full] for name, table in req.tables.items()},
            req.namespace,
        )
        req.num_inserted_pages = full

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
                self.spaces[name].decref(table[i])
                table[i] = NULL_PAGE
            req.num_released_pages[name] = max(start, upto)

    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._release_tables(req)

    def _release_tables(self, req: RequestPages) -> None:
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
        for name, space in self.spaces.items():
            for page in range(space.num_pages):
                assert space.refcount[page] == held[name].get(page, 0), (
                    f"space {name!r}: page {page} refcount {space.refcount[page]} but "
                    f"{held[name].get(page, 0)} request tables hold it"
                )

    def assert_idle(self) -> None:
        """No request holds a page: every page is free or cached, every refcount is zero."""
        self.check_invariants()
        assert not self._requests, f"requests still hold pages: {list(self._requests)}"
        for space in self.spaces.values():
            assert space.num_in_use == 0, f"space {space.name!r}: {space.num_in_use} pages still in use"
