"""Torch-native paged attention: the CPU reference backend.

The KV cache of a layer is head-major, [Hkv, num_slots, D], so gathering any set of slots
gives one contiguous [slots, D] block per KV head.

Decode queries of the whole batch run together: keys are gathered from the pages (padded only
to the longest context in the batch, masked) and attention is two batched matmuls with the
query heads grouped under the KV head they share, softmax in float32. (On CPU this beats
scaled_dot_product_attention for one query token, which in bfloat16 takes a slow path.)
Each prefill chunk runs as one scaled_dot_product_attention call with a causal (and
sliding-window) mask offset by the tokens already in the cache; a chunk that starts at
position 0 reads its own K/V directly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_backends.metadata import AttentionMetadata


_SMALL_DECODE_ELEMENTS = 1 << 16  # gathered key elements below which decode runs in float32


class TorchNativeAttention:
    name = "torch_native"

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
    ) -> torch.Tensor:
        sm = meta.spaces[space]
        k_cache.index_copy_(1, sm.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, sm.slot_mapping, v.transpose(0, 1))
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
                kp, vp = k[qs:qe].transpose(0, 1), v[qs:qe].transpose(0, 1)
            else:
                kp, vp = k_cache[:, p.key_slots], v_cache[:, p.key_slots]  # [Hkv, Lk, D]
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
                kp.unsqueeze(0),
                vp.unsqueeze(0),
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
        k_cache: torch.Tensor,  # [Hkv, num_slots, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B, Lk]
        mask: torch.Tensor | None,  # [B, 1, 1, Lk]
        scale: float,
    ) -> torch.Tensor:
        B, H, D = q.shape
        hkv = k_cache.shape[0]
        kd = k_cache[:, slots]  # [Hkv, B, Lk, D], contiguous
        vd = v_cache[:, slots]
        qg = q.view(B, hkv, H // hkv, D).transpose(0, 1)  # [Hkv, B, G, D]
        if q.dtype != torch.float32 and kd.numel() <= _SMALL_DECODE_ELEMENTS:
            # Small reduced-precision matmuls pay a fixed oneDNN cost larger than the work
            # (about 20 us each in bfloat16 vs 7 us in float32 for one short sequence).
            qg, kd, vd = qg.float(), kd.float(), vd.float()
        scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * scale  # [Hkv, B, G, Lk]
        if mask is not None:
            scores = scores.masked_fill(~mask.view(1, B, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vd.dtype)
        out = torch.matmul(probs, vd).to(q.dtype)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(B, H, D)
