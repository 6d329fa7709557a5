"""Regression tests named after the SGLang hybrid-cache bug classes (reference/sglang_cache.md §8).

Each scenario is run twice: against the real code, where it must pass, and against a
deliberately broken variant (monkeypatched in `BROKEN`), where it must fail. So every test
shows, on every CI run, that it can catch the bug it is named after. What the broken
variants tripped when this was written:
  swa_lock_receipts_24153                 'stale swa stamps {1}' (+ swa_lock_ref left on the boundary)
  tombstone_heal_27586                    "space 'swa': decref of page 8 with refcount 0" (double free)
  out_of_window_as_tombstones_27770       "space 'swa': page 0 cannot join the index" (released page recorded)
  no_hit_through_tombstoned_window_30845  "prefix hit reads a tombstoned 'swa' page 4" (wrong hit)
  swa_tail_survives_pressure_28058        'conversation 0 lost its hit' (hit rate collapse)
"""
from __future__ import annotations

import pytest

from hybridkv.block_manager.kv_cache_manager import NULL_PAGE, KVCacheManager
from hybridkv.block_manager.shadow_index import ShadowIndex
from hybridkv.block_manager.space_spec import SpaceSpec

P = 4
SPECS = [SpaceSpec("full", 1, 8), SpaceSpec("swa", 1, 8, window=6)]


def _kv(pages: int = 32) -> KVCacheManager:
    return KVCacheManager(SPECS, {s.name: pages for s in SPECS}, P, True)


def _run(kv: KVCacheManager, rid: str, toks: list[int], release_first: bool = False, free: bool = True):
    hit = kv.match_prefix(toks)
    assert kv.allocate(rid, len(toks), hit)
    if release_first:  # the unfinished/chunked path: out-of-window pages go before the insert
        kv.release_out_of_window(rid, len(toks))
        kv.cache_computed_pages(rid, toks, len(toks))
    else:
        kv.cache_computed_pages(rid, toks, len(toks))
        kv.release_out_of_window(rid, len(toks))
    kv.check_invariants()
    if free:
        kv.mark_boundary(rid)
        kv.free(rid)
        kv.check_invariants()
    return hit.num_tokens


# -- #24153: dec_lock_ref on a node with swa_lock_ref == 0 ------------------------------------------
def scenario_swa_lock_receipts_24153(kv: KVCacheManager) -> None:
    """Two locks on one anchor with different SWA extents, released in the other order while
    the tree grows below the anchor and branches above it: counts return to zero exactly."""
    toks = list(range(24))
    _run(kv, "a", toks)
    idx = kv.index
    anchor = idx.match(toks + [0]).nodes[-1]
    wide, narrow = idx.lock(anchor, 12), idx.lock(anchor, 4)
    _run(kv, "grow", toks + list(range(50, 60)))  # children below the anchor
    _run(kv, "branch", toks[:8] + [99] * 9)  # a branch above it (the page tree's split)
    idx.unlock(wide)
    idx.unlock(narrow)
    kv.check_invariants()
    kv.assert_idle()


