"""Eviction policies for the shadow prefix index (docs/architecture.md, "The shadow index"), and the O(1) structure they order.

A policy splits candidates into *classes* (`bucket`): the lowest class is evicted first, and
within a class the least recently touched node goes first. That covers every policy here:
  lru       one class
  lfu       class = hit count (fewest hits first)
  slru      class = probationary (hit < slru_threshold times) before protected
  priority  class = max priority of the requests that inserted the node
so `EvictionQueue` keeps one insertion-ordered dict per class plus the sorted class keys:
add / discard / touch are O(1) (plus O(log classes) when a class appears), and the next victim
is the front of the lowest class. Nothing scans or sorts the tree (SGLang keeps per-component
LRU lists the same way; vLLM's free-block queue is the one-class case).

Which nodes are candidates is the index's business (block_manager/index_eviction.py).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable, Iterator, Protocol


class EvictionStats(Protocol):
    """What a policy may look at (ShadowNode provides it)."""

    last_access: int  # monotone clock tick of the last match/insert/unlock that touched the node
    hit_count: int  # how many requests reused the node
    priority: int  # max priority of the requests that inserted the node


@dataclass(frozen=True)
class EvictionPolicy:
    """name: lru | lfu | slru | priority."""

    name: str = "lru"
    slru_threshold: int = 2  # SLRU: nodes hit at least this often sit in the protected segment

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.name!r}; choose one of {sorted(POLICIES)}")

    def bucket(self, node: EvictionStats) -> tuple:
        """The node's eviction class: lower classes go first; LRU order within a class."""
        if self.name == "lru":
            return ()
        if self.name == "lfu":
            return (node.hit_count,)
        if self.name == "slru":
            return (node.hit_count >= self.slru_threshold,)
        return (node.priority,)

    def key(self, node: EvictionStats) -> tuple:
        """The full order as a sort key (documentation and tests; the index never sorts)."""
        return (*self.bucket(node), node.last_access)


POLICIES = ("lru", "lfu", "slru", "priority")


class EvictionQueue:
    """Candidates in eviction order: per class an insertion-ordered dict (front = least recently
    touched), classes kept sorted. `add` of a present node moves it to the back of its (new) class."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._classes: dict[tuple, dict[Hashable, None]] = {}
        self._keys: list[tuple] = []  # sorted class keys with a non-empty dict
        self._where: dict[Hashable, tuple] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, node: Hashable) -> bool:
        return node in self._where

    def add(self, node: EvictionStats) -> None:
        self.discard(node)
        key = self.policy.bucket(node)
        members = self._classes.get(key)
        if members is None:
            members = self._classes[key] = {}
            bisect.insort(self._keys, key)
        members[node] = None
        self._where[node] = key

    def discard(self, node: Hashable) -> None:
        key = self._where.pop(node, None)
        if key is None:
            return
        members = self._classes[key]
        del members[node]
        if not members:
            del self._classes[key]
            self._keys.pop(bisect.bisect_left(self._keys, key))

    def __iter__(self) -> Iterator:
        """Eviction order, lazily: a caller that stops after k nodes pays for k. The queue must
        not change while a caller iterates (take the victim, stop, mutate, iterate again)."""
        for key in self._keys:
            yield from self._classes[key]

    def first(self):
        if not self._keys:
            return None
        return next(iter(self._classes[self._keys[0]]))
