"""The attention-backend contracts every backend implements.

Two families, by the attention they compute:

  AttentionBackend        paged multi-head attention of the dense models (Llama, Qwen, Mistral,
                          Gemma-3): each layer writes its new K/V into the space's pool and
                          attends over the pages the step's metadata names. Implemented by
                          torch_native (the CPU reference, with C++ kernels), triton and xformers;
                          chosen by name in registry.py.
  HybridAttentionBackend  DeepSeek-V4's hybrid layer: a sliding window plus compressed entries
                          (C4 through the indexer's top-k, or C128), with attention sinks.
                          Implemented by hybrid_v4 (torch) and triton_attention/hybrid_v4; the
                          model binds the one matching the resolved backend name.

A backend keeps no per-request state: everything a step reads comes in the metadata (block
tables turned into slot mappings, the step's plan), so any backend can serve any step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class AttentionBackend(ABC):
    name: str
    # Whether decodes read the metadata's decode tiles (the runner skips building them when not).
    needs_decode_tiles: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_slots, D]
        v_cache: torch.Tensor,
        meta: Any,  # AttentionMetadata
        space: str,
        scale: float,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the step's K/V into the space's pool (meta's slot mapping), then return the
        attention output [T, H, D] of every row, or of out_rows only ([len(out_rows), H, D], rows
        ascending; every row's K/V is written either way). Host-tier load-backs into this layer's
        pages (meta.kv_loads) are waited for before the pool is read."""


class HybridAttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] roped queries
        swa_cache: torch.Tensor,  # [swa slots, D] (new keys already written)
        meta: Any,  # HybridAttentionMetadata
        sinks: torch.Tensor,  # [H]
        scale: float,
        entry_cache: torch.Tensor | None = None,  # [entry slots, D] compressed entries of this layer
        entry_space: str | None = None,  # "c4" / "c128"
        indexer: Any = None,  # IndexerQuery: CSA layers select their top-k entries with it
        hisparse: Any = None,  # HiSparseLayer: CSA decode rows read the hot buffer
    ) -> torch.Tensor:
        """Attention output [T, H, D]: each query block over its window of swa_cache plus the
        compressed entries it reads (all C128 entries, or the indexer's top-k C4 entries), with
        the per-head sinks in the softmax."""
