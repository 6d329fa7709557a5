"""Torch-native paged attention: the CPU reference backend.

Decode queries of the whole batch run as one scaled_dot_product_attention call over keys
gathered from the pages (padded only to the longest context in the batch, masked); each
prefill chunk runs as its own call with a causal (and sliding-window) mask offset by the
tokens already in the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_backends.metadata import AttentionMetadata


class TorchNativeAttention:
    name = "torch_native"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        space: str,
        scale: float,
    ) -> torch.Tensor:
        sm = meta.spaces[space]
        k_cache.index_copy_(0, sm.slot_mapping, k)
        v_cache.index_copy_(0, sm.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        gqa = q.shape[1] != k.shape[1]
        if nd:
            # [Bd, Lk, Hkv, D] -> [Bd, Hkv, Lk, D]
            kd = k_cache[sm.decode_key_slots].transpose(1, 2)
            vd = v_cache[sm.decode_key_slots].transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=sm.decode_mask, scale=scale, enable_gqa=gqa)
            out[:nd] = o.squeeze(2)
        for p in sm.prefills:
            qp = q[p.query_start : p.query_end].transpose(0, 1)  # [H, q, D]
            kp = k_cache[p.key_slots].transpose(0, 1)  # [Hkv, Lk, D]
            vp = v_cache[p.key_slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
            )
            out[p.query_start : p.query_end] = o.transpose(0, 1)
        return out
