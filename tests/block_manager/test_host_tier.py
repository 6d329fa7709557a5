"""The host tier (HiCache L2) in the shadow index and KV cache manager, op by op.

Invariants checked: a demoted node keeps serving hits (match reports what must be loaded back);
write policies copy exactly when they say; a node whose load-back is pending is never evicted
on the host, and no device->host copy targets its host page before the load ran; ledgers exact.
"""
from __future__ import annotations

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.block_manager.space_spec import SpaceSpec

P = 4
SPECS = [SpaceSpec("full", 1, 8), SpaceSpec("swa", 1, 8, window=6)]


def _kv(host: int, policy: str = "write_through", device: int = 16) -> KVCacheManager:
    return KVCacheManager(SPECS, {"full": device, "swa": device}, P, True,
                          host_pages={"full": host, "swa": host}, hicache_write_policy=policy)


def _run(kv: KVCacheManager, rid: str, toks: list[int], touch: bool = False) -> None:
    """Admit (with whatever hit the cache has), compute everything, record, leave."""
    hit = kv.match_prefix(toks, touch=False)
    assert kv.allocate(rid, len(toks), hit, touch_hit=touch)
    kv.take_transfers()
    kv.commit(rid, toks, len(toks), prompt_done=True)
    kv.retire(rid, toks, len(toks), turn_done=True)
    kv.take_transfers()
    kv.check_invariants()


def _evict_device(kv: KVCacheManager) -> None:
    for name, space in kv.spaces.items():
        kv.index.evict(name, space.num_pages)
    kv.take_transfers()
    kv.check_invariants()


def test_demoted_prefix_is_a_host_hit():
    kv = _kv(host=16)
    toks = list(range(13))
    _run(kv, "a", toks)
    _evict_device(kv)
    assert kv.spaces["full"].num_cached == 0, "every device page should be gone"
    hit = kv.match_prefix(toks + [99], touch=False)
    assert hit.num_tokens == 12 and hit.host_tokens == 12 and hit.device_tokens == 0
    assert hit.loads["full"] == [0, 1, 2] and hit.loads["swa"] == [1, 2], "swa loads only its window"
    assert kv.allocate("b", 14, hit)
    t = kv.take_transfers()
    assert len(t.to_device["full"]) == 3 and len(t.to_device["swa"]) == 2
    kv.check_invariants()
    kv.free("b")
    kv.take_transfers()
    kv.assert_idle()


def test_write_back_copies_only_when_the_device_evicts():
    kv = _kv(host=16, policy="write_back")
    _run(kv, "a", list(range(9)))
    assert sum(kv.host_tier.stats.written_pages.values()) == 0, "write_back wrote before any eviction"
    _evict_device(kv)
    assert kv.host_tier.stats.written_pages["full"] == 2


def test_selective_writes_a_node_once_hit_twice():
    kv = _kv(host=16, policy="write_through_selective")
    toks = list(range(9))
    _run(kv, "a", toks)
    assert sum(kv.host_tier.stats.written_pages.values()) == 0
    _run(kv, "b", toks, touch=True)  # hit 1 (insert counts the recording) ...
    _run(kv, "c", toks, touch=True)  # ... hit 2: hot now
    assert kv.host_tier.stats.written_pages["full"] == 2
    _evict_device(kv)
    assert kv.match_prefix(toks, touch=False).host_tokens == 8


