"""Eviction of the shadow prefix index (block_manager/shadow_index.py): it costs what it evicts.

Candidates sit in O(1) queues (block_manager/eviction_policy.py's EvictionQueue) whose
membership follows each node's state; `_sync` re-places a node whenever that state changes:
  _unlocked          nodes with full_lock_ref == 0, in policy order; the first leaf in it is the
                     next whole-history victim (a node is touched after its descendants, so the
                     front of a class is a leaf)
  _idle[s]/_tail[s]  per windowed space, live unlocked shadows outside / inside the window of a
                     *tail point* (a leaf, a branch point or a marked prompt/turn end: a likely
                     future match end). Tail membership is kept incrementally: when a node
                     becomes or stops being a tail point only the window above it is updated.
With a host tier, three more queues say which nodes can be demoted or dropped on the host
(index_host_tier.py describes them); `_sync` places nodes in those too.

This is a mixin of ShadowIndex, not a separate object: `_sync` runs for every node a match,
insert, lock move or eviction touches, and reads and writes the same node state as they do.
"""
from __future__ import annotations

from typing import Sequence

from hybridkv.block_manager.eviction_policy import EvictionQueue
from hybridkv.block_manager.shadow_node import TOMBSTONE, ShadowNode


class IndexEviction:
    """Eviction queues, tail points and `evict`. Uses the index's spaces, whole/windows, policy,
    tier, the evictable ledger, _clock, _nodes, first_window_page, _ledger_add, _on_device,
    _is_dead_leaf, _delete, _note (KV cache events), and with a host tier the host queues,
    _demote, _wants_host_copy and _write."""

    def _init_queues(self) -> None:
        self._unlocked = EvictionQueue(self.policy)
        self._idle = {s: EvictionQueue(self.policy) for s in self.windows}
        self._tail = {s: EvictionQueue(self.policy) for s in self.windows}
        # Every queue a node can be in (the host tier adds its own): a deleted node leaves them all.
        self._queues: tuple[EvictionQueue, ...] = (self._unlocked, *self._idle.values(), *self._tail.values())

    # -- queue membership follows the node's state ------------------------------------------------
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
        # The host queues are placed inline rather than by a host-tier hook: this runs for every
        # node a step touches, and a hook would cost a call per node.
        if self.tier is not None:
            on_device = self._on_device(node)
            self._place(self._dev_unlocked, node,
                        unlocked and any(node.shadows[s] is not None for s in self.whole), touch)
            self._place(self._host_leaves, node,
                        unlocked and not on_device and not node.children and not node.host_pins, touch)
            self._place(self._host_dups, node, unlocked and any(
                node.shadows[s] is not None and node.host[s] is not None for s in node.host), touch)

    def _forget(self, node: ShadowNode) -> None:
        for q in self._queues:
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
        With a host tier a victim is demoted (its data kept on the host) before it is deleted.
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
        self._note(node)

    def clear(self) -> int:
        """Drop every node no request holds (reset_prefix_cache). Returns nodes dropped."""
        before = len(self._nodes)
        while (leaf := self._first_leaf()) is not None:
            self._delete(leaf)
        if not self._nodes:
            self._note_cleared()
        return before - len(self._nodes)

    def _check_queues(self) -> None:
        """The device eviction queues hold exactly the candidates, and tail counts match a
        recount (tests only; O(tree x window))."""
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
