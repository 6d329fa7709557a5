"""Eviction policies for the shadow prefix index (DESIGN.md §4).

A policy only orders candidates: it maps a node's bookkeeping to a sort key, and the node
with the smallest key is evicted first. Which nodes are candidates (unlocked leaves for a
whole-history space, unlocked live shadows for a windowed one) is the index's business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class EvictionStats(Protocol):
    """What a policy may look at (ShadowNode provides it)."""

    last_access: int  # monotone clock tick of the last match/insert that touched the node
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

    def key(self, node: EvictionStats) -> tuple:
        if self.name == "lru":
            return (node.last_access,)
        if self.name == "lfu":
            return (node.hit_count, node.last_access)
        if self.name == "slru":
            # Probationary (hit once) nodes go before protected (hit repeatedly) ones, LRU within.
            return (node.hit_count >= self.slru_threshold, node.last_access)
        return (node.priority, node.last_access)  # priority


POLICIES = ("lru", "lfu", "slru", "priority")
