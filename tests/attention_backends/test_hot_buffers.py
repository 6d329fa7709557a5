"""HotBuffers (HiSparse bookkeeping) against a plain-Python LRU model.

Invariants checked:
- after an assign, every requested entry sits in the slot returned for it, and hits are exactly
  the entries that were already in the buffer;
- a miss takes an empty slot first, else the least-recently-used slot that no entry of the same
  call needs (ties towards the lower slot): the same choice as the reference model;
- nothing is ever held twice in one buffer row; released rows are empty and reusable;
- a selection wider than the buffer, or a buffer smaller than top-k, is refused with a clear error.
"""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.attention_backends.hisparse_buffers import NO_ENTRY, HotBuffers


class ReferenceLRU:
    def __init__(self, size: int) -> None:
        self.held = [NO_ENTRY] * size
        self.used = [0] * size
        self.clock = 0

    def assign(self, entries: list[int]) -> tuple[list[int], list[bool]]:
        self.clock += 1
        slots, missed = [None] * len(entries), [False] * len(entries)
        hits = {e: self.held.index(e) for e in entries if e != NO_ENTRY and e in self.held}
        free = sorted((s for s in range(len(self.held)) if s not in hits.values()),
                      key=lambda s: (-1 if self.held[s] == NO_ENTRY else self.used[s], s))
        j = 0
        for i, e in enumerate(entries):
            if e == NO_ENTRY:
                continue
            if e in hits:
                slots[i] = hits[e]
            else:
                slots[i], missed[i] = free[j], True
                j += 1
        for i, e in enumerate(entries):
            if e != NO_ENTRY:
                self.held[slots[i]], self.used[slots[i]] = e, self.clock
        return slots, missed


@pytest.mark.parametrize("size,k", [(4, 4), (8, 4), (16, 3)])
def test_assign_matches_a_python_lru(size, k):
    rng = random.Random(size * 10 + k)
    buffers = HotBuffers(num_layers=2, max_requests=3, size=size, topk=k)
    rows = [buffers.acquire(f"r{i}") for i in range(3)]
    refs = {(layer, r): ReferenceLRU(size) for layer in range(2) for r in rows}
    for step in range(60):
        layer = rng.randrange(2)
        universe = rng.choice([6, 12, 40])  # histories that fit, and ones that do not
        sel = [[rng.sample(range(universe), min(k, universe))[j] if rng.random() > 0.15 else NO_ENTRY
                for j in range(k)] for _ in rows]
        sel = [[e if e not in s[:j] else NO_ENTRY for j, e in enumerate(s)] for s in sel]  # distinct per row
        got = buffers.assign(layer, torch.tensor(rows), torch.tensor(sel))
        for i, r in enumerate(rows):
            want_slots, want_missed = refs[(layer, r)].assign(sel[i])
            for j, e in enumerate(sel[i]):
                if e == NO_ENTRY:
                    assert int(got.slots[i, j]) == 0 and not bool(got.missed[i, j]), "an empty selection must read the null slot"
                    continue
                assert int(got.slots[i, j]) == 1 + r * size + want_slots[j], f"step {step}: slot choice differs from LRU"
                assert bool(got.missed[i, j]) == want_missed[j], f"step {step}: hit/miss differs"
                assert int(buffers.entry[layer, r, want_slots[j]]) == e
        buffers.check_invariants()
    s = buffers.stats
    assert s.lookups == s.hits + s.loaded and 0 < s.hits < s.lookups


def test_release_empties_the_row_and_reuses_it():
    buffers = HotBuffers(num_layers=1, max_requests=1, size=4, topk=2)
    row = buffers.acquire("a")
    buffers.assign(0, torch.tensor([row]), torch.tensor([[3, 5]]))
    buffers.assign(0, torch.tensor([row]), torch.tensor([[3, 7]]))
    assert buffers.request_counts("a") == (4, 1)
    with pytest.raises(RuntimeError, match="no free hot-buffer row"):
        buffers.acquire("b")
    buffers.release("a")
    assert buffers.num_active == 0 and bool((buffers.entry == NO_ENTRY).all())
    assert buffers.request_counts("a") == (4, 1), "a preempted request keeps its counts"
    buffers.forget("a")
    assert buffers.num_tracked == 0
    assert buffers.acquire("b") == row
    buffers.check_invariants()


def test_inserts_count_separately_and_make_later_selections_hits():
    buffers = HotBuffers(num_layers=1, max_requests=1, size=8, topk=4)
    row = torch.tensor([buffers.acquire("a")])
    ins = buffers.assign(0, row, torch.arange(6)[None, :], insert=True)
    assert bool(ins.missed.all()) and buffers.stats.inserted == 6 and buffers.stats.lookups == 0
    sel = buffers.assign(0, row, torch.tensor([[5, 0, 2, NO_ENTRY]]))
    assert not bool(sel.missed.any()) and buffers.stats.loaded == 0 and buffers.stats.hits == 3


def test_sizes_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="smaller than the model's index_topk"):
        HotBuffers(num_layers=1, max_requests=1, size=3, topk=4)
    buffers = HotBuffers(num_layers=1, max_requests=1, size=4, topk=4)
    with pytest.raises(ValueError, match="do not fit"):
        buffers.assign(0, torch.tensor([buffers.acquire("a")]), torch.arange(5)[None, :])
