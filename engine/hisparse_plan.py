"""How HiSparse changes the engine's memory plan (DeepSeek-V4 CSA layers).

Without HiSparse every whole-history space (c4, indexer, c128) is charged to the device KV
budget (kv_cache_memory_bytes) page for page. With it, the c4 space is the mirror: its pool is
allocated in host memory (KVCacheLayout.host_spaces; pinned on CUDA) and sized by its own
budget (hisparse_config["mirror_bytes"], default: as many pages as the other whole-history
spaces get), and the device pays instead for hot buffers of a fixed size, one row per running
request and CSA layer (max_num_seqs rows x hot_buffer_size entries), and their slot tables. At
long contexts C4 is the largest whole-history space, so the same device budget holds several
times the decode batch; the mirror's size is what limits admission then (a request needs all
its c4 pages).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridkv.attention_backends.hisparse_buffers import hot_buffer_bytes
from hybridkv.attention_backends.hybrid_metadata import C4
from hybridkv.block_manager.kv_plan import HotBufferShape
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.engine.config import HiSparseConfig


@dataclass(frozen=True)
class HiSparsePlan:
    space: str  # the mirrored space (c4)
    num_layers: int  # CSA layers
    topk: int
    hot_buffer_size: int
    rows: int  # hot-buffer rows: one per running request (max_num_seqs)
    entry_bytes: int  # one entry over every CSA layer
    mirror_bytes: int | None

    @classmethod
    def make(cls, config: HiSparseConfig, layers: tuple[int, int] | None, specs: list[SpaceSpec], page_size: int,
             max_num_seqs: int) -> "HiSparsePlan":
        spec = next((s for s in specs if s.name == C4), None)
        if layers is None or spec is None:
            raise ValueError("enable_hisparse needs a model with compressed sparse attention (DeepSeek-V4 CSA "
                             f"layers); this model's block spaces are {[s.name for s in specs]}")
        num_layers, topk = layers
        size = config.hot_buffer_size or 2 * topk
        if size < topk:
            raise ValueError(f"hisparse_config hot_buffer_size={size} is smaller than the model's index_topk={topk}")
        entry_bytes = spec.bytes_per_page(page_size) // spec.slots_per_page(page_size)
        return cls(C4, num_layers, topk, size, max_num_seqs, entry_bytes, config.mirror_bytes)

    @property
    def shape(self) -> HotBufferShape:
        """The hot buffers as the executor allocates them (KVCacheLayout.hot_buffers)."""
        return HotBufferShape(self.num_layers, self.rows, self.hot_buffer_size, self.topk)

    @property
    def device_bytes(self) -> int:
        """The hot buffers' device memory, slot tables included (taken from the KV budget)."""
        return hot_buffer_bytes(self.shape, self.entry_bytes // self.num_layers)

    @property
    def host_spaces(self) -> frozenset[str]:
        """The spaces whose pool lives in host memory (KVCacheLayout.host_spaces): the mirror."""
        return frozenset({self.space})

    def mirror_pages(self, bytes_per_page: int) -> int | None:
        return None if self.mirror_bytes is None else max(1, self.mirror_bytes // bytes_per_page)
