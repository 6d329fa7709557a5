"""The core's scaling contracts (issue "Scale the core"): allocation is all-or-nothing, lock moves
and eviction cost what they touch (never the tree), namespace roots go when empty, the null page
is never handed out, and a blocked request neither flushes the cache nor bumps hit counts."""
from __future__ import annotations

import pytest

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.block_manager.shadow_index import ShadowIndex
from hybridkv.block_manager.space_spec import NULL_PAGE, SpaceSpec
from hybridkv.engine.request import Request
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.scheduler import Scheduler, SchedulerConfig

P = 4
FULL = SpaceSpec("full", bytes_per_slot=8)
SWA = SpaceSpec("swa", bytes_per_slot=8, window=8)


def _kv(pages=32, specs=(FULL,), policy="lru") -> KVCacheManager:
    return KVCacheManager(list(specs), {s.name: pages for s in specs}, P, True, policy)


def _publish(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    assert kv.allocate(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens), prompt_done=True)
    kv.retire(rid, tokens, len(tokens), turn_done=True)


class _NoScan(set):
    """A node set that fails the test if anything but check_invariants iterates it."""

    allowed = 0  # nesting depth of check_invariants calls

    def __iter__(self):
        if not _NoScan.allowed:
            raise AssertionError("the shadow index scanned its whole node set on a hot path")
        return super().__iter__()


def _forbid_scans(kv: KVCacheManager, monkeypatch) -> None:
    kv.index._nodes = _NoScan(kv.index._nodes)
    for owner in (ShadowIndex, KVCacheManager):  # the full recounts may scan; nothing else may
        real = owner.check_invariants

        def allowed(self, _real=real):
            _NoScan.allowed += 1
            try:
                _real(self)
            finally:
                _NoScan.allowed -= 1

        monkeypatch.setattr(owner, "check_invariants", allowed)


def test_failed_allocation_changes_nothing_and_evicts_nothing():
    kv = _kv(pages=12)
    _publish(kv, "a", list(range(16)))  # 4 cached pages
    assert kv.allocate("hold", 28)  # 7 pages in use: 1 free + 4 evictable left
    before = {n.key: n.shadows["full"] for n in kv.index.nodes()}
    for _ in range(50):
        assert not kv.allocate("big", 24), "6 pages cannot come from 1 free + 4 evictable"
    assert {n.key: n.shadows["full"] for n in kv.index.nodes()} == before, "a failed allocation evicted"
    assert not kv.has_request("big")
    assert kv.match_prefix(list(range(16)) + [0]).num_tokens == 16
    assert kv.allocate("fits", 20)  # 5 pages = 1 free + 4 evicted: exactly what it needs
    assert kv.index.num_nodes == 0
    kv.free("fits"), kv.free("hold")
    kv.assert_idle()


def test_failed_allocation_with_a_hit_leaves_locks_and_hit_counts_alone():
    kv = _kv(pages=8)
    toks = list(range(16))
    _publish(kv, "a", toks)
    assert kv.allocate("hold", 12)  # 3 in use, 1 free, 4 cached
    hit = kv.match_prefix(toks + [1] * 20, touch=False)
    counts = [n.hit_count for n in hit.nodes]
    assert not kv.allocate("big", 36, hit, touch_hit=True)  # 9 pages: the hit's 4 + 5 new > 1 free
    assert [n.hit_count for n in hit.nodes] == counts and all(n.full_lock_ref == 0 for n in hit.nodes)
    kv.check_invariants()
    kv.free("hold")
    kv.assert_idle()


def test_head_of_line_request_waits_for_many_steps_without_flushing_the_cache():
    """A request too big for free + evictable pages waits at the head of the queue for 40 steps
    while a running request decodes; the cached prefixes (and their hit counts) are intact
    afterwards and still serve hits."""
    kv = _kv(pages=40)
    prefixes = [[100 + i] * 16 for i in range(3)]  # 3 x 4 cached pages
    for i, p in enumerate(prefixes):
        _publish(kv, f"warm{i}", p)
    counts = {n.key: n.hit_count for n in kv.index.nodes()}
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256), kv)
    runner = Request("runner", [7] * 20, SamplingParams(max_tokens=40), max_tokens=40)
    # 39 pages: its 4-page hit + 35 new, more than 40 - 4 - the runner's pages can ever give.
    big = Request("big", prefixes[0] + [9] * 140, SamplingParams(max_tokens=1), max_tokens=1)
    sched.add(runner)
    sched.add(big)
    for _ in range(40):
        out = sched.schedule()
        assert [s.request.request_id for s in out.scheduled] == ["runner"]
        sched.update_after_step(out)
        runner.append_output_token(7)
        kv.check_invariants()
    assert {n.key: n.hit_count for n in kv.index.nodes() if n.key in counts} == counts, "retries bumped hit counts"
    for p in prefixes:
        assert kv.match_prefix(p + [0], touch=False).num_tokens == 16, "a blocked request flushed the cache"
    sched.finish(runner, runner.status)
    out = sched.schedule()  # room now: big is admitted with its prefix hit, counted once
    assert [s.request.request_id for s in out.scheduled] == ["big"] and out.scheduled[0].start == 16
    first = kv.match_prefix(prefixes[0] + [0], touch=False).nodes[0]
    assert first.hit_count == counts[first.key] + 1
    sched.finish(big, big.status)
    kv.assert_idle()


