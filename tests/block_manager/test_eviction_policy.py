"""Eviction policies of the shadow prefix index (block_manager/eviction_policy.py): the order in
which unlocked leaves go follows each policy's key (lru, lfu, slru, priority)."""
from __future__ import annotations

import pytest

from hybridkv.block_manager.block_space import BlockSpace
from hybridkv.block_manager.eviction_policy import EvictionPolicy
from hybridkv.block_manager.shadow_index import ShadowIndex
from hybridkv.block_manager.space_spec import SpaceSpec

P = 4
SEQS = {name: [k] * P for name, k in (("A", 10), ("B", 20), ("C", 30), ("D", 40))}
PRIORITY = {"A": 3, "B": 0, "C": 2, "D": 1}

# Access history built by _index: A, B, C, D inserted in that order (D last), then A matched 3
# times, B twice, C once. So: last access D < A < B < C; hits D 0, C 1, B 2, A 3.
EXPECTED = {
    "lru": ["D", "A", "B", "C"],  # least recently used first
    "lfu": ["D", "C", "B", "A"],  # fewest hits first
    "slru": ["D", "C", "A", "B"],  # probationary (hits < 2: D, C) by LRU, then protected (A, B) by LRU
    "priority": ["B", "D", "C", "A"],  # lowest inserting priority first
}


def _index(policy: str) -> ShadowIndex:
    space = BlockSpace(SpaceSpec("full", bytes_per_slot=8), 8, P)
    index = ShadowIndex({"full": space}, P, EvictionPolicy(policy))
    for name, toks in SEQS.items():
        (page,) = space.allocate(1)
        index.insert(toks, {"full": [page]}, priority=PRIORITY[name])
        space.decref(page)  # the request finished: the page stays cached, unlocked
    for name, times in (("A", 3), ("B", 2), ("C", 1)):
        for _ in range(times):
            assert index.match(SEQS[name]).num_tokens == P
    index.check_invariants()
    return index


def _cached(index: ShadowIndex) -> set[str]:
    return {name for name, toks in SEQS.items() if index.match(toks, touch=False).num_tokens}


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_leaves_are_evicted_in_policy_order(policy):
    index = _index(policy)
    evicted = []
    for _ in SEQS:
        before = _cached(index)
        assert index.evict("full", 1) == 1
        index.check_invariants()
        (gone,) = before - _cached(index)
        evicted.append(gone)
    assert evicted == EXPECTED[policy]
    assert index.num_nodes == 0


def test_orders_differ_between_policies():
    """The scenario separates every pair of policies (so a policy falling back to another's key fails)."""
    orders = [tuple(o) for o in EXPECTED.values()]
    assert len(set(orders)) == len(orders)


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_locked_leaf_is_skipped_and_parent_becomes_a_candidate(policy):
    """A locked leaf is never evicted whatever its key; a parent whose last child goes is next in line."""
    space = BlockSpace(SpaceSpec("full", bytes_per_slot=8), 8, P)
    index = ShadowIndex({"full": space}, P, EvictionPolicy(policy))
    pages = space.allocate(2)
    chain = index.insert([1] * P + [2] * P, {"full": pages})
    for p in pages:
        space.decref(p)
    (other,) = space.allocate(1)
    locked = index.insert([7] * P, {"full": [other]}, priority=-5).last_node
    space.decref(other)
    receipt = index.lock(locked)
    assert index.evict("full", 5) == 2  # the 2-page chain, leaf then parent; the locked leaf stays
    assert index.num_nodes == 1 and chain.last_node not in set(index.nodes())
    index.unlock(receipt)
    assert index.evict("full", 1) == 1
    index.check_invariants()


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        EvictionPolicy("fifo")
