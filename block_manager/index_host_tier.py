"""The host tier (HiCache L2) side of the shadow prefix index (block_manager/shadow_index.py).

A node's shadow in a space lives on the device (shadows), the host (host), both, or neither
(a windowed tombstone). Whole-history data is always on some tier while the node lives.
Device eviction *demotes* (drops the device pages of a node whose data is on the host) before
it deletes; host eviction deletes unlocked host-only leaves, then drops host copies of
unlocked nodes the device still holds. Locked nodes are never touched on either tier, and a
node being loaded back is locked by its request and has device pages, so its host copy
stays until the copy ran (the engine executes the step's transfers before the forward).

Three more eviction queues exist with a host tier (placed by IndexEviction._sync):
  _dev_unlocked  unlocked nodes with a device page in a whole-history space (demotion candidates)
  _host_leaves   unlocked leaves with no device page at all (host eviction deletes them)
  _host_dups     unlocked nodes with a page on both tiers in some space (host eviction may drop
                 those host copies: the device still has the data)

The HostTier object (host_tier.py) holds the pools, the write policy, the copies decided and
the counters; what goes to the host and what leaves it is decided here, together with device
eviction, so this is a mixin of ShadowIndex sharing its nodes, queues and deletion. Without a
host tier (`tier` is None) nothing here runs: where a host-tier step applies, the index tests
`tier` inline instead of calling a hook that does nothing, because several of those places run
once per node on every step.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from hybridkv.block_manager.eviction_policy import EvictionQueue
from hybridkv.block_manager.host_tier import SELECTIVE_MIN_HITS, HostTier
from hybridkv.block_manager.page_keys import next_chain, storage_key
from hybridkv.block_manager.shadow_node import TOMBSTONE, ShadowNode


class IndexHostTier:
    """Host copies of node shadows: writes, demotion, host eviction, load-back, storage reads.
    Uses the index's spaces, whole/windows, policy, chain_seed, _nodes, _seq, _root, _key,
    first_window_page, _ledger_add, _on_device, _sync, _touch, _update_tail_point, _drop_device,
    _is_dead_leaf, _delete and _note (KV cache events)."""

    def _init_host_tier(self, host_tier: HostTier | None) -> None:
        """Set up the host-tier state: the host queues join the eviction queues a deleted node leaves."""
        self.tier = host_tier
        self.num_host_pins = 0  # pin_host calls not yet unpinned (0 when idle)
        if host_tier is not None:
            self._dev_unlocked = EvictionQueue(self.policy)
            self._host_leaves = EvictionQueue(self.policy)
            self._host_dups = EvictionQueue(self.policy)
            self._queues += (self._dev_unlocked, self._host_leaves, self._host_dups)

    def _write_hot(self, nodes: Sequence[ShadowNode]) -> None:
        """Under write_through_selective, write the nodes of an admitted hit (ShadowIndex.touch)
        that are now hit often enough."""
        if self.tier.write_policy == "write_through_selective":
            for nd in nodes:
                if nd.hit_count >= SELECTIVE_MIN_HITS:
                    self.write_node(nd)

    def _loads(self, hit: list[ShadowNode]) -> tuple[dict[str, list[int]], int]:
        """For a hit of len(hit) pages: space -> indices into hit whose page in that space must be
        loaded back (only the pages the request will read: every node in whole-history spaces,
        the last window in windowed ones), and the number of hit pages that need any load."""
        best = len(hit)
        loads: dict[str, list[int]] = {}
        need_host = [False] * best
        for s in self.spaces:
            first = self.first_window_page(s, best) if s in self.windows else 0
            idx = [i for i in range(first, best) if hit[i].shadows[s] is None]
            if idx:
                loads[s] = idx
                for i in idx:
                    need_host[i] = True
        return loads, sum(need_host)

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
        self._note(node)
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
        self._note(node)

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
                # belongs in the host-copy queue even though it keeps its device pages (e.g. an
                # interior node whose c4 page was written and whose full page was not).
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
                self._note(child)
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
                        self._note(child)
                    else:
                        unused.append((s, h))
            walked.append(child)
            node = child
        if walked:
            self._touch(walked, hit=False)
            if self._is_dead_leaf(walked[-1]):  # its trailing windowed pages were not read
                self._delete(walked[-1])
        return n, unused

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
        self._note(node)
        self.tier.transfers.load(space, h, device_page)
        self.tier.stats.loaded_pages[space] += 1
        self._sync(node)

    def _check_host_tier(self) -> None:
        """Host pages are held once, the host pools agree with the index, and the host queues
        hold exactly their candidates (tests only)."""
        host_referenced: dict[str, set[int]] = {n: set() for n in self.spaces}
        for nd in self._nodes:
            for s, h in nd.host.items():
                if h is not None:
                    assert h not in host_referenced[s], f"space {s!r}: host page {h} in the index twice"
                    host_referenced[s].add(h)
        if self.tier is None:
            return
        for s in self.spaces:
            self.tier.pools[s].check_invariants(host_referenced[s] | self.tier.held[s])
        unlocked = {nd for nd in self._nodes if nd.full_lock_ref == 0}
        dev = {nd for nd in unlocked if any(nd.shadows[s] is not None for s in self.whole)}
        leaves = {nd for nd in unlocked if not nd.children and not self._on_device(nd) and not nd.host_pins}
        dups = {nd for nd in unlocked if any(nd.shadows[s] is not None and nd.host[s] is not None for s in nd.host)}
        assert set(self._dev_unlocked) == dev, "the demotion queue differs from the unlocked device nodes"
        assert set(self._host_leaves) == leaves, "the host-eviction queue differs from the host-only leaves"
        assert set(self._host_dups) == dups, "the host-copy queue differs from the nodes on both tiers"
