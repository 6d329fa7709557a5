"""BlockSpace ledger: free + cached + in use == capacity, refcounts never negative."""
import pytest

from hybridkv.block_manager.block_space import BlockSpace, OutOfPagesError
from hybridkv.block_manager.space_spec import SpaceSpec


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
