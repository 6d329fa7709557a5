"""The Triton attention backend: TorchNativeAttention's interface, Triton kernels underneath.

Per layer call: write the step's new K/V into their slots, then decode attention (split-KV) on
the one-token rows and prefill attention on the multi-token chunks, both reading keys through
the block table. It reads the kernel fields of the metadata (block_table, query_start_loc,
context_lens, page_size), not the decode tiles and key slots the torch backend gathers by.

The kernels were decorated when this module was imported: compiled for the GPU, or interpreted
on CPU tensors when TRITON_INTERPRET=1 was set before that import (see __init__.py).
"""
from __future__ import annotations

import torch

from hybridkv.attention_backends.backend import AttentionBackend
from hybridkv.attention_backends.metadata import AttentionMetadata
from hybridkv.attention_backends.triton_attention.common import is_interpreted
from hybridkv.attention_backends.triton_attention.decode_attention import _decode_split_kernel, decode_attention
from hybridkv.attention_backends.triton_attention.kv_write import write_kv
from hybridkv.attention_backends.triton_attention.prefill_attention import prefill_attention


class TritonAttention(AttentionBackend):
    name = "triton"
    needs_decode_tiles = False  # decodes walk the block tables in the kernel

    def __init__(self, num_kv_splits: int = 8, decode_block_n: int = 64, prefill_block_m: int = 64,
                 prefill_block_n: int = 64) -> None:
        """num_kv_splits: key ranges each decode query is split over (SGLang's default, 8, keeps
        an H100 busy for a batch of a few long sequences). Block sizes are powers of two of at
        least 16 (the tl.dot minimum); tests shrink them so tiny shapes cross block boundaries."""
        self.num_kv_splits = num_kv_splits
        self.decode_block_n = decode_block_n
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_slots, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        space: str,
        scale: float,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's attention output, or `out_rows`' only (TorchNativeAttention.forward's
        contract; here every row is attended, then those are taken)."""
        if q.device.type == "cpu" and not is_interpreted(_decode_split_kernel):
            raise RuntimeError(
                "the triton attention backend got CPU tensors but its kernels are compiled for a GPU: "
                "set TRITON_INTERPRET=1 before hybridkv.attention_backends.triton_attention is imported"
            )
        if meta.kv_loads is not None:  # host-tier load-backs into this layer's pages land first
            meta.kv_loads.wait(k_cache, v_cache)
        sm = meta.spaces[space]
        write_kv(k, v, k_cache, v_cache, sm.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens  # decode sequence i is row i
        if nd:
            decode_attention(
                q[:nd], k_cache, v_cache, sm.block_table, meta.context_lens, meta.page_size, sm.window, scale,
                out[:nd], self.num_kv_splits, self.decode_block_n,
            )
        if sm.prefills:
            prefill_attention(
                q, k_cache, v_cache, sm.block_table, meta.query_start_loc, meta.context_lens,
                first_seq=nd, num_seqs=len(sm.prefills),
                max_query_len=max(p.query_end - p.query_start for p in sm.prefills),
                page_size=meta.page_size, window=sm.window, scale=scale, out=out,
                block_m=self.prefill_block_m, block_n=self.prefill_block_n,
            )
        return out if out_rows is None else out[out_rows]
