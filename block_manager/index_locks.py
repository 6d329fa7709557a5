"""Lock receipts of the shadow prefix index (block_manager/shadow_index.py): SGLang's protocol.

Two counts per node:
  full_lock_ref  on every node of the path anchor -> root: the node cannot be deleted.
  swa_lock_ref   on the nodes covering the last `swa_tokens` before the anchor's end: their
                 windowed shadows cannot be tombstoned.
`lock` returns a LockReceipt; the boundary (topmost SWA-locked node) is stamped with the
receipt id, so `unlock`/`release_swa` undo exactly what was locked even if the caller's idea
of the window changed since. `move` slides a live receipt down to a deeper anchor touching
only the pages whose lock state changes (moving one page down is O(1) for the full lock and
O(window pages) for the SWA segment), never the whole anchor -> root path.
Invariant: full_lock_ref >= swa_lock_ref >= 0 on every node.

A lock count going 0 <-> 1 moves the node's shadows between the evictable and protected
ledgers (full for whole-history spaces, swa for windowed ones) and re-places the node in the
eviction queues; nothing else about a lock touches the node's data. The ledgers, queues and
deletion belong to the index, so this is a mixin of ShadowIndex rather than a separate object:
lock/move run on every request step, and a delegating layer would add a call to each.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from hybridkv.block_manager.shadow_node import ShadowNode


@dataclass
class LockReceipt:
    """What a lock holds now; `unlock` must present it. swa_boundary is None when no node is SWA-locked."""

    id: int
    anchor: ShadowNode
    swa_tokens: int
    swa_boundary: ShadowNode | None
    swa_held: bool = True
    released: bool = False


class IndexLocks:
    """Lock receipts over the index's nodes. Uses the index's whole/windows, page_size, the
    evictable/protected ledgers, _clock, _nodes, _sync, _is_dead_leaf and _delete."""

    def _init_locks(self) -> None:
        self._receipt_ids = itertools.count(1)
        self._live_receipts: dict[int, LockReceipt] = {}

    @property
    def num_live_receipts(self) -> int:
        return len(self._live_receipts)

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

    def _check_locks(self) -> None:
        """Lock counts equal what the live receipts put there, and every live receipt's SWA
        boundary carries its stamp with no stamp orphaned (tests only; O(receipts x depth))."""
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
        stamps: dict[int, ShadowNode] = {}
        for nd in self._nodes:
            assert nd.full_lock_ref >= nd.swa_lock_ref >= 0, (
                f"lock counts broken: full {nd.full_lock_ref}, swa {nd.swa_lock_ref}"
            )
            assert nd.full_lock_ref == want_full.get(nd, 0), "full_lock_ref differs from the live receipts"
            assert nd.swa_lock_ref == want_swa.get(nd, 0), "swa_lock_ref differs from the live receipts"
            for rid in nd.swa_receipts:
                assert rid not in stamps, f"receipt {rid} stamped twice"
                stamps[rid] = nd
        live_swa = {r.id: r.swa_boundary for r in self._live_receipts.values() if r.swa_held}
        assert set(stamps) == set(live_swa), f"stale swa stamps {set(stamps) ^ set(live_swa)}"
        for rid, nd in stamps.items():
            assert live_swa[rid] is nd, f"receipt {rid}'s stamp moved"