def test_moving_a_lock_down_one_page_costs_o1_not_the_depth(monkeypatch):
    """Invariant: a request that decodes across a page boundary changes the lock state of the
    new page (and the two ends of its SWA segment) only, whatever the depth of its prefix."""

    def lock_ops(depth: int) -> int:
        kv = _kv(pages=depth + 8, specs=(FULL, SWA))
        toks = [3] * (depth * P)
        assert kv.allocate("r", len(toks) + P)
        kv.commit("r", toks, len(toks))
        ops = []
        for name in ("_full_inc", "_full_dec", "_swa_inc", "_swa_dec"):
            real = getattr(kv.index, name)
            monkeypatch.setattr(kv.index, name, lambda *a, _r=real: ops.append(1) or _r(*a))
        kv.commit("r", toks + [4] * P, len(toks) + P)  # one more whole page
        n = len(ops)
        kv.check_invariants()
        kv.free("r")  # the one O(depth) unlock of a request's life
        return n

    shallow, deep = lock_ops(4), lock_ops(400)
    assert shallow == deep <= 4, f"lock move touched {deep} nodes at depth 400 vs {shallow} at depth 4"


@pytest.mark.parametrize("specs", [(FULL,), (FULL, SWA), (SWA,)], ids=["full", "full+swa", "swa"])
def test_eviction_and_steps_never_scan_the_tree(specs, monkeypatch):
    kv = _kv(pages=64, specs=specs)
    for i in range(12):
        _publish(kv, f"w{i}", [i] * 12 + [50 + i] * 8)
    _forbid_scans(kv, monkeypatch)
    toks = list(range(200, 260))
    hit = kv.match_prefix(toks)
    assert kv.allocate("r", 8, hit)
    for n in range(8, len(toks), 4):  # decode page by page under pressure: allocation evicts
        assert kv.allocate("r", n + 4)
        kv.commit("r", toks, n + 4)
    kv.check_invariants()
    kv.retire("r", toks, len(toks), turn_done=True)
    assert kv.index.evict(specs[0].name, 3) == 3
    kv.assert_idle()


def test_namespace_roots_are_removed_when_empty():
    kv = _kv(pages=16)
    for salt in ("u1", "u2", "u3"):
        assert kv.allocate(salt, 8, namespace=salt)
        kv.retire(salt, [1] * 8, 8, turn_done=True)
    assert set(kv.index._roots) == {"u1", "u2", "u3"}
    kv.reset_prefix_cache()
    assert kv.index._roots == {}, "namespace roots outlived their last node"
    kv.assert_idle()


def test_null_page_is_reserved_in_every_space():
    kv = _kv(pages=5, specs=(FULL, SWA))
    assert kv.allocate("r", 20)
    for name, space in kv.spaces.items():
        assert space.num_free == 0 and space.num_physical_pages == 6
        assert NULL_PAGE not in kv.page_table("r", name), f"{name}: the null page was allocated"
    kv.release_out_of_window("r", 20)
    assert kv.page_table("r", "swa")[:2] == [NULL_PAGE] * 2
    assert kv.block_tables["swa"].tensor[kv.row_of("r"), :2].tolist() == [NULL_PAGE] * 2
    kv.check_invariants()
    kv.free("r")
    kv.assert_idle()


def test_block_table_rows_recycled_before_a_flush_keep_the_last_write():
    """A row freed and reused between two reads must read the new request's pages, never the
    stale NULL writes of the old one (queued writes to one entry: the last wins)."""
    kv = _kv(pages=40)
    for i in range(30):  # many requests through the same row with no read in between
        assert kv.allocate(f"r{i}", 12)
        kv.retire(f"r{i}", [i] * 12, 12, turn_done=True)
    assert kv.allocate("last", 12)
    row = kv.row_of("last")
    assert kv.block_tables["full"].tensor[row, :3].tolist() == kv.page_table("last", "full")
    kv.check_invariants()
    kv.free("last")
    kv.assert_idle()


def test_more_requests_than_the_block_tables_first_rows():
    """The tables start with max_requests rows and grow together: request 40 of a manager sized
    for 4 gets a row in every space, and its table row reads its pages."""
    kv = KVCacheManager([FULL, SWA], {"full": 200, "swa": 200}, P, True, max_requests=4)
    for i in range(40):
        assert kv.allocate(f"r{i}", 9)
    for i in range(40):
        for name in ("full", "swa"):
            row = kv.block_tables[name].tensor[kv.row_of(f"r{i}"), :3].tolist()
            assert row == kv.page_table(f"r{i}", name)
    kv.check_invariants()
    for i in range(40):
        kv.free(f"r{i}")
    kv.assert_idle()
