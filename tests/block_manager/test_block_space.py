"""BlockSpace ledger: free + cached + in use == capacity, refcounts never negative."""
import random

import pytest

from hybridkv.block_manager.block_space import BlockSpace, OutOfPagesError
from hybridkv.block_manager.space_spec import SpaceSpec, window_start


def test_allocate_decref_returns_pages_to_free():
    s = BlockSpace(SpaceSpec("full"), 4, 16)
    pages = s.allocate(3)
    assert s.num_free == 1 and s.num_in_use == 3
    for p in pages:
        s.decref(p)
    s.check_invariants()
    assert s.num_free == 4


def test_indexed_page_becomes_cached_not_free_and_frees_on_removal():
    s = BlockSpace(SpaceSpec("full"), 2, 16)
    (p,) = s.allocate(1)
    s.add_to_index(p)
    s.decref(p)
    assert s.num_cached == 1 and s.num_free == 1
    s.incref(p)  # a prefix hit takes it back
    assert s.num_cached == 0 and s.num_in_use == 1
    s.decref(p)
    s.remove_from_index(p)
    s.check_invariants()
    assert s.num_free == 2


def test_out_of_pages_names_the_space():
    s = BlockSpace(SpaceSpec("swa", window=8), 1, 16)
    s.allocate(1)
    with pytest.raises(OutOfPagesError, match="swa"):
        s.allocate(1)


def test_decref_below_zero_is_refused():
    s = BlockSpace(SpaceSpec("full"), 1, 16)
    with pytest.raises(AssertionError):
        s.decref(0)


def test_page_size_must_be_multiple_of_compression_ratio():
    with pytest.raises(ValueError, match="multiple"):
        BlockSpace(SpaceSpec("c4", tokens_per_slot=4), 2, 6)


def test_allocate_after_continues_the_run_while_its_pages_are_free():
    s = BlockSpace(SpaceSpec("full"), 12, 16)
    a = s.allocate(2)  # 1, 2
    b = s.allocate(1)  # 3: someone else's page ends a's run
    assert a == [1, 2] and b == [3]
    assert s.allocate(2, after=b[0]) == [4, 5]  # b's run goes on
    assert s.allocate(2, after=a[-1]) == [6, 7]  # 3 is taken: a starts a new run at the front
    s.check_invariants()


def test_tail_takes_the_newest_freed_page_and_leaves_the_front_run_whole():
    s = BlockSpace(SpaceSpec("full"), 12, 16)
    first = s.allocate(4)
    s.decref(first[1])
    s.decref(first[2])  # the newest freed: page 3
    assert s.allocate(1, tail=True) == [3]
    assert s.allocate(3, after=first[-1]) == [5, 6, 7]
    s.check_invariants()


def test_pages_from_the_free_list_come_in_address_order():
    """Invariant: one allocation's pages taken from the free list are ascending, whatever order
    they were freed in (an evicted prefix is freed deepest page first): the in-place kernels then
    stream forward through a request's keys."""
    s = BlockSpace(SpaceSpec("full"), 12, 16)
    old = s.allocate(8)  # 1..8
    rest = s.allocate(4)  # 9..12: the pool is full
    for p in reversed(old):  # freed 8, 7, ..., 1
        s.decref(p)
    assert s.allocate(5) == [4, 5, 6, 7, 8]  # the oldest freed five, ascending
    assert s.allocate(2, after=rest[-1]) == [2, 3]  # nothing follows 12: the front, ascending
    s.check_invariants()


def test_run_continuation_keeps_the_free_list_exact_and_bounded():
    """Invariant: pages taken out of order leave stale free-list entries that are never handed
    out, and the free list never grows past twice the free pages (plus slack) under any mix."""
    rng = random.Random(1)
    s = BlockSpace(SpaceSpec("full"), 200, 16)
    held: list[int] = []
    for _ in range(20000):
        if held and (rng.random() < 0.5 or s.num_free == 0):
            s.decref(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, min(4, s.num_free))
            after = rng.choice(held) if held and rng.random() < 0.8 else None
            got = s.allocate(n, after=after, tail=rng.random() < 0.3)
            assert len(set(got)) == n and not set(got) & set(held), "a page was handed out twice"
            held += got
        assert len(s._free) <= 2 * s.num_free + 1024
    s.check_invariants()
    for p in held:
        s.decref(p)
    s.check_invariants()
    assert s.num_free == 200


