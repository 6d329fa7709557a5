"""KV cache events: what a KV-aware router needs to know of which prefixes this engine holds.

The shadow index (index_events.py) records an event whenever a page of a prefix becomes
servable from a tier or stops being so, in the shape vLLM publishes (BlockStored, BlockRemoved,
AllBlocksCleared), so routers built for vLLM's events (llm-d's KV cache indexer, Dynamo) read
them unchanged. The engine drains them after each step and publishes them
(engine/kv_event_publisher.py).

A block here is one page of one prefix in the index. Its hash is the first 8 bytes of the
page's content key (page_keys.py: a SHA-256 chain over the namespace and every token page up to
this one, seeded with a fixed seed, or with the KV fingerprint when a storage tier is attached),
read as an unsigned big-endian integer: the same prefix gets the same hash on every replica of
a configuration. A page counts as held on a tier when its first whole-history space's page is
there (a hit needs every whole-history space, and they move together). `medium` is None for
the device tier (vLLM's default, its GPU cache) and "CPU" for the host tier (HiCache L2).
"""
from __future__ import annotations

from dataclasses import dataclass

HOST_MEDIUM = "CPU"
# Seeds the content keys the event hashes come from when no storage tier seeds them with the KV
# fingerprint: the same on every replica, so equal prefixes get equal hashes.
EVENT_CHAIN_SEED = b"hybridkv-kv-events"


@dataclass(frozen=True)
class BlockStored:
    """Pages now held on `medium`: block_hashes in prefix order, the first one's parent
    parent_block_hash (None: it starts its namespace), token_ids all of their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer held on `medium`."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no page of it is held on any tier."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def block_hash(chain: bytes) -> int:
    """A page's event hash from its content key (the key's first 8 bytes, big-endian)."""
    return int.from_bytes(chain[:8], "big")