def _broken_release_swa(self: ShadowIndex, receipt) -> None:
    """SGLang before receipts: the unlock re-derives the segment from the current window
    instead of stopping at the boundary the lock stamped."""
    if not receipt.swa_held:
        return
    n = -(-max(self.windows.values()) // self.page_size)
    for nd in list(receipt.anchor.path())[:n]:
        nd.swa_lock_ref -= 1
        nd.swa_receipts.discard(receipt.id)
    receipt.swa_held = False


# -- #27586: stale mapping on tombstone recovery double-frees a live page -------------------------
def scenario_tombstone_heal_27586(kv: KVCacheManager) -> None:
    """A's early SWA pages are tombstoned; B recomputes the same tokens and heals the
    tombstones by adopting its own pages. Each page is freed exactly once and the ledgers stay
    exact; a third request hits through the healed pages."""
    toks = list(range(20))
    _run(kv, "a", toks)
    kv.index.evict("swa", 2)  # tombstones pages far from the boundary
    assert any(nd.shadows["swa"] is None for nd in kv.index.nodes())
    _run(kv, "filler", [7] * 12)  # reuses the freed SWA pages elsewhere
    _run(kv, "b", toks[:12] + [5])  # no valid hit below the tombstones: recomputes and heals
    healed = kv.index.match(toks[:12] + [5])
    assert healed.num_tokens == 12
    assert _run(kv, "c", toks[:12] + [6]) == 12
    kv.assert_idle()


_REAL_INSERT = ShadowIndex.insert


def _broken_insert(self: ShadowIndex, token_ids, pages, namespace=None, start=None, priority=0, lock_follows=False):
    """Heals a tombstone and then drops the request's reference to the adopted page as if the
    tree had taken it over, while the request's table still lists it: the request frees it a
    second time when it finishes."""
    res = _REAL_INSERT(self, token_ids, pages, namespace, start, priority, lock_follows)
    for s, idxs in res.adopted.items():
        for i in idxs:
            self.spaces[s].decref(pages[s][i])
    return res


# -- #27770: out-of-window tokens inserted as live SWA (chunked / unfinished path) ----------------
def scenario_out_of_window_as_tombstones_27770(kv: KVCacheManager) -> None:
    """A request releases its out-of-window pages *before* recording them, and another request
    takes the freed pages: the index must record tombstones there, never the released ids."""
    toks = list(range(20))
    hit = kv.match_prefix(toks)
    assert kv.allocate("a", 20, hit)
    kv.release_out_of_window("a", 20)  # pages 0..2 released
    assert kv.allocate("b", 12)  # b now owns some of them
    kv.cache_computed_pages("a", toks, 20)
    kv.check_invariants()
    nodes = sorted(kv.index.nodes(), key=lambda n: n.depth)
    assert [n.shadows["swa"] is None for n in nodes][:3] == [True] * 3
    kv.free("a"), kv.free("b")
    kv.assert_idle()


def _broken_release_out_of_window(self: KVCacheManager, request_id: str, num_computed_tokens: int) -> None:
    """Releases the pages but keeps their ids in the table (the boundary is not forwarded)."""
    req = self._requests[request_id]
    for name, table in req.tables.items():
        window = self.specs[name].window
        if window is None:
            continue
        upto = min(max(0, num_computed_tokens - window + 1) // self.page_size, len(table))
        for i in range(req.num_released_pages.get(name, 0), upto):
            self.spaces[name].decref(table[i])
        req.num_released_pages[name] = upto


# -- #30845: freed SWA represented as reusable -> wrong hits -----------------------------------------
def scenario_no_hit_through_tombstoned_window_30845(kv: KVCacheManager) -> None:
    """Once the window before a boundary is tombstoned, no hit may end there: the match falls
    back to a boundary whose window is live (or to nothing), and the request's table never
    holds a NULL page inside its window."""
    toks = list(range(24))
    _run(kv, "a", toks)
    # Drop every SWA page but the leaf's (a leaf without its window serves no hit and is dropped
    # whole): whole-history shadows stay, the window before the leaf's end is gone.
    for nd in list(kv.index.nodes()):
        if nd.shadows["swa"] is not None and nd.children:
            kv.index._tombstone(nd, "swa")
    hit = kv.match_prefix(toks + [1])
    assert kv.allocate("b", 25, hit)
    table = kv.page_table("b", "swa")
    first = max(0, hit.num_tokens - 6 + 1) // P
    assert all(p != NULL_PAGE for p in table[first:]), "a hit left the window without pages"
    kv.free("b")
    kv.assert_idle()


_REAL_MATCH = ShadowIndex.match


def _broken_match(self: ShadowIndex, token_ids, namespace=None, max_pages=None, touch=True):
    """Matches whole-history shadows only: a tombstoned window still counts as a hit."""
    saved, self.windows = self.windows, {}
    try:
        return _REAL_MATCH(self, token_ids, namespace, max_pages, touch)
    finally:
        self.windows = saved


# -- #28058: SWA evicted while full KV is resident kills valid hits ------------------------------------
def scenario_swa_tail_survives_pressure_28058(kv: KVCacheManager) -> None:
    """Three cached conversations under SWA pressure: eviction tombstones the pages far from
    each conversation's end first, so each one still hits at its last boundary."""
    convs = [[c] * 4 + list(range(c * 100, c * 100 + 20)) for c in range(3)]
    for i, toks in enumerate(convs):
        _run(kv, f"t{i}", toks)
    live = sum(1 for nd in kv.index.nodes() if nd.shadows["swa"] is not None)
    kv.index.evict("swa", live - 3 * 2)  # keep only two pages per conversation
    for i, toks in enumerate(convs):
        assert kv.match_prefix(toks + [1]).num_tokens == 24, f"conversation {i} lost its hit"


def _broken_is_tail_point(self: ShadowIndex, node) -> bool:
    """Plain LRU over every unlocked SWA shadow: no notion of a conversation's tail."""
    return False


BROKEN = {
    "swa_lock_receipts_24153": (ShadowIndex, "release_swa", _broken_release_swa),
    "tombstone_heal_27586": (ShadowIndex, "insert", _broken_insert),
    "out_of_window_as_tombstones_27770": (KVCacheManager, "release_out_of_window", _broken_release_out_of_window),
    "no_hit_through_tombstoned_window_30845": (ShadowIndex, "match", _broken_match),
    "swa_tail_survives_pressure_28058": (ShadowIndex, "_is_tail_point", _broken_is_tail_point),
}
SCENARIOS = {
    "swa_lock_receipts_24153": scenario_swa_lock_receipts_24153,
    "tombstone_heal_27586": scenario_tombstone_heal_27586,
    "out_of_window_as_tombstones_27770": scenario_out_of_window_as_tombstones_27770,
    "no_hit_through_tombstoned_window_30845": scenario_no_hit_through_tombstoned_window_30845,
    "swa_tail_survives_pressure_28058": scenario_swa_tail_survives_pressure_28058,
}


@pytest.mark.parametrize("bug", list(SCENARIOS))
def test_sglang_bug_class_is_designed_out(bug):
    SCENARIOS[bug](_kv())


@pytest.mark.parametrize("bug", list(SCENARIOS))
def test_sglang_bug_class_test_fails_on_broken_variant(bug, monkeypatch):
    """The same scenario against the deliberately broken variant must fail (an invariant,
    a page-ledger assertion or the scenario's own assertion trips)."""
    owner, attr, broken = BROKEN[bug]
    monkeypatch.setattr(owner, attr, broken)
    with pytest.raises(AssertionError):
        SCENARIOS[bug](_kv())
