"""ShadowIndex: the shadow prefix index of DESIGN.md §4.

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

Locks (two counts per node, SGLang's receipt protocol):
  full_lock_ref  on every node of the path anchor -> root: the node cannot be deleted.
  swa_lock_ref   on the nodes covering the last `swa_tokens` before the anchor's end: their
                 windowed shadows cannot be tombstoned.
`lock` returns a LockReceipt; the boundary (topmost SWA-locked node) is stamped with the
receipt id, so `unlock`/`release_swa` undo exactly what was locked even if the caller's idea
of the window changed since. `move` slides a live receipt down to a deeper anchor touching
only the pages whose lock state changes (moving one page down is O(1) for the full lock and
O(window pages) for the SWA segment), never the whole anchor -> root path.
Invariant: full_lock_ref >= swa_lock_ref >= 0 on every node.

Eviction costs what it evicts (block_manager/eviction_policy.py's EvictionQueue):
  _unlocked          nodes with full_lock_ref == 0, in policy order; the first leaf in it is the
                     next whole-history victim (a node is touched after its descendants, so the
                     front of a class is a leaf)
  _idle[s]/_tail[s]  per windowed space, live unlocked shadows outside / inside the window of a
                     *tail point* (a leaf, a branch point or a marked prompt/turn end: a likely
                     future match end). Tail membership is kept incrementally: when a node
                     becomes or stops being a tail point only the window above it is updated.

Ledgers, per space, over live shadows: a shadow is *protected* when the lock that guards it is
held (full for whole-history spaces, swa for windowed ones), else *evictable*;
evictable + protected == pages of that space in the index, after every operation.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from hybridkv.block_manager.block_space import BlockSpace
from hybridkv.block_manager.eviction_policy import EvictionPolicy, EvictionQueue
from hybridkv.block_manager.host_tier import SELECTIVE_MIN_HITS, HostTier
from hybridkv.block_manager.page_keys import next_chain, root_chain, storage_key
from hybridkv.block_manager.space_spec import NULL_PAGE

TOMBSTONE = None  # shadow of a windowed space whose page was dropped

__all__ = ["NULL_PAGE", "TOMBSTONE", "ShadowIndex", "ShadowNode", "LockReceipt", "MatchResult", "InsertResult"]


@dataclass(eq=False, slots=True)  # slots: one node per cached page, created on every page crossing
class ShadowNode:
    key: tuple[int, ...]
    parent: "ShadowNode | None"
    depth: int  # pages from the root to this node, inclusive (the node ends at token depth*P)
    shadows: dict[str, int | None] = field(default_factory=dict)  # device page per space
    host: dict[str, int | None] = field(default_factory=dict)  # host page per space (host tier on)
    children: dict[tuple[int, ...], "ShadowNode"] = field(default_factory=dict)
    full_lock_ref: int = 0
    swa_lock_ref: int = 0
    swa_receipts: set[int] = field(default_factory=set)  # receipt ids whose SWA segment stops here
    last_access: int = 0
    hit_count: int = 0
    priority: int = 0
    boundary: bool = False  # a cached prompt or turn ended here: a likely future match point
    seq: int = 0  # creation order (deterministic tie-breaks; never id() or set order)
    tail_point: bool = False  # leaf, branch point or boundary (counted in the tail_refs above it)
    tail_refs: dict[str, int] = field(default_factory=dict)  # windowed space -> tail points whose window covers this node
    namespace: Hashable = None  # roots only
    chain: bytes = b""  # content key of the prefix ending here (page_keys.py; with a chain seed only)
    # Waiting requests whose storage read recorded the host-only chain ending here (HiCache L3):
    # host eviction leaves it alone until they are admitted, so a read is not lost to the reads
    # of the requests queued behind it. Device state is untouched (no device page is pinned).
    host_pins: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> Iterator["ShadowNode"]:
        """This node and its ancestors, root excluded, bottom-up."""
        node = self
        while node.parent is not None:
            yield node
            node = node.parent


@dataclass
class LockReceipt:
    """What a lock holds now; `unlock` must present it. swa_boundary is None when no node is SWA-locked."""

    id: int
    anchor: ShadowNode
    swa_tokens: int
    swa_boundary: ShadowNode | None
    swa_held: bool = True
    released: bool = False


@dataclass
class MatchResult:
    """A prefix hit. num_tokens = device_tokens + host_tokens + storage_tokens (the latter two are
    the tiers' share, always 0 until HiCache exists); full_tokens is the longest whole-history
    match ignoring windowed shadows (what a bounded SWA recompute could reach)."""

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


class ShadowIndex:
    def __init__(
        self,
        spaces: dict[str, BlockSpace],
        page_size: int,
        policy: EvictionPolicy | None = None,
        windowed_match: bool = True,
        host_tier: HostTier | None = None,
        chain_seed: bytes | None = None,
    ) -> None:
        """windowed_match=False is the baseline that drops the whole prefix as soon as any
        windowed page on it is gone (kept for benchmarks and tests to compare against).
        host_tier: keep shadows on the host too (see "Host tier" below). chain_seed: give every
        node the content key of its prefix (a storage tier names pages by it)."""
        self.chain_seed = chain_seed
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
        self.num_host_pins = 0  # pin_host calls not yet unpinned (0 when idle)
        self._nodes: set[ShadowNode] = set()
        self._clock = itertools.count(1)
        self._receipt_ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._live_receipts: dict[int, LockReceipt] = {}
        self.evictable = {n: 0 for n in spaces}
        self.protected = {n: 0 for n in spaces}
        self._unlocked = EvictionQueue(self.policy)
        self._idle = {s: EvictionQueue(self.policy) for s in self.windows}
        self._tail = {s: EvictionQueue(self.policy) for s in self.windows}
        self.tier = host_tier
        if host_tier is not None:
            # _dev_unlocked: unlocked nodes with a device page in a whole-history space (demotion
            # candidates); _host_leaves: unlocked leaves with no device page at all (host
            # eviction deletes them); _host_dups: unlocked nodes with a page on both tiers in some
            # space (host eviction may drop those host copies: the device still has the data).
            self._dev_unlocked = EvictionQueue(self.policy)
            self._host_leaves = EvictionQueue(self.policy)
            self._host_dups = EvictionQueue(self.policy)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def nodes(self) -> Iterator[ShadowNode]:
        return iter(self._nodes)

    @property
    def num_live_receipts(self) -> int:
        return len(self._live_receipts)

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

    # -- eviction queues: membership follows the node's state -----------------------------------
    def _window_queue(self, node: ShadowNode, space: str) -> EvictionQueue | None:
        """The queue node's shadow in a windowed space belongs in (None: not evictable there)."""
        if node.shadows[space] is None or node.swa_lock_ref:
            return None
        return self._tail[space] if node.tail_refs[space] else self._idle[space]

    @staticmethod
    def _place(q: EvictionQueue, node: ShadowNode, want: bool, touch: bool) -> None:
        if want:
            if touch or node not in q:
                q.add(node)
        else:
            q.discard(node)

    def _sync(self, node: ShadowNode, touch: bool = False) -> None:
        """Put node in exactly the queues its state calls for. touch=True also moves it to the
        back of each (it was just used); otherwise a node that stays keeps its place."""
        unlocked = node.full_lock_ref == 0
        self._place(self._unlocked, node, unlocked, touch)
        for s in self.windows:
            want = self._window_queue(node, s)
            for q in (self._idle[s], self._tail[s]):
                self._place(q, node, q is want, touch)
        if self.tier is not None:
            on_device = self._on_device(node)
            self._place(self._dev_unlocked, node,
                        unlocked and any(node.shadows[s] is not None for s in self.whole), touch)
            self._place(self._host_leaves, node,
                        unlocked and not on_device and not node.children and not node.host_pins, touch)
            self._place(self._host_dups, node, unlocked and any(
                node.shadows[s] is not None and node.host[s] is not None for s in node.host), touch)

    def _forget(self, node: ShadowNode) -> None:
        self._unlocked.discard(node)
        for s in self.windows:
            self._idle[s].discard(node)
            self._tail[s].discard(node)
        if self.tier is not None:
            for q in (self._dev_unlocked, self._host_leaves, self._host_dups):
                q.discard(node)

    def _touch(self, nodes: Sequence[ShadowNode], hit: bool) -> None:
        """Mark nodes (a root -> node path, top-down) as just used. Updated bottom-up, so within a
        class a node always sits behind its descendants and the front of the queue is a leaf."""
        now = next(self._clock)
        for nd in reversed(nodes):
            nd.last_access = now
            if hit:
                nd.hit_count += 1
            self._sync(nd, touch=True)

    def touch(self, nodes: Sequence[ShadowNode]) -> None:
        """Count a prefix hit once it is admitted (match(touch=False) before that). Under
        write_through_selective a node hit often enough is written to the host now (the caller
        holds a lock on nodes, so the host room this makes never deletes them)."""
        if nodes:
            self._touch(nodes, hit=True)
            if self.tier is not None and self.tier.write_policy == "write_through_selective":
                for nd in nodes:
                    if nd.hit_count >= SELECTIVE_MIN_HITS:
                        self.write_node(nd)

    # -- tail points (windowed spaces) -----------------------------------------------------------
    def _is_tail_point(self, node: ShadowNode) -> bool:
        return not node.is_root and (node.boundary or len(node.children) != 1)

    def _update_tail_point(self, node: ShadowNode, force_off: bool = False) -> None:
        """Recount node as a tail point (or not): only the window of pages ending at it changes."""
        if not self.windows or node.is_root:
            return
        want = False if force_off else self._is_tail_point(node)
        if want == node.tail_point:
            return
        node.tail_point = want
        delta = 1 if want else -1
        for s in self.windows:
            k = node.depth - self.first_window_page(s, node.depth)  # pages of the window ending at node
            nd = node
            for _ in range(k):
                before = nd.tail_refs[s]
                nd.tail_refs[s] = before + delta
                if (before == 0) != (before + delta == 0) and nd.shadows[s] is not None and not nd.swa_lock_ref:
                    self._sync(nd)
                nd = nd.parent

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
        loads: dict[str, list[int]] = {}
        host_pages = 0
        if tiered and hit:
            need_host = [False] * best
            for s in self.spaces:
                first = self.first_window_page(s, best) if s in self.windows else 0
                idx = [i for i in range(first, best) if hit[i].shadows[s] is None]
                if idx:
                    loads[s] = idx
                    for i in idx:
                        need_host[i] = True
            host_pages = sum(need_host)
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
                if windows:
                    self._update_tail_point(child)
                    self._update_tail_point(node)
                if tier is not None:
                    if not node.is_root:
                        self._sync(node)  # it has a child now: no longer a host-eviction leaf
                    if self.tier.write_policy == "write_through":
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
                        if self.tier is not None:
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

    # -- locks ---------------------------------------------------------------------------------------
    def _full_inc(self, nd: ShadowNode) -> None:
        if nd.full_lock_ref == 0:
            for s in self.whole:
                if nd.shadows[s] is not None:  # a host-only node has no device page to protect
                    self.evictable[s] -= 1
                    self.protected[s] += 1
            nd.full_lock_ref = 1
            self._sync(nd)
        else:
            nd.full_lock_ref += 1

    def _full_dec(self, nd: ShadowNode, receipt_id: int) -> None:
        if nd.full_lock_ref <= 0:
            raise AssertionError(f"unlock of receipt {receipt_id} reached a node with full_lock_ref 0")
        nd.full_lock_ref -= 1
        if nd.full_lock_ref == 0:
            for s in self.whole:
                if nd.shadows[s] is not None:
                    self.protected[s] -= 1
                    self.evictable[s] += 1

    def _swa_inc(self, nd: ShadowNode) -> None:
        nd.swa_lock_ref += 1
        if nd.swa_lock_ref == 1:
            for s in self.windows:
                if nd.shadows[s] is not None:
                    self.evictable[s] -= 1
                    self.protected[s] += 1
            self._sync(nd)

    def _swa_dec(self, nd: ShadowNode, receipt_id: int) -> bool:
        """True when the node's SWA shadows just became evictable."""
        if nd.swa_lock_ref <= 0:
            raise AssertionError(f"swa unlock of receipt {receipt_id} reached a node with swa_lock_ref 0")
        nd.swa_lock_ref -= 1
        if nd.swa_lock_ref:
            return False
        for s in self.windows:
            if nd.shadows[s] is not None:
                self.protected[s] -= 1
                self.evictable[s] += 1
        return True

    def _swa_pages(self, anchor: ShadowNode, swa_tokens: int) -> int:
        """Nodes an SWA lock of swa_tokens tokens ending at anchor covers."""
        if not self.windows or swa_tokens <= 0:
            return 0
        return min(anchor.depth, -(-swa_tokens // self.page_size))

    def lock(self, anchor: ShadowNode, swa_tokens: int = 0) -> LockReceipt:
        """Full-lock the path anchor -> root; SWA-lock the nodes covering the last swa_tokens
        tokens before the anchor's end. O(depth): a request locks once, then `move`s."""
        rid = next(self._receipt_ids)
        for nd in anchor.path():
            self._full_inc(nd)
        k = self._swa_pages(anchor, swa_tokens)
        boundary = None
        nd = anchor
        for _ in range(k):
            self._swa_inc(nd)
            boundary, nd = nd, nd.parent
        if boundary is not None:
            boundary.swa_receipts.add(rid)
        receipt = LockReceipt(rid, anchor, swa_tokens, boundary, swa_held=boundary is not None)
        self._live_receipts[rid] = receipt
        return receipt

    def _check_receipt(self, receipt: LockReceipt) -> None:
        if receipt.released or self._live_receipts.get(receipt.id) is not receipt:
            raise AssertionError(f"lock receipt {receipt.id} is not live (unlocked twice, or not from this index)")

    def move(self, receipt: LockReceipt, anchor: ShadowNode, swa_tokens: int) -> LockReceipt:
        """Re-point a live lock at `anchor` (a descendant of, or the same node as, its anchor)
        with an SWA segment of swa_tokens, touching only the nodes whose lock state changes:
        the new pages below the old anchor, and the SWA segment's two ends. Returns the receipt
        (the same object; a new one only when anchor is not below the old anchor)."""
        self._check_receipt(receipt)
        old = receipt.anchor
        below: list[ShadowNode] = []  # nodes from anchor up to, excluding, the old anchor
        nd = anchor
        while nd is not old and nd.depth > old.depth:
            below.append(nd)
            nd = nd.parent
        if nd is not old:  # not a descendant: lock anew, then drop the old lock
            new = self.lock(anchor, swa_tokens)
            self.unlock(receipt)
            return new
        for nd in below:
            self._full_inc(nd)
        # SWA segment: old covers depths [old_top, old.depth], new covers [new_top, anchor.depth].
        old_k = self._swa_pages(old, receipt.swa_tokens) if receipt.swa_held else 0
        new_k = self._swa_pages(anchor, swa_tokens)
        old_top, new_top = old.depth - old_k + 1, anchor.depth - new_k + 1
        if old_k:
            receipt.swa_boundary.swa_receipts.discard(receipt.id)
        boundary = None
        released: list[ShadowNode] = []
        lo = min(old_top if old_k else new_top, new_top)
        nd = anchor
        while nd is not None and not nd.is_root and nd.depth >= lo:
            d = nd.depth
            in_old = old_k > 0 and old_top <= d <= old.depth
            in_new = new_k > 0 and d >= new_top
            if in_new and not in_old:
                self._swa_inc(nd)
            elif in_old and not in_new and self._swa_dec(nd, receipt.id):
                released.append(nd)
            if new_k and d == new_top:
                boundary = nd
            nd = nd.parent
        now = next(self._clock)
        for nd in released:  # bottom-up: their windowed shadows are evictable from now on
            nd.last_access = max(nd.last_access, now)
            self._sync(nd, touch=True)
        if boundary is not None:
            boundary.swa_receipts.add(receipt.id)
        receipt.anchor, receipt.swa_tokens = anchor, swa_tokens
        receipt.swa_boundary, receipt.swa_held = boundary, boundary is not None
        return receipt

    def release_swa(self, receipt: LockReceipt) -> None:
        """Drop the SWA part of a lock early (the request decoded past that window); the full
        lock stays. Idempotent per receipt."""
        self._check_receipt(receipt)
        if not receipt.swa_held:
            return
        released = []
        for nd in receipt.anchor.path():
            if self._swa_dec(nd, receipt.id):
                released.append(nd)
            if receipt.id in nd.swa_receipts:
                nd.swa_receipts.discard(receipt.id)
                break
        else:
            raise AssertionError(f"swa unlock of receipt {receipt.id} never met its boundary")
        now = next(self._clock)
        for nd in released:
            nd.last_access = max(nd.last_access, now)
            self._sync(nd, touch=True)
        receipt.swa_held = False
        receipt.swa_boundary = None

    def unlock(self, receipt: LockReceipt) -> None:
        """Release a receipt: O(depth), once per request. Nodes left unlocked count as used now
        (they were in use until this moment), bottom-up."""
        self.release_swa(receipt)
        freed = []
        for nd in receipt.anchor.path():
            self._full_dec(nd, receipt.id)
            if nd.full_lock_ref == 0:
                freed.append(nd)
        receipt.released = True
        del self._live_receipts[receipt.id]
        now = next(self._clock)
        for nd in freed:
            nd.last_access = max(nd.last_access, now)
            self._sync(nd, touch=True)
        anchor = receipt.anchor
        # An anchor whose windowed shadow was tombstoned while it was locked goes once unlocked.
        if anchor in self._nodes and self._is_dead_leaf(anchor):
            self._delete(anchor)

    # -- eviction ------------------------------------------------------------------------------------
    def _first_leaf(self, space: str | None = None, pinned: bool = False) -> ShadowNode | None:
        """Next unlocked leaf in policy order (with a live page in `space`, when given), skipping
        host-pinned ones unless `pinned`. The front of each class is a leaf, so this normally
        looks at one node."""
        for nd in self._unlocked:
            if not nd.children and (pinned or not nd.host_pins) and (space is None or nd.shadows[space] is not None):
                return nd
        return None

    def evict(self, space: str, num_pages: int) -> int:
        """Free up to num_pages pages of `space` from the index; returns pages freed in `space`.

        Whole-history space: delete unlocked leaves in policy order (a deleted node's parent may
        become the next candidate). Windowed space, in three tiers, policy order within each:
          0. tombstone unlocked shadows outside every tail window (no likely hit needs them),
          1. delete whole unlocked leaves that hold a page here (frees every space),
          2. tombstone tail shadows (a hit at that boundary is lost; deeper ones may survive).
             An unlocked leaf is deleted instead: without its window it can serve no hit at all,
             and keeping it would leave tier 1 scanning dead leaves (the index holds only what
             can still serve a hit).
        """
        pool = self.spaces[space]
        start = pool.num_free
        # Freed pages are counted at the pool: deleting a node can also drop ancestors that became
        # dead leaves, whose pages in this space are freed too.
        if space not in self.windows:
            while pool.num_free - start < num_pages:
                if self.tier is not None:
                    nd = self._dev_unlocked.first()
                    if nd is None:
                        break
                    if self._demote(nd):
                        continue
                    if not nd.children:  # it cannot go to the host: it goes
                        self._delete(nd)
                        continue
                # Host pins yield to the device: when nothing else can go (a device node whose
                # subtree is a pinned host-only chain, no host room to demote it), the pinned
                # chain goes, so the evictable count allocate() relied on stays true.
                leaf = self._first_leaf() or self._first_leaf(pinned=True)
                if leaf is None:
                    break
                self._delete(leaf)
            return pool.num_free - start
        idle, tail = self._idle[space], self._tail[space]
        while pool.num_free - start < num_pages:
            # Re-pick the tier for every page: deleting a leaf can turn its parent's tail shadow
            # into an idle one (the parent stops being a branch point), which tier 0 takes first.
            nd = idle.first()
            if nd is not None:
                self._tombstone(nd, space)
                continue
            leaf = self._first_leaf(space)
            if leaf is None:
                leaf = tail.first()
                if leaf is None:
                    break
                if leaf.children or leaf.full_lock_ref:
                    self._tombstone(leaf, space)
                    continue
            if self.tier is not None and self._demote(leaf):
                continue
            self._delete(leaf)
        return pool.num_free - start

    def _tombstone(self, node: ShadowNode, space: str) -> None:
        """Drop a windowed device shadow (kept on the host when the write policy allows it);
        remove the node too if that left it a dead leaf."""
        if node.swa_lock_ref:
            raise AssertionError("tombstoning an SWA-locked shadow")
        if self.tier is not None and self._wants_host_copy(node):
            self._write(node, space)
        self._drop_device(node, space)
        self._sync(node)
        if self._is_dead_leaf(node):
            self._delete(node)

    def _drop_device(self, node: ShadowNode, space: str) -> None:
        page = node.shadows[space]
        self._ledger_add(node, space, -1)
        node.shadows[space] = TOMBSTONE
        self.spaces[space].remove_from_index(page)

    # -- host tier --------------------------------------------------------------------------------
    # A node's shadow in a space lives on the device (shadows), the host (host), both, or neither
    # (a windowed tombstone). Whole-history data is always on some tier while the node lives.
    # Device eviction *demotes* (drops the device pages of a node whose data is on the host) before
    # it deletes; host eviction deletes unlocked host-only leaves, then drops host copies of
    # unlocked nodes the device still holds. Locked nodes are never touched on either tier, and a
    # node being loaded back is locked by its request and has device pages, so its host copy
    # stays until the copy ran (the engine executes the step's transfers before the forward).
    def _wants_host_copy(self, node: ShadowNode) -> bool:
        """Whether a device page leaving this node goes to the host first (write_back writes
        here; write_through already did unless the host was full; selective writes only hot
        nodes, and interior nodes, whose subtree needs them to stay reachable)."""
        if self.tier.write_policy != "write_through_selective":
            return True
        return node.hit_count >= SELECTIVE_MIN_HITS or bool(node.children)

    def _host_page(self, space: str, keep: ShadowNode | None) -> int | None:
        """A free host page of `space`, evicting on the host if needed (never `keep`)."""
        pool = self.tier.pools[space]
        while pool.num_free == 0:
            victim = next((n for n in self._host_leaves if n is not keep), None)
            if victim is not None:
                self.tier.stats.host_evicted_nodes += 1
                self._delete(victim, keep=keep)
                continue
            victim = next((n for n in self._host_dups if n is not keep), None)
            if victim is None:
                return None
            self.tier.stats.host_copies_dropped += 1
            for s, h in victim.host.items():
                if h is not None and victim.shadows[s] is not None:
                    self._free_host(victim, s)
            self._sync(victim)
        return pool.allocate()

    def host_page(self, space: str) -> int | None:
        """A host page for data outside the index (a swapped-out partial page): the caller
        registers it with HostTier.hold. None when the host has no room."""
        return self._host_page(space, keep=None)

    def _write(self, node: ShadowNode, space: str) -> bool:
        """Make sure node's device page in `space` has a host copy (queue the copy). False when
        the host has no room."""
        if node.host[space] is not None or node.shadows[space] is None:
            return node.host[space] is not None
        h = self._host_page(space, keep=node)
        if h is None:
            self.tier.stats.write_failures += 1
            return False
        node.host[space] = h
        self.tier.transfers.write(space, node.shadows[space], h)
        self.tier.stats.written_pages[space] += 1
        if self.tier.storage_writes:
            self.tier.transfers.store(space, h, storage_key(node.chain, space))
        return True

    def write_node(self, node: ShadowNode) -> bool:
        """Copy every device page of node to the host (write-through, swap-out). True when every
        page of it now has a host copy."""
        ok = True
        for s in self.spaces:
            if node.shadows[s] is not None:
                ok = self._write(node, s) and ok
        self._sync(node)
        return ok

    def _free_host(self, node: ShadowNode, space: str) -> None:
        h = node.host[space]
        node.host[space] = None
        self.tier.transfers.cancel_write(space, h)
        self.tier.pools[space].free(h)

    def _demote(self, node: ShadowNode) -> bool:
        """Drop every device page of an unlocked node whose pages are (now) all on the host.
        False -- nothing dropped -- when a whole-history page cannot get a host copy (no room,
        or the selective policy keeps this leaf off the host): the caller deletes instead."""
        if node.full_lock_ref:
            raise AssertionError("demoting a locked node")
        if not self._wants_host_copy(node):
            return False
        for s in self.whole:
            if not self._write(node, s):
                # The spaces written before this one now have a copy on both tiers: the node
                # belongs in the host-copy queue even though it keeps its device pages (found by
                # the host-tier state machine: an interior node's c4 written, its full page not).
                self._sync(node)
                return False
        for s in self.windows:
            if node.shadows[s] is not None:
                self._write(node, s)  # a windowed page without room is simply tombstoned
        for s in self.spaces:
            if node.shadows[s] is not None:
                self._drop_device(node, s)
        self.tier.stats.demoted_nodes += 1
        self._sync(node)
        if self._is_dead_leaf(node):
            self._delete(node)
        return True

    def insert_host(
        self, token_ids: Sequence[int], namespace: Hashable, first_page: int, host_pages: dict[str, list[int | None]]
    ) -> tuple[int, list[tuple[str, int]]]:
        """Record pages read from a storage tier into host pages: pages first_page.. of
        token_ids, host_pages[s][j] holding page first_page + j of space s (None: not read, a
        windowed page outside the trailing window). The path up to first_page must exist (the
        caller locked its end). Existing nodes keep their data; a host page they do not need is
        handed back. Returns (pages now recorded, [(space, host page) the caller must free])."""
        node = self._root(namespace, create=first_page == 0)
        unused: list[tuple[str, int]] = []
        n = min(len(v) for v in host_pages.values()) if host_pages else 0
        for i in range(first_page):
            node = node.children.get(self._key(token_ids, i)) if node is not None else None
        if node is None:
            return 0, [(s, h) for s, hs in host_pages.items() for h in hs if h is not None]
        walked: list[ShadowNode] = []
        for j in range(n):
            i = first_page + j
            key = self._key(token_ids, i)
            child = node.children.get(key)
            if child is None:
                child = ShadowNode(key=key, parent=node, depth=node.depth + 1, seq=next(self._seq))
                child.tail_refs = {s: 0 for s in self.windows}
                child.host = {s: None for s in self.spaces}
                child.shadows = {s: TOMBSTONE for s in self.spaces}
                if self.chain_seed is not None:
                    child.chain = next_chain(node.chain, key)
                for s in self.spaces:
                    child.host[s] = host_pages.get(s, [None] * n)[j]
                node.children[key] = child
                self._nodes.add(child)
                self._update_tail_point(child)
                self._update_tail_point(node)
                if not node.is_root:
                    self._sync(node)
            else:
                for s in self.spaces:
                    h = host_pages.get(s, [None] * n)[j]
                    if h is None:
                        continue
                    if child.host[s] is None and child.shadows[s] is None:
                        child.host[s] = h  # heal a tombstone with the stored page
                    else:
                        unused.append((s, h))
            walked.append(child)
            node = child
        if walked:
            self._touch(walked, hit=False)
            if self._is_dead_leaf(walked[-1]):  # its trailing windowed pages were not read
                self._delete(walked[-1])
        return n, unused

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

    def pin_host(self, node: ShadowNode) -> None:
        """Keep node -- and so the host-only chain above it, since host eviction takes leaves --
        out of host eviction until unpin_host (a waiting request's storage read recorded it).
        A soft pin: device eviction that finds nothing else to free still deletes the chain."""
        node.host_pins += 1
        self.num_host_pins += 1
        self._sync(node)

    def unpin_host(self, node: ShadowNode) -> None:
        if node.host_pins <= 0:
            raise AssertionError("unpin_host of a node that is not pinned")
        node.host_pins -= 1
        self.num_host_pins -= 1
        if node in self._nodes:  # still in the index (a reset may have dropped it meanwhile)
            self._sync(node)

    def free_host_page(self, space: str, page: int) -> None:
        """Give back a host page insert_host did not use."""
        self.tier.pools[space].free(page)

    def attach_loaded(self, node: ShadowNode, space: str, device_page: int) -> None:
        """A request admitted with a host hit holds device_page for node's data in space: the
        index records it as the node's device shadow and queues the host -> device copy. The
        caller holds a lock on node (taken first) and a reference on the page."""
        h = node.host[space]
        if node.shadows[space] is not None or h is None:
            raise AssertionError(f"space {space!r}: load-back of a node that is not host-only there")
        self.spaces[space].add_to_index(device_page)
        node.shadows[space] = device_page
        self._ledger_add(node, space, +1)
        self.tier.transfers.load(space, h, device_page)
        self.tier.stats.loaded_pages[space] += 1
        self._sync(node)

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

    def clear(self) -> int:
        """Drop every node no request holds (reset_prefix_cache). Returns nodes dropped."""
        before = len(self._nodes)
        while (leaf := self._first_leaf()) is not None:
            self._delete(leaf)
        return before - len(self._nodes)

    # -- checks ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Full recount (tests only; O(tree x window))."""
        evictable = {n: 0 for n in self.spaces}
        protected = {n: 0 for n in self.spaces}
        referenced: dict[str, set[int]] = {n: set() for n in self.spaces}
        host_referenced: dict[str, set[int]] = {n: set() for n in self.spaces}
        seen = 0
        stamps: dict[int, ShadowNode] = {}
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
                assert child.full_lock_ref >= child.swa_lock_ref >= 0, (
                    f"lock counts broken: full {child.full_lock_ref}, swa {child.swa_lock_ref}"
                )
                assert not self._is_dead_leaf(child), "an unlocked leaf that can serve no hit was kept"
                for rid in child.swa_receipts:
                    assert rid not in stamps, f"receipt {rid} stamped twice"
                    stamps[rid] = child
                for s, h in child.host.items():
                    if h is not None:
                        assert h not in host_referenced[s], f"space {s!r}: host page {h} in the index twice"
                        host_referenced[s].add(h)
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
            if self.tier is not None:
                self.tier.pools[s].check_invariants(host_referenced[s] | self.tier.held[s])
        # Every live receipt's SWA boundary carries its stamp, and no stamp is orphaned.
        live_swa = {r.id: r.swa_boundary for r in self._live_receipts.values() if r.swa_held}
        assert set(stamps) == set(live_swa), f"stale swa stamps {set(stamps) ^ set(live_swa)}"
        for rid, nd in stamps.items():
            assert live_swa[rid] is nd, f"receipt {rid}'s stamp moved"
        # Lock counts equal what the live receipts put there.
        want_full: dict[ShadowNode, int] = {}
        want_swa: dict[ShadowNode, int] = {}
        for r in self._live_receipts.values():
            for nd in r.anchor.path():
                want_full[nd] = want_full.get(nd, 0) + 1
            if r.swa_held:
                for nd in r.anchor.path():
                    want_swa[nd] = want_swa.get(nd, 0) + 1
                    if nd is r.swa_boundary:
                        break
        for nd in self._nodes:
            assert nd.full_lock_ref == want_full.get(nd, 0), "full_lock_ref differs from the live receipts"
            assert nd.swa_lock_ref == want_swa.get(nd, 0), "swa_lock_ref differs from the live receipts"
        self._check_queues()

    def _check_queues(self) -> None:
        """Eviction queues hold exactly the candidates, and tail counts match a recount."""
        want_tail = {s: {} for s in self.windows}
        for nd in self._nodes if self.windows else ():
            assert nd.tail_point == self._is_tail_point(nd), "a node's tail-point flag is stale"
            if not nd.tail_point:
                continue
            for s in self.windows:
                up = nd
                for _ in range(nd.depth - self.first_window_page(s, nd.depth)):
                    want_tail[s][up] = want_tail[s].get(up, 0) + 1
                    up = up.parent
        unlocked = {nd for nd in self._nodes if nd.full_lock_ref == 0}
        assert set(self._unlocked) == unlocked and len(self._unlocked) == len(unlocked), (
            "the unlocked queue differs from the unlocked nodes"
        )
        for s in self.windows:
            for nd in self._nodes:
                assert nd.tail_refs[s] == want_tail[s].get(nd, 0), f"space {s!r}: tail count drift"
            live = {nd for nd in self._nodes if nd.shadows[s] is not None and nd.swa_lock_ref == 0}
            tails = {nd for nd in live if nd.tail_refs[s]}
            assert set(self._tail[s]) == tails, f"space {s!r}: tail queue differs from the tail shadows"
            assert set(self._idle[s]) == live - tails, f"space {s!r}: idle queue differs from the idle shadows"
            assert len(self._idle[s]) + len(self._tail[s]) == self.evictable[s], f"space {s!r}: queues vs ledger"
        if self.tier is not None:
            dev = {nd for nd in unlocked if any(nd.shadows[s] is not None for s in self.whole)}
            leaves = {nd for nd in unlocked if not nd.children and not self._on_device(nd) and not nd.host_pins}
            dups = {nd for nd in unlocked if any(nd.shadows[s] is not None and nd.host[s] is not None for s in nd.host)}
            assert set(self._dev_unlocked) == dev, "the demotion queue differs from the unlocked device nodes"
            assert set(self._host_leaves) == leaves, "the host-eviction queue differs from the host-only leaves"
            assert set(self._host_dups) == dups, "the host-copy queue differs from the nodes on both tiers"
