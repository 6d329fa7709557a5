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
page on match/insert (a 100k-token tree with 128-token V4 pages is 782 nodes); the benefit is
that the split bug class (receipts/boundaries lost in a split) cannot exist.

Locks (two counts per node, SGLang's receipt protocol):
  full_lock_ref  on every node of the path anchor -> root: the node cannot be deleted.
  swa_lock_ref   on the nodes covering the last `swa_tokens` before the anchor's end: their
                 windowed shadows cannot be tombstoned.
`lock` returns a LockReceipt; the boundary (topmost SWA-locked node) is stamped with the
receipt id, and `unlock`/`release_swa` walk up from the anchor until they meet that stamp,
so they undo exactly what `lock` did even if the caller's idea of the window changed since.
Invariant: full_lock_ref >= swa_lock_ref >= 0 on every node.

Ledgers, per space, over live shadows: a shadow is *protected* when the lock that guards it is
held (full for whole-history spaces, swa for windowed ones), else *evictable*;
evictable + protected == pages of that space in the index, after every operation.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from block_manager.block_space import BlockSpace
from block_manager.eviction_policy import EvictionPolicy

TOMBSTONE = None  # shadow of a windowed space whose page was dropped
NULL_PAGE = -1  # a request table's entry for a page it released (out of its window)


@dataclass(eq=False)
class ShadowNode:
    key: tuple[int, ...]
    parent: "ShadowNode | None"
    depth: int  # pages from the root to this node, inclusive (the node ends at token depth*P)
    shadows: dict[str, int | None] = field(default_factory=dict)
    children: dict[tuple[int, ...], "ShadowNode"] = field(default_factory=dict)
    full_lock_ref: int = 0
    swa_lock_ref: int = 0
    swa_receipts: set[int] = field(default_factory=set)  # receipt ids whose SWA segment stops here
    last_access: int = 0
    hit_count: int = 0
    priority: int = 0
    boundary: bool = False  # a cached prompt or turn ended here: a likely future match point
    seq: int = 0  # creation order: the deterministic last tie-break of eviction order

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
    """What `lock` did; `unlock` must present it. swa_boundary is None when no node got an SWA lock."""

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


@dataclass
class InsertResult:
    """last_node: the node of the last inserted page (the request's new lock anchor).
    duplicates: space -> [(page index, the tree's page)] where the request computed a page the
    tree already holds; the caller swaps its table entry to the tree's page and drops its own.
    adopted: space -> page indices whose tombstone was healed with the request's page."""

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
    ) -> None:
        """windowed_match=False is the baseline that drops the whole prefix as soon as any
        windowed page on it is gone (kept for benchmarks and tests to compare against)."""
        self.spaces = spaces
        self.page_size = page_size
        self.policy = policy or EvictionPolicy()
        self.windowed_match = windowed_match
        self.windows: dict[str, int] = {n: s.spec.window for n, s in spaces.items() if s.spec.windowed}
        self.whole = [n for n, s in spaces.items() if not s.spec.windowed]
        self._roots: dict[Hashable, ShadowNode] = {}
        self._nodes: set[ShadowNode] = set()
        self._clock = itertools.count(1)
        self._receipt_ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._live_receipts: dict[int, LockReceipt] = {}
        self.evictable = {n: 0 for n in spaces}
        self.protected = {n: 0 for n in spaces}

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def nodes(self) -> Iterator[ShadowNode]:
        return iter(self._nodes)

    # -- helpers --------------------------------------------------------------------------------
    def _root(self, namespace: Hashable, create: bool) -> ShadowNode | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = ShadowNode(key=(), parent=None, depth=0)
        return root

    def _key(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        P = self.page_size
        return tuple(token_ids[i * P : (i + 1) * P])

    def first_window_page(self, space: str, end_page: int) -> int:
        """First page a request resuming at token end_page*P still reads in a windowed space.
        The query at position L reads [L - window + 1, L] (same rule as the per-request release)."""
        L = end_page * self.page_size
        return max(0, L - self.windows[space] + 1) // self.page_size

    def _guard_locked(self, node: ShadowNode, space: str) -> bool:
        return (node.swa_lock_ref if space in self.windows else node.full_lock_ref) > 0

    def _ledger_add(self, node: ShadowNode, space: str, sign: int) -> None:
        if self._guard_locked(node, space):
            self.protected[space] += sign
        else:
            self.evictable[space] += sign

    def _has_data(self, node: ShadowNode) -> bool:
        return any(p is not None for p in node.shadows.values())

    # -- match ------------------------------------------------------------------------------------
    def match(
        self, token_ids: Sequence[int], namespace: Hashable = None, max_pages: int | None = None, touch: bool = True
    ) -> MatchResult:
        """Longest page-aligned prefix (at most max_pages) that is SWA-valid: every node on it
        exists (so its whole-history shadows are present) and, for each windowed space, the pages
        from the space's window start before the boundary up to the boundary are live. A prefix
        whose window reaches the root needs no more than what exists."""
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
        best = 0
        if not self.windows:
            best = len(path)
        elif self.windowed_match:
            # run[s] = consecutive live pages of space s ending at depth d.
            run = {s: 0 for s in self.windows}
            for d, nd in enumerate(path, start=1):
                ok = True
                for s in self.windows:
                    run[s] = run[s] + 1 if nd.shadows[s] is not None else 0
                    if run[s] < d - self.first_window_page(s, d):
                        ok = False
                if ok:
                    best = d
        else:  # baseline: a tombstone anywhere on the path ends the prefix before it
            for d, nd in enumerate(path, start=1):
                if any(nd.shadows[s] is None for s in self.windows):
                    break
                best = d
        hit = path[:best]
        if touch and hit:
            now = next(self._clock)
            for nd in hit:
                nd.last_access = now
                nd.hit_count += 1
        return MatchResult(hit, best * P, best * P, full_tokens=len(path) * P)

    # -- insert -----------------------------------------------------------------------------------
    def insert(
        self,
        token_ids: Sequence[int],
        pages: dict[str, Sequence[int]],
        namespace: Hashable = None,
        start: ShadowNode | None = None,
        priority: int = 0,
    ) -> InsertResult:
        """Record a request's whole pages under token_ids (pages[s][i] holds page i in space s;
        NULL_PAGE = the request already released it, below its window).

        `start` resumes below a node the caller holds locked (its previous insert), skipping the
        walk over pages already recorded. Existing nodes keep their pages (the request's equal
        pages are reported as duplicates for the caller to swap out); a tombstone the request
        still has live is healed by adopting the request's page (the page joins the index; the
        request keeps its reference, so nothing is freed twice); new nodes take the request's
        pages, with a tombstone wherever the request already released the windowed page (never
        a live shadow for a page the request no longer owns).
        """
        num_pages = min(len(token_ids) // self.page_size, min(len(t) for t in pages.values()))
        node = start if start is not None else self._root(namespace, create=True)
        now = next(self._clock)
        duplicates: dict[str, list[tuple[int, int]]] = {s: [] for s in pages}
        adopted: dict[str, list[int]] = {s: [] for s in self.windows}
        new = 0
        for i in range(node.depth, num_pages):
            key = self._key(token_ids, i)
            child = node.children.get(key)
            if child is None:
                child = ShadowNode(key=key, parent=node, depth=node.depth + 1, priority=priority, seq=next(self._seq))
                for s, table in pages.items():
                    page = table[i]
                    if page == NULL_PAGE:
                        if s not in self.windows:
                            raise AssertionError(f"whole-history space {s!r} has no page {i} to insert")
                        child.shadows[s] = TOMBSTONE
                        continue
                    self.spaces[s].add_to_index(page)
                    child.shadows[s] = page
                    self.evictable[s] += 1  # a fresh node carries no lock yet
                node.children[key] = child
                self._nodes.add(child)
                new += 1
            else:
                child.hit_count += 1
                child.priority = max(child.priority, priority)
                for s, table in pages.items():
                    page, mine = child.shadows[s], table[i]
                    if mine == NULL_PAGE or mine == page:
                        continue
                    if page is None:  # heal: adopt the request's live page
                        self.spaces[s].add_to_index(mine)
                        child.shadows[s] = mine
                        self._ledger_add(child, s, +1)
                        adopted[s].append(i)
                    else:
                        duplicates[s].append((i, page))
            child.last_access = now
            node = child
        return InsertResult(node, new, duplicates, adopted)

    def mark_boundary(self, node: ShadowNode) -> None:
        if not node.is_root:
            node.boundary = True

    # -- locks ---------------------------------------------------------------------------------------
    def lock(self, anchor: ShadowNode, swa_tokens: int = 0) -> LockReceipt:
        """Full-lock the path anchor -> root; SWA-lock the nodes covering the last swa_tokens
        tokens before the anchor's end."""
        rid = next(self._receipt_ids)
        for nd in anchor.path():
            if nd.full_lock_ref == 0:
                for s in self.whole:
                    self.evictable[s] -= 1
                    self.protected[s] += 1
            nd.full_lock_ref += 1
        boundary = None
        covered = 0
        if self.windows:
            for nd in anchor.path():
                if covered >= swa_tokens:
                    break
                if nd.swa_lock_ref == 0:
                    for s in self.windows:
                        if nd.shadows[s] is not None:
                            self.evictable[s] -= 1
                            self.protected[s] += 1
                nd.swa_lock_ref += 1
                covered += self.page_size
                boundary = nd
        if boundary is not None:
            boundary.swa_receipts.add(rid)
        receipt = LockReceipt(rid, anchor, swa_tokens, boundary, swa_held=boundary is not None)
        self._live_receipts[rid] = receipt
        return receipt

    def _check_receipt(self, receipt: LockReceipt) -> None:
        if receipt.released or self._live_receipts.get(receipt.id) is not receipt:
            raise AssertionError(f"lock receipt {receipt.id} is not live (unlocked twice, or not from this index)")

    def release_swa(self, receipt: LockReceipt) -> None:
        """Drop the SWA part of a lock early (the request decoded past that window); the full
        lock stays. Idempotent per receipt."""
        self._check_receipt(receipt)
        if not receipt.swa_held:
            return
        for nd in receipt.anchor.path():
            if nd.swa_lock_ref <= 0:
                raise AssertionError(f"swa unlock of receipt {receipt.id} reached a node with swa_lock_ref 0")
            nd.swa_lock_ref -= 1
            if nd.swa_lock_ref == 0:
                for s in self.windows:
                    if nd.shadows[s] is not None:
                        self.protected[s] -= 1
                        self.evictable[s] += 1
            if receipt.id in nd.swa_receipts:
                nd.swa_receipts.discard(receipt.id)
                break
        else:
            raise AssertionError(f"swa unlock of receipt {receipt.id} never met its boundary")
        receipt.swa_held = False

    def unlock(self, receipt: LockReceipt) -> None:
        self.release_swa(receipt)
        for nd in receipt.anchor.path():
            if nd.full_lock_ref <= 0:
                raise AssertionError(f"unlock of receipt {receipt.id} reached a node with full_lock_ref 0")
            nd.full_lock_ref -= 1
            if nd.full_lock_ref == 0:
                for s in self.whole:
                    self.protected[s] -= 1
                    self.evictable[s] += 1
        receipt.released = True
        del self._live_receipts[receipt.id]
        anchor = receipt.anchor
        # A Mistral-like node whose every shadow was tombstoned while locked goes once unlocked.
        if anchor in self._nodes and not anchor.children and not anchor.full_lock_ref and not self._has_data(anchor):
            self._delete(anchor)

    # -- eviction ------------------------------------------------------------------------------------
    def _evict_order(self, node: ShadowNode) -> tuple:
        """Policy order, then deeper nodes first, then creation order: never id() or set order,
        so eviction is reproducible run to run."""
        return (*self.policy.key(node), -node.depth, node.seq)

    def _tails(self, space: str) -> set[ShadowNode]:
        """Nodes holding the window of `space` before a likely match point: a leaf, a branch point
        (two or more children) or a marked prompt/turn end. Tombstoning these would lose a hit."""
        tails: set[ShadowNode] = set()
        for nd in self._nodes:
            if not (nd.boundary or len(nd.children) != 1):
                continue
            first = self.first_window_page(space, nd.depth)
            for up in nd.path():
                if up.depth <= first:
                    break
                tails.add(up)
        return tails

    def evict(self, space: str, num_pages: int) -> int:
        """Free up to num_pages pages of `space` from the index; returns pages freed in `space`.

        Whole-history space: delete unlocked leaves in policy order (a deleted node's parent may
        become a candidate). Windowed space, in three tiers, policy order within each:
          0. tombstone unlocked shadows outside every tail (no likely hit needs them),
          1. delete whole unlocked leaves (frees every space),
          2. tombstone tail shadows (a hit at that boundary is lost; deeper ones may survive).
        """
        if space not in self.windows:
            return self._evict_leaves(space, num_pages)
        freed = 0
        tails = self._tails(space)
        live = [n for n in self._nodes if n.shadows[space] is not None and n.swa_lock_ref == 0]
        tier0 = sorted((n for n in live if n not in tails), key=self._evict_order)
        for nd in tier0:
            if freed >= num_pages:
                return freed
            self._tombstone(nd, space)
            freed += 1
        # Tier 1 only takes leaves that hold a page of this space: deleting others gains nothing here.
        tier1 = sorted(
            (n for n in self._nodes if not n.children and n.full_lock_ref == 0 and n.shadows[space] is not None),
            key=self._evict_order,
        )
        for leaf in tier1:
            if freed >= num_pages:
                return freed
            if leaf in self._nodes and not leaf.children:
                freed += self._freed_in(leaf, space)
                self._delete(leaf)
        tier2 = sorted(
            (n for n in self._nodes if n.shadows[space] is not None and n.swa_lock_ref == 0), key=self._evict_order
        )
        for nd in tier2:
            if freed >= num_pages:
                break
            self._tombstone(nd, space)
            freed += 1
        return freed

    def _evict_leaves(self, space: str, num_pages: int) -> int:
        """Delete unlocked leaves in policy order until num_pages pages of space were freed; a
        parent that becomes an unlocked leaf joins the candidates."""
        heap = [(self._evict_order(n), n.seq, n) for n in self._nodes if not n.children and n.full_lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            if leaf not in self._nodes or leaf.children or leaf.full_lock_ref:
                continue
            parent = leaf.parent
            freed += self._freed_in(leaf, space)
            self._delete(leaf)
            # _delete may also have removed data-less ancestors; the first survivor may be a new leaf.
            while parent is not None and not parent.is_root and parent not in self._nodes:
                parent = parent.parent
            if parent is not None and not parent.is_root and not parent.children and parent.full_lock_ref == 0:
                heapq.heappush(heap, (self._evict_order(parent), parent.seq, parent))
        return freed

    def _freed_in(self, node: ShadowNode, space: str) -> int:
        """1 if deleting node frees its page in space (nobody else holds it), else 0."""
        page = node.shadows.get(space)
        return int(page is not None and self.spaces[space].refcount[page] == 0)

    def _tombstone(self, node: ShadowNode, space: str) -> None:
        """Drop a windowed shadow; remove the node too if that left it childless, unlocked and empty."""
        if node.swa_lock_ref:
            raise AssertionError("tombstoning an SWA-locked shadow")
        page = node.shadows[space]
        self.evictable[space] -= 1
        node.shadows[space] = TOMBSTONE
        self.spaces[space].remove_from_index(page)
        if not node.children and node.full_lock_ref == 0 and not self._has_data(node):
            self._delete(node)

    def _delete(self, node: ShadowNode) -> None:
        """Delete an unlocked leaf, then every childless, unlocked ancestor without data."""
        while True:
            if node.children or node.full_lock_ref or node.is_root:
                raise AssertionError("only unlocked leaves can be deleted")
            for s, page in node.shadows.items():
                if page is not None:
                    self.evictable[s] -= 1
                    self.spaces[s].remove_from_index(page)
                    node.shadows[s] = TOMBSTONE
            parent = node.parent
            del parent.children[node.key]
            self._nodes.discard(node)
            node = parent
            if node.is_root or node.children or node.full_lock_ref or self._has_data(node):
                return

    def clear(self) -> int:
        """Drop every node no request holds (reset_prefix_cache). Returns nodes dropped."""
        before = len(self._nodes)
        self._evict_leaves(next(iter(self.spaces)), len(self._nodes) + 1)
        return before - len(self._nodes)

    # -- checks ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        evictable = {n: 0 for n in self.spaces}
        protected = {n: 0 for n in self.spaces}
        referenced: dict[str, set[int]] = {n: set() for n in self.spaces}
        seen = 0
        stamps: dict[int, ShadowNode] = {}
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
                if not child.children and not child.full_lock_ref:
                    assert self._has_data(child), "a childless, unlocked node without data was kept"
                for rid in child.swa_receipts:
                    assert rid not in stamps, f"receipt {rid} stamped twice"
                    stamps[rid] = child
                for s, page in child.shadows.items():
                    if page is None:
                        assert s in self.windows, f"whole-history space {s!r} has a tombstone"
                        continue
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
            in_index = {p for p in range(space.num_pages) if space.in_index[p]}
            assert in_index == referenced[s], f"space {s!r}: index ledger differs from the tree"
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
