"""How HiSparse changes the engine's memory plan (DeepSeek-V4 CSA layers).

Without HiSparse every whole-history space (c4, indexer, c128) is charged to the device KV
budget (kv_cache_memory_bytes) page for page. With it, the c4 space is the host mirror: it is
charged to host memory (hisparse_config["mirror_bytes"], default: as many pages as the other
whole-history spaces get), and the device pays instead a fixed hot buffer per decoding request
and CSA layer (max_num_seqs rows x hot_buffer_size entries). At long contexts C4 is the largest
whole-history space, so the same device budget holds several times the decode batch; the
mirror's size is what limits admission then (a request needs all its c4 pages).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.attention_backends.hybrid_metadata import C4
from hybridkv.block_manager.hisparse import HotBuffers
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
    def device_bytes(self) -> int:
        """The hot buffers' device memory (taken from the KV budget)."""
        return self.rows * self.hot_buffer_size * self.entry_bytes

    def mirror_pages(self, bytes_per_page: int) -> int | None:
        return None if self.mirror_bytes is None else max(1, self.mirror_bytes // bytes_per_page)

    def buffers(self, device: torch.device | str) -> HotBuffers:
        """The hot buffers' bookkeeping, on the engine's device (where the hot buffers, the top-k
        and a fused swap-in kernel read it)."""
        return HotBuffers(self.num_layers, self.rows, self.hot_buffer_size, self.topk, device=device)
