"""ShadowNode: one page of the shadow prefix index (block_manager/shadow_index.py).

A node is the record every part of the index reads and writes: the tree links and per-space
device pages (shadow_index.py), the lock counts and receipt stamps (index_locks.py), the
eviction statistics and tail-point counts (index_eviction.py), and the host pages and host pins
(index_host_tier.py). It has a module of its own so that each of those parts can build and read
nodes without importing the index class they make up.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterator

TOMBSTONE = None  # shadow of a windowed space whose page was dropped


@dataclass(eq=False, slots=True)  # slots: one node per cached page, created on every page crossing
class ShadowNode:
    key: tuple[int, ...]
    parent: "ShadowNode | None"
    depth: int  # pages from the root to this node, inclusive (the node ends at token depth*P)
    shadows: dict[str, int | None] = field(default_factory=dict)  # device page per space
    host: dict[str, int | None] = field(default_factory=dict)  # host page per space (host tier on)
    children: dict[tuple[int, ...], "ShadowNode"] = field(default_factory=dict)
    full_lock_ref: int = 0
    swa_lock_ref: int = 0
    swa_receipts: set[int] = field(default_factory=set)  # receipt ids whose SWA segment stops here
    last_access: int = 0
    hit_count: int = 0
    priority: int = 0
    boundary: bool = False  # a cached prompt or turn ended here: a likely future match point
    seq: int = 0  # creation order (deterministic tie-breaks; never id() or set order)
    tail_point: bool = False  # leaf, branch point or boundary (counted in the tail_refs above it)
    tail_refs: dict[str, int] = field(default_factory=dict)  # windowed space -> tail points whose window covers this node
    namespace: Hashable = None  # roots only
    chain: bytes = b""  # content key of the prefix ending here (page_keys.py; with a chain seed only)
    # Waiting requests whose storage read recorded the host-only chain ending here (HiCache L3):
    # host eviction leaves it alone until they are admitted, so a read is not lost to the reads
    # of the requests queued behind it. Device state is untouched (no device page is pinned).
    host_pins: int = 0
    published: int = 0  # tiers KV cache events last said it is held on (index_events.py)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> Iterator["ShadowNode"]:
        """This node and its ancestors, root excluded, bottom-up."""
        node = self
        while node.parent is not None:
            yield node
            node = node.parent