def test_ring_space_pages_hold_ring_slots_but_stand_for_page_size_tokens():
    """A ring space (V4 compressor state): a page is N slots (bytes, pools, copies) but still
    stands for P tokens (block tables, pages_for, window release). Where each token lands in
    the ring is the attention metadata's (tests/attention_backends/test_hybrid_v4.py)."""
    spec = SpaceSpec("state_c4", 1, 100, window=8, ring=8)
    assert spec.slots_per_page(128) == 8 and spec.entries_per_page(128) == 128
    assert spec.bytes_per_page(128) == 800
    assert spec.pages_for(300, 128) == 3 and spec.first_kept_page(300, 128) == 2
    big = SpaceSpec("state_c128", 1, 10, window=128, ring=128)
    assert big.slots_per_page(32) == 32  # a ring wider than the page is just the page
    plain = SpaceSpec("swa", 1, 10, window=128)
    assert plain.slots_per_page(128) == plain.entries_per_page(128) == 128


@pytest.mark.parametrize("kw", [dict(window=None, ring=8), dict(window=9, ring=8), dict(window=8, ring=8, tokens_per_slot=4)])
def test_a_ring_needs_a_raw_windowed_space_no_wider_than_it(kw):
    """A ring overwrites a slot N tokens later, so only a raw windowed space whose window is at
    most N may be one."""
    with pytest.raises(ValueError, match="ring"):
        SpaceSpec("state", bytes_per_slot=1, **kw)


@pytest.mark.parametrize("window,align", [(128, 1), (100, 1), (8, 4), (16, 16), (128, 128), (256, 128)])
@pytest.mark.parametrize("P", [64, 128, 256])
def test_window_release_and_live_page_bounds_agree_with_the_window_rule(window, align, P):
    """Walking every position: release_at(r) is the first count whose window starts past page r,
    and no chunk (a decode's 1 token, a prefill's many) ever needs more pages than
    max_live_pages says -- the bound the engine sizes windowed spaces by."""
    spec = SpaceSpec("s", 1, 1, window=window, align=align)
    for r in range(6):
        n = spec.release_at(r, P)
        assert spec.first_kept_page(n, P) > r >= spec.first_kept_page(n - 1, P), (r, n)
    for chunk in (1, 2, P - 1, P, 2 * P + 3, 1000):
        worst = max((n + chunk - 1) // P - spec.first_kept_page(n, P) + 1 for n in range(4 * window + 4 * P))
        assert worst <= spec.max_live_pages(chunk, P), (chunk, worst)


def test_an_aligned_window_reads_back_only_to_its_open_block():
    """align=a (a compressor pooling every a tokens): position n reads from the start of its
    a-token block minus the overlap (window - a), never the last `window` positions. So HCA's
    state (window = align = 128) at P=128 holds 1 page while decoding, not 2 (+1 straddle)."""
    hca = SpaceSpec("state_c128", 1, 1, window=128, ring=128, align=128)
    assert [window_start(n, 128, 128) for n in (0, 127, 128, 300)] == [0, 0, 128, 256]
    assert [window_start(n, 8, 4) for n in (3, 4, 7, 8, 13)] == [0, 0, 0, 4, 8]  # CSA: block + 4 overlap
    assert hca.first_kept_page(128, 128) == 1  # a page boundary closes the block: nothing before it is read
    assert hca.max_live_pages(1, 128) == 1 and SpaceSpec("swa", 1, 1, window=128).max_live_pages(1, 128) == 2
    with pytest.raises(ValueError, match="align"):
        SpaceSpec("s", 1, 1, window=8, align=16)
    with pytest.raises(ValueError, match="align"):
        SpaceSpec("s", 4, 1, align=4)
