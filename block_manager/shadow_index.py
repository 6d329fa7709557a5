"""ShadowIndex: the shadow prefix index (docs/architecture.md, "The shadow index").

One radix tree over token ids, keyed in whole pages, one root per namespace. Every block
space keeps its own *shadow* of each node: the physical page holding that node's data in
that space. Whole-history spaces (full, c4, c128, indexer) keep their shadow as long as the
node lives. Windowed spaces (swa, state) may hold a *tombstone* (None) instead: the data
slid out of every window and was dropped, while the node and its whole-history shadows stay
and keep serving prefix hits.

Granularity: one node per page. Every page boundary is already a node boundary, so `match`
and `insert` never split a node, shadows never need to be cut, and a lock receipt's boundary
node stays the same object for the receipt's whole life. The cost is one dict lookup per
page on match/insert; the benefit is that the split bug class (receipts/boundaries lost in a
split) cannot exist.

Ledgers, per space, over live shadows: a shadow is *protected* when the lock that guards it is
held (full for whole-history spaces, swa for windowed ones), else *evictable*;
evictable + protected == pages of that space in the index, after every operation.

The class is the tree (this module: match, insert, deletion, the ledgers) plus three mixins
over the same nodes (shadow_node.py): lock receipts (index_locks.py), eviction queues and
`evict` (index_eviction.py), and the host tier, HiCache L2 (index_host_tier.py). They are
mixins rather than helper objects because every part reads and writes the same node state on
the per-step paths, where a delegating call per node or per request step would cost time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from hybridkv.block_manager.block_space import BlockSpace
from hybridkv.block_manager.eviction_policy import EvictionPolicy
from hybridkv.block_manager.host_tier import HostTier
from hybridkv.block_manager.index_eviction import IndexEviction
from hybridkv.block_manager.index_host_tier import IndexHostTier
from hybridkv.block_manager.index_locks import IndexLocks, LockReceipt
from hybridkv.block_manager.index_events import IndexEvents
from hybridkv.block_manager.kv_events import EVENT_CHAIN_SEED
from hybridkv.block_manager.page_keys import next_chain, root_chain
from hybridkv.block_manager.shadow_node import TOMBSTONE, ShadowNode
from hybridkv.block_manager.space_spec import NULL_PAGE

__all__ = ["NULL_PAGE", "TOMBSTONE", "ShadowIndex", "ShadowNode", "LockReceipt", "MatchResult", "InsertResult"]


@dataclass
class MatchResult:
    """A prefix hit. num_tokens = device_tokens + host_tokens + storage_tokens (the tiers' share:
    storage reads land as host pages, so the index reports them as host tokens); full_tokens is
    the longest whole-history match ignoring windowed shadows (what a bounded SWA recompute could
    reach)."""

    nodes: list[ShadowNode]
    num_tokens: int
    device_tokens: int
    host_tokens: int = 0
    storage_tokens: int = 0
    full_tokens: int = 0
    # space -> indices into nodes whose page in that space must be loaded back from the host
    loads: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class InsertResult:
    """last_node: the node of the last inserted page (the request's new lock anchor).
    duplicates: space -> [(page index, the tree's page)] where the request computed a page the
    tree already holds; the caller swaps its table entry to the tree's page and drops its own.
    adopted: space -> page indices whose tombstone was healed with the request's page.
    Both name only the spaces that have some (a decode's page crossing has none)."""

    last_node: ShadowNode
    num_new_nodes: int
    duplicates: dict[str, list[tuple[int, int]]]
    adopted: dict[str, list[int]]


class ShadowIndex(IndexLocks, IndexEviction, IndexHostTier, IndexEvents):
    def __init__(
        self,
        spaces: dict[str, BlockSpace],
        page_size: int,
        policy: EvictionPolicy | None = None,
        windowed_match: bool = True,
        host_tier: HostTier | None = None,
        chain_seed: bytes | None = None,
        kv_events: bool = False,
    ) -> None:
        """windowed_match=False is the baseline that drops the whole prefix as soon as any
        windowed page on it is gone (kept for benchmarks and tests to compare against).
        host_tier: keep shadows on the host too (index_host_tier.py). chain_seed: give every
        node the content key of its prefix (a storage tier names pages by it). kv_events: record
        KV cache events (index_events.py; their hashes come from the content keys)."""
        self.chain_seed = chain_seed if chain_seed is not None or not kv_events else EVENT_CHAIN_SEED
        self.spaces = spaces
        self.page_size = page_size
        self.policy = policy or EvictionPolicy()
        self.windowed_match = windowed_match
        self.windows: dict[str, int] = {n: s.spec.window for n, s in spaces.items() if s.spec.windowed}
        self.whole = [n for n, s in spaces.items() if not s.spec.windowed]
        self._specs = {n: s.spec for n, s in spaces.items()}
        # Windowed spaces no hit reads (every page end closes their window, like HCA's state):
        # their pages go in as tombstones, so the index never holds, pins or offloads them.
        self.unread = {n for n, s in spaces.items() if s.spec.windowed and s.spec.pages_read_at_page_end(page_size) == 0}
        self._roots: dict[Hashable, ShadowNode] = {}
        self._nodes: set[ShadowNode] = set()
        self._clock = itertools.count(1)
        self._seq = itertools.count(1)
        self.evictable = {n: 0 for n in spaces}
        self.protected = {n: 0 for n in spaces}
        self._init_locks()
        self._init_queues()
        self._init_events(kv_events)
        self._init_host_tier(host_tier)  # last: the attributes only a host tier adds follow the common ones

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def nodes(self) -> Iterator[ShadowNode]:
        return iter(self._nodes)

    # -- helpers --------------------------------------------------------------------------------
    def _root(self, namespace: Hashable, create: bool) -> ShadowNode | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = ShadowNode(key=(), parent=None, depth=0, namespace=namespace)
            if self.chain_seed is not None:
                root.chain = root_chain(self.chain_seed, namespace)
        return root

    def _key(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        P = self.page_size
        return tuple(token_ids[i * P : (i + 1) * P])

    def first_window_page(self, space: str, end_page: int) -> int:
        """First page a request resuming at token end_page*P still reads in a windowed space
        (the window rule lives in SpaceSpec.first_kept_page)."""
        return self._specs[space].first_kept_page(end_page * self.page_size, self.page_size)

    def _guard_locked(self, node: ShadowNode, space: str) -> bool:
        return (node.swa_lock_ref if space in self.windows else node.full_lock_ref) > 0

    def _ledger_add(self, node: ShadowNode, space: str, sign: int) -> None:
        if self._guard_locked(node, space):
            self.protected[space] += sign
        else:
            self.evictable[space] += sign

    def _has_data(self, node: ShadowNode) -> bool:
        return any(p is not None for p in node.shadows.values()) or any(p is not None for p in node.host.values())

    def _present(self, node: ShadowNode, space: str) -> bool:
        """The node's data in this space exists on some tier (device, or host)."""
        return node.shadows[space] is not None or node.host.get(space) is not None

    def _on_device(self, node: ShadowNode) -> bool:
        return any(p is not None for p in node.shadows.values())

    def _is_dead_leaf(self, node: ShadowNode) -> bool:
        """An unlocked leaf that can serve no hit: no data, or a windowed shadow tombstoned on
        every tier where a match ending at the node needs it (its own page is in the window at
        its end -- not so for a block-aligned window that closes there, like HCA's state at a
        page boundary). The index drops these at once, so eviction never has to skip them."""
        if node.children or node.full_lock_ref or node.is_root:
            return False
        d = node.depth
        return not self._has_data(node) or any(
            not self._present(node, s) and self.first_window_page(s, d) < d for s in self.windows)

    def touch(self, nodes: Sequence[ShadowNode]) -> None:
        """Count a prefix hit once it is admitted (match(touch=False) before that). Under
        write_through_selective a node hit often enough is written to the host now (the caller
        holds a lock on nodes, so the host room this makes never deletes them)."""
        if nodes:
            self._touch(nodes, hit=True)
            if self.tier is not None:
                self._write_hot(nodes)

    # -- match ------------------------------------------------------------------------------------
    def match(
        self, token_ids: Sequence[int], namespace: Hashable = None, max_pages: int | None = None, touch: bool = True,
        device_only: bool = False,
    ) -> MatchResult:
        """Longest page-aligned prefix (at most max_pages) that is SWA-valid: every node on it
        exists (so its whole-history shadows are present) and, for each windowed space, the pages
        from the space's window start before the boundary up to the boundary are live. A prefix
        whose window reaches the root needs no more than what exists. Costs the prompt's pages.

        With a host tier a shadow is live on either tier; `loads` lists, per space, the hit
        nodes whose page the caller must load back (only the pages the request will read:
        every node in whole-history spaces, the last window in windowed ones). device_only
        counts device pages alone (the hit a load-back below its threshold falls back to)."""
        P = self.page_size
        node = self._root(namespace, create=False)
        n = len(token_ids) // P if max_pages is None else min(max_pages, len(token_ids) // P)
        path: list[ShadowNode] = []
        if node is not None:
            for i in range(n):
                node = node.children.get(self._key(token_ids, i))
                if node is None:
                    break
                path.append(node)
        tiered = self.tier is not None
        if tiered and device_only:  # a node without its whole-history device pages ends the path
            for d, nd in enumerate(path):
                if any(nd.shadows[s] is None for s in self.whole):
                    del path[d:]
                    break
        live = self._present if tiered and not device_only else (lambda nd, s: nd.shadows[s] is not None)
        best = 0
        if not self.windows:
            best = len(path)
        elif self.windowed_match:
            # run[s] = consecutive live pages of space s ending at depth d.
            run = {s: 0 for s in self.windows}
            for d, nd in enumerate(path, start=1):
                ok = True
                for s in self.windows:
                    run[s] = run[s] + 1 if live(nd, s) else 0
                    if run[s] < d - self.first_window_page(s, d):
                        ok = False
                if ok:
                    best = d
        else:  # baseline: a tombstone anywhere on the path ends the prefix before it
            for d, nd in enumerate(path, start=1):
                if any(not live(nd, s) for s in self.windows):
                    break
                best = d
        hit = path[:best]
        loads, host_pages = self._loads(hit) if tiered and hit else ({}, 0)
        if touch and hit:
            self._touch(hit, hit=True)
        return MatchResult(hit, best * P, (best - host_pages) * P, host_tokens=host_pages * P,
                           full_tokens=len(path) * P, loads=loads)

    # -- insert -----------------------------------------------------------------------------------
    def insert(
        self,
        token_ids: Sequence[int],
        pages: dict[str, Sequence[int]],
        namespace: Hashable = None,
        start: ShadowNode | None = None,
        priority: int = 0,
        lock_follows: bool = False,
    ) -> InsertResult:
        """Record a request's whole pages under token_ids (pages[s][i] holds page i in space s;
        NULL_PAGE = the request already released it, below its window).

        `start` resumes below a node the caller holds locked (its previous insert), so the cost
        is the new pages only. Existing nodes keep their pages (the request's equal pages are
        reported as duplicates for the caller to swap out); a tombstone the request still has
        live is healed by adopting the request's page (the page joins the index; the request
        keeps its reference, so nothing is freed twice); new nodes take the request's pages,
        with a tombstone wherever the request already released the windowed page (never a live
        shadow for a page the request no longer owns) and in the spaces no hit reads (`unread`).

        lock_follows: the caller moves its lock down to the new last node right after (the KV
        manager does, every time): new nodes then skip their eviction-queue placement here,
        which the lock's own placement would undo at once (a decode step's page crossing would
        otherwise add each new node to the unlocked queue and take it out again).
        """
        num_pages = min(len(token_ids) // self.page_size, *map(len, pages.values()))
        node = start if start is not None else self._root(namespace, create=True)
        duplicates: dict[str, list[tuple[int, int]]] = {}
        adopted: dict[str, list[int]] = {}
        windows, tier = self.windows, self.tier
        walked: list[ShadowNode] = []  # nodes to touch (placed in their queues at the back)
        fresh: list[ShadowNode] = []  # new nodes the caller's lock places (lock_follows)
        new = 0
        for i in range(node.depth, num_pages):
            key = self._key(token_ids, i)
            child = node.children.get(key)
            if child is None:
                child = ShadowNode(key, node, node.depth + 1, priority=priority, seq=next(self._seq),
                                   tail_refs=dict.fromkeys(windows, 0))
                if self.chain_seed is not None:
                    child.chain = next_chain(node.chain, key)
                if tier is not None:
                    child.host = dict.fromkeys(self.spaces)
                for s, table in pages.items():
                    page = table[i]
                    if page == NULL_PAGE or s in self.unread:
                        if s not in self.windows:
                            raise AssertionError(f"whole-history space {s!r} has no page {i} to insert")
                        child.shadows[s] = TOMBSTONE
                        continue
                    self.spaces[s].add_to_index(page)
                    child.shadows[s] = page
                    self.evictable[s] += 1  # a fresh node carries no lock yet
                node.children[key] = child
                self._nodes.add(child)
                self._note(child)
                if windows:
                    self._update_tail_point(child)
                    self._update_tail_point(node)
                if tier is not None:
                    if not node.is_root:
                        self._sync(node)  # it has a child now: no longer a host-eviction leaf
                    if tier.write_policy == "write_through":
                        self.write_node(child)
                new += 1
                (fresh if lock_follows else walked).append(child)
            else:
                child.hit_count += 1
                child.priority = max(child.priority, priority)
                for s, table in pages.items():
                    page, mine = child.shadows[s], table[i]
                    if mine == NULL_PAGE or mine == page or s in self.unread:
                        continue
                    if page is None:  # heal: adopt the request's live page (its device copy was gone)
                        self.spaces[s].add_to_index(mine)
                        child.shadows[s] = mine
                        self._ledger_add(child, s, +1)
                        adopted.setdefault(s, []).append(i)
                        self._note(child)
                        if tier is not None:  # host writes later in this insert read its host queues
                            self._sync(child)
                    else:
                        duplicates.setdefault(s, []).append((i, page))
                walked.append(child)
            node = child
        if walked:
            self._touch(walked, hit=False)
        if fresh:
            now = next(self._clock)
            for nd in fresh:
                nd.last_access = now
        return InsertResult(node, new, duplicates, adopted)

    def mark_boundary(self, node: ShadowNode) -> None:
        if not node.is_root and not node.boundary:
            node.boundary = True
            self._update_tail_point(node)

    def node_at(self, token_ids: Sequence[int], namespace: Hashable, depth: int) -> ShadowNode | None:
        """The deepest node on token_ids' path at most `depth` pages deep (None: not even the
        first page is recorded). O(depth)."""
        node = self._roots.get(namespace)
        found = None
        for i in range(depth):
            node = node.children.get(self._key(token_ids, i)) if node is not None else None
            if node is None:
                break
            found = node
        return found

    def _delete(self, node: ShadowNode, keep: ShadowNode | None = None) -> None:
        """Delete an unlocked leaf, then every ancestor that became a dead leaf (up to, not
        including, `keep`: the node whose host copy this deletion makes room for -- deleting it
        here would pull it from under its caller), and the namespace root once it is empty."""
        while True:
            if node.children or node.full_lock_ref or node.is_root:
                raise AssertionError("only unlocked leaves can be deleted")
            self._update_tail_point(node, force_off=True)
            for s, page in node.shadows.items():
                if page is not None:
                    self.evictable[s] -= 1
                    self.spaces[s].remove_from_index(page)
                    node.shadows[s] = TOMBSTONE
            for s, h in node.host.items():
                if h is not None:
                    self._free_host(node, s)
            self._forget(node)
            self._note(node, deleted=True)
            parent = node.parent
            del parent.children[node.key]
            self._nodes.discard(node)
            if parent.is_root:
                if not parent.children:
                    del self._roots[parent.namespace]
                return
            self._update_tail_point(parent)
            if self.tier is not None:
                self._sync(parent)  # it may be a leaf now
            node = parent
            if node is keep or not self._is_dead_leaf(node):
                return

    # -- checks ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Full recount (tests only; O(tree x window)): the tree and the ledgers here, then the
        locks, the host tier and the eviction queues, each in its own module."""
        evictable = {n: 0 for n in self.spaces}
        protected = {n: 0 for n in self.spaces}
        referenced: dict[str, set[int]] = {n: set() for n in self.spaces}
        seen = 0
        for ns, root in self._roots.items():
            assert root.is_root and root.namespace == ns, "a namespace root is misfiled"
            assert root.children, f"namespace {ns!r}: an empty root was kept"
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                seen += 1
                assert child in self._nodes, "a node in the tree is missing from the node set"
                assert child.parent is node and child.key == key and len(key) == self.page_size
                assert child.depth == node.depth + 1
                assert set(child.shadows) == set(self.spaces), "a node lacks a shadow entry for some space"
                assert not self._is_dead_leaf(child), "an unlocked leaf that can serve no hit was kept"
                for s, page in child.shadows.items():
                    if page is None:
                        assert s in self.windows or child.host.get(s) is not None, (
                            f"whole-history space {s!r} has a tombstone (on every tier)")
                        continue
                    assert page != NULL_PAGE, f"space {s!r}: the null page is in the index"
                    assert page not in referenced[s], f"space {s!r}: page {page} in the index twice"
                    referenced[s].add(page)
                    assert self.spaces[s].in_index[page], f"space {s!r}: page {page} not marked in index"
                    if self._guard_locked(child, s):
                        protected[s] += 1
                    else:
                        evictable[s] += 1
                stack.append(child)
        assert seen == len(self._nodes), f"node count drift: {seen} vs {len(self._nodes)}"
        for s, space in self.spaces.items():
            assert (evictable[s], protected[s]) == (self.evictable[s], self.protected[s]), (
                f"space {s!r}: ledger drift: evictable {self.evictable[s]} vs {evictable[s]}, "
                f"protected {self.protected[s]} vs {protected[s]}"
            )
            in_index = {p for p in range(space.num_physical_pages) if space.in_index[p]}
            assert in_index == referenced[s], f"space {s!r}: index ledger differs from the tree"
        self._check_locks()
        self._check_host_tier()
        self._check_queues()
