"""Torch-native paged attention: the CPU reference backend.

Decode queries of the whole batch run together: keys are gathered from the pages (padded only
to the longest context in the batch, masked) and attention is two batched matmuls per KV head
group, softmax in float32. (On CPU this beats scaled_dot_product_attention for one query
token, which in bfloat16 falls back to a slow path.) Each prefill chunk runs as one 4-D
scaled_dot_product_attention call with a causal (and sliding-window) mask offset by the
tokens already in the cache; a chunk that starts at position 0 reads its own K/V directly.
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
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return self._decode(q, k_cache, v_cache, sm.decode_key_slots, sm.decode_mask, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, sm.decode_key_slots, sm.decode_mask, scale)
        gqa = q.shape[1] != k.shape[1]
        for p in sm.prefills:
            qs, qe = p.query_start, p.query_end
            if p.mask is None:  # starts at position 0, no window: its keys are exactly this chunk's
                kp, vp = k[qs:qe], v[qs:qe]
            else:
                kp, vp = k_cache[p.key_slots], v_cache[p.key_slots]
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
                kp.transpose(0, 1).unsqueeze(0),  # [1, Hkv, Lk, D]
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[qs:qe] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B, Lk]
        mask: torch.Tensor | None,  # [B, 1, 1, Lk]
        scale: float,
    ) -> torch.Tensor:
        B, H, D = q.shape
        hkv = k_cache.shape[1]
        kd = k_cache[slots]  # [B, Lk, Hkv, D]
        vd = v_cache[slots]
        qg = q.view(B, hkv, H // hkv, D)  # query heads grouped by the KV head they share
        scores = torch.matmul(qg, kd.permute(0, 2, 3, 1)).float() * scale  # [B, Hkv, G, Lk]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vd.transpose(1, 2)).reshape(B, H, D)  # [B, Hkv, G, D] -> [B, H, D]
