"""What the KV cache manager keeps per request (its page tables, row, lock and publishing
thresholds), what a prefix hit is, and how many pages one request holds at most in each space."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from hybridkv.block_manager.shadow_index import LockReceipt, ShadowNode
from hybridkv.block_manager.space_spec import SpaceSpec


def request_pages_needed(specs: Sequence[SpaceSpec], num_tokens: int, page_size: int, chunk_tokens: int,
                         prefix_caching: bool) -> dict[str, int]:
    """Most pages one request of num_tokens holds at once in each space, computed in chunks of at
    most chunk_tokens: every page of a whole-history space, the live window of a windowed one."""
    live = windowed_live_pages(specs, chunk_tokens, page_size, prefix_caching)
    return {s.name: min(s.pages_for(num_tokens, page_size), live.get(s.name, 1 << 62)) for s in specs}


def windowed_live_pages(specs: Sequence[SpaceSpec], chunk_tokens: int, page_size: int,
                        prefix_caching: bool) -> dict[str, int]:
    """Most pages one request holds at once in each windowed space while it computes chunks of
    chunk_tokens (1: decoding). Without prefix caching that is each space's own window
    (SpaceSpec.max_live_pages). With it, the request's lock pins the index's copies of its
    recent pages back to where its widest window starts, in every windowed space the index
    records at once (one SWA lock per node, shadow_index.py): each of those then holds as many
    pages as the widest. A space no hit reads is not recorded (ShadowIndex.unread): its own."""
    live = {s.name: s.max_live_pages(chunk_tokens, page_size) for s in specs if s.windowed}
    if not prefix_caching:
        return live
    recorded = [s.name for s in specs if s.windowed and s.pages_read_at_page_end(page_size) > 0]
    widest = max((live[n] for n in recorded), default=0)
    return {n: max(k, widest) if n in recorded else k for n, k in live.items()}


@dataclass
class PrefixHit:
    """A prefix hit: nodes of the shadow index, tokens they cover, and per space how many of
    those tokens the space serves from cache (windowed spaces only serve their last window;
    the tokens before it are never read again)."""

    nodes: list[ShadowNode]
    num_tokens: int
    per_space_tokens: dict[str, int] = field(default_factory=dict)
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    loads: dict[str, list[int]] = field(default_factory=dict)  # space -> node indices to load back
    tail: SwappedTail | None = None  # a swapped-out partial page that continues the hit


@dataclass
class SwappedTail:
    """A swapped-out request's partial last page: on the host, outside the index (a partial page
    is no prefix node). It continues the request's first num_pages whole pages."""

    num_pages: int
    num_tokens: int  # tokens in the partial page
    host_pages: dict[str, int]  # space -> host page (spaces whose table had that page)


@dataclass
class RequestPages:
    tables: dict[str, list[int]]
    row: int  # this request's row in every space's BlockTable
    namespace: Hashable = None
    priority: int = 0  # eviction priority of the pages it inserts (the "priority" eviction policy)
    num_inserted_pages: int = 0  # whole pages already recorded in the prefix index
    num_released_pages: dict[str, int] = field(default_factory=dict)  # windowed spaces
    anchor: ShadowNode | None = None  # node of the last recorded page
    receipt: LockReceipt | None = None
    # Hot-path thresholds (token counts): allocate/commit below them have nothing to do, so a
    # decode step costs O(1) per request except when it crosses a page or window boundary.
    grow_at: int = 0  # the first token count some space needs a new page for
    commit_at: int = 0  # the next whole page to publish, or the next window release
    decoding: bool = False  # past its prompt: its decoded pages are published in batches


class TablePages(Sequence):
    """table[start:end] seen at its original indices (insert reads only the new pages), without
    copying the request's whole table every step."""

    def __init__(self, table: list[int], start: int, end: int) -> None:
        self.table, self.start, self.end = table, start, end

    def __len__(self) -> int:
        return self.end

    def __getitem__(self, i: int) -> int:
        if not self.start <= i < self.end:
            raise IndexError(f"page {i} outside the inserted range [{self.start}, {self.end})")
        return self.table[i]
