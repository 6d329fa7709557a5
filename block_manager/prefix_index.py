"""PrefixIndex: a radix tree over whole pages of token ids, shared by every block space.

Each node covers one logical page (page_size token ids) and keeps, per block space, the
physical page that holds that page's data in that space: its *shadow* in that space
(DESIGN.md §4). Whole-history spaces keep their shadow as long as the node lives; the
shadow prefix index issue generalises this to tombstoned windowed shadows. Separate
namespaces (LoRA adapter, cache salt) get separate roots so they never share pages.

Pages referenced here are "cached"; they are evicted leaf-first in LRU order once no
request holds them.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from block_manager.block_space import BlockSpace


@dataclass(eq=False)
class PageNode:
    key: tuple[int, ...]
    parent: "PageNode | None"
    depth: int  # number of pages from the root to this node, inclusive
    shadows: dict[str, int] = field(default_factory=dict)  # space name -> physical page
    children: dict[tuple[int, ...], "PageNode"] = field(default_factory=dict)
    last_access: int = 0


class PrefixIndex:
    def __init__(self, spaces: dict[str, BlockSpace], page_size: int) -> None:
        self.spaces = spaces
        self.page_size = page_size
        self._roots: dict[Hashable, PageNode] = {}
        self._clock = itertools.count(1)
        self._leaves: set[PageNode] = set()
        self.num_nodes = 0

    # -- lookup -----------------------------------------------------------------------------
    def _root(self, namespace: Hashable, create: bool) -> PageNode | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = PageNode(key=(), parent=None, depth=0)
        return root

    def _page_keys(self, token_ids: Sequence[int], num_pages: int):
        P = self.page_size
        for i in range(num_pages):
            yield tuple(token_ids[i * P : (i + 1) * P])

    def match(self, token_ids: Sequence[int], namespace: Hashable = None, max_pages: int | None = None) -> list[PageNode]:
        """Longest chain of cached whole pages that prefixes token_ids (at most max_pages)."""
        node = self._root(namespace, create=False)
        if node is None:
            return []
        n = len(token_ids) // self.page_size
        if max_pages is not None:
            n = min(n, max_pages)
        path: list[PageNode] = []
        now = next(self._clock)
        for key in self._page_keys(token_ids, n):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            path.append(node)
        return path

    # -- insert -------------------------------------------------------------------------------
    def insert(
        self,
        token_ids: Sequence[int],
        pages: dict[str, list[int]],
        namespace: Hashable = None,
    ) -> None:
        """Record the request's whole pages under token_ids.

        Nodes that already exist keep their own pages (the request's duplicates are freed when
        the request releases them); new nodes reference the request's pages.
        """
        num_pages = min(len(token_ids) // self.page_size, min(len(t) for t in pages.values()))
        node = self._root(namespace, create=True)
        now = next(self._clock)
        for i, key in enumerate(self._page_keys(token_ids, num_pages)):
            child = node.children.get(key)
            if child is None:
                child = PageNode(key=key, parent=node, depth=node.depth + 1)
                for name, table in pages.items():
                    page = table[i]
                    self.spaces[name].add_to_index(page)
                    child.shadows[name] = page
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.num_nodes += 1
            child.last_access = now
            node = child

    # -- eviction -------------------------------------------------------------------------------
    def _evictable(self, node: PageNode) -> bool:
        return not node.children and all(
            self.spaces[name].refcount[page] == 0 for name, page in node.shadows.items()
        )

    def evict(self, space: str, num_pages: int) -> int:
        """Evict LRU leaves until `space` gained num_pages free pages (or nothing is evictable).

        Returns the number of pages freed in `space`.
        """
        heap = [(n.last_access, id(n), n) for n in self._leaves if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            if not self._evictable(node):
                continue
            freed += 1 if space in node.shadows else 0
            parent = self._remove(node)
            if parent is not None and parent.parent is not None and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove(self, node: PageNode) -> PageNode | None:
        for name, page in node.shadows.items():
            self.spaces[name].remove_from_index(page)
        node.shadows.clear()
        parent = node.parent
        self._leaves.discard(node)
        self.num_nodes -= 1
        if parent is not None:
            del parent.children[node.key]
            if not parent.children and parent.parent is not None:
                self._leaves.add(parent)
        return parent

    def clear(self) -> int:
        """Drop every node that no request holds (reset_prefix_cache). Returns nodes dropped."""
        dropped = 0
        while True:
            victims = [n for n in self._leaves if self._evictable(n)]
            if not victims:
                return dropped
            for n in victims:
                self._remove(n)
                dropped += 1

    # -- checks -------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        count = 0
        referenced: dict[str, set[int]] = {name: set() for name in self.spaces}
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key and len(key) == self.page_size
                assert child.depth == node.depth + 1
                assert set(child.shadows) == set(self.spaces), "a node lacks a shadow in some space"
                for name, page in child.shadows.items():
                    assert page not in referenced[name], f"space {name!r}: page {page} in the index twice"
                    referenced[name].add(page)
                    assert self.spaces[name].in_index[page]
                assert (child in self._leaves) == (not child.children), "leaf set out of date"
                count += 1
                stack.append(child)
        assert count == self.num_nodes, f"node count drift: {count} vs {self.num_nodes}"
        for name, space in self.spaces.items():
            in_index = {p for p in range(space.num_pages) if space.in_index[p]}
            assert in_index == referenced[name], f"space {name!r}: index ledger differs from the tree"