def test_host_eviction_never_takes_a_node_whose_load_back_is_pending():
    """A host hit is admitted (its load is decided, not yet run); then other requests fill the
    host so that write-through must evict there. The loading node's host page survives, and no
    device->host copy of the same batch targets it."""
    kv = _kv(host=4, device=32)
    toks = list(range(9))  # 2 whole pages
    _run(kv, "a", toks)
    _evict_device(kv)
    hit = kv.match_prefix(toks, touch=False)
    assert hit.host_tokens == 8
    assert kv.allocate("b", 9, hit)
    pending = {s: dict(c) for s, c in kv.host_tier.transfers.to_device.items()}
    sources = {s: set(c.values()) for s, c in pending.items()}
    # Pressure: other prompts recorded with write-through while the load is still pending.
    for i in range(3):
        other = [100 + 10 * i + j for j in range(9)]
        hit_o = kv.match_prefix(other, touch=False)
        assert kv.allocate(f"o{i}", 9, hit_o)
        kv.commit(f"o{i}", other, 9)
    assert kv.host_tier.stats.host_evicted_nodes + kv.host_tier.stats.host_copies_dropped + \
        kv.host_tier.stats.write_failures > 0, "the host should have been under pressure"
    t = kv.take_transfers()
    assert t.to_device == pending, "the pending load-back changed"
    for s, dst in t.to_host.items():
        assert not set(dst) & sources.get(s, set()), "a device->host copy overwrote a load-back's source"
    for node in hit.nodes:
        for s in ("full",):
            assert node.host[s] in sources[s], "the loading node lost its host copy"
    kv.check_invariants()
    for rid in ("b", "o0", "o1", "o2"):
        kv.free(rid)
    kv.take_transfers()
    kv.assert_idle()


def test_a_host_pinned_chain_is_never_host_evicted_until_unpinned():
    """A host-only chain (demoted here, as a storage read records one) pinned at its last node:
    write-through of other prompts under host pressure evicts around it, never it (it is not a
    host-eviction candidate; its ancestors have children). Unpinned, it is the next victim.
    The pin count goes back to zero; ledgers and queues stay exact throughout."""
    kv = _kv(host=4, device=32)
    toks = list(range(9))  # 2 whole pages
    _run(kv, "a", toks)
    _evict_device(kv)
    index = kv.index
    last = index.node_at(toks, None, 2)
    assert last is not None and last.depth == 2 and all(p is None for p in last.shadows.values())
    index.pin_host(last)
    kv.check_invariants()
    for i in range(3):  # write-through of new prompts wants the pinned chain's host pages
        _run(kv, f"o{i}", [100 + 10 * i + j for j in range(9)])
    st = kv.host_tier.stats
    assert st.host_copies_dropped + st.write_failures > 0, "the host should have been under pressure"
    assert st.host_evicted_nodes == 0, "a host-only node was evicted while the only ones were pinned"
    assert kv.match_prefix(toks, touch=False).host_tokens == 8, "a pinned chain was host-evicted"
    index.unpin_host(last)
    assert index.num_host_pins == 0
    kv.check_invariants()
    _run(kv, "o3", [200 + j for j in range(9)])  # now the chain is the host-eviction victim
    assert kv.match_prefix(toks, touch=False).host_tokens < 8
    kv.assert_idle()


def test_a_demotion_that_fails_halfway_still_queues_the_host_copies_it_made():
    """Demoting an interior node writes its whole-history spaces to the host one by one; when a
    later space has no host room, the node keeps its device pages, but the spaces already
    written are now on both tiers, so the node must be in the host-copy queue (found by the
    host-tier state machine, seed 50172935174670999716658640504820591077). Here: the only host
    page of "full" holds the node's demoted, pinned child, so the node's c4 page gets a host
    copy and its full page cannot."""
    specs = [SpaceSpec("c4", 1, 8), SpaceSpec("full", 1, 8)]
    kv = KVCacheManager(specs, {"c4": 16, "full": 16}, P, True, host_pages={"c4": 16, "full": 1},
                        hicache_write_policy="write_back")
    _run(kv, "a", list(range(9)))  # two full pages: an interior node and its leaf
    interior = next(iter(kv.index._root(None, create=False).children.values()))
    (leaf,) = interior.children.values()
    kv.index.evict("full", 1)  # the leaf goes to the host, taking the only full host page
    kv.take_transfers()
    assert leaf.shadows["full"] is None and leaf.host["full"] is not None
    kv.index.pin_host(leaf)  # host eviction must go around it
    assert not kv.index._demote(interior), "no host room for the interior node's full page"
    assert interior.host["c4"] is not None and interior.shadows["c4"] is not None
    kv.check_invariants()
    kv.index.unpin_host(leaf)
    kv.take_transfers()
    kv.assert_idle()
