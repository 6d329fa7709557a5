"""One DeepSeek-V4 decoder layer: attention and MoE, each behind an mHC hyper-connection."""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.attention_backends.hybrid_metadata import HybridAttentionMetadata
from hybridkv.model_executor.models.deepseek_v4.attention import V4Attention
from hybridkv.model_executor.models.deepseek_v4.config import V4Config
from hybridkv.model_executor.models.deepseek_v4.mhc import HyperConnection
from hybridkv.model_executor.models.deepseek_v4.moe import V4MoE
from hybridkv.model_executor.models.deepseek_v4.norms import V4RMSNorm
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope
from hybridkv.model_executor.models.deepseek_v4.sharding import V4Shard
from hybridkv.model_executor.parallel.state import TensorParallel


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, i: int, main_rope: InterleavedRope, compress_rope: InterleavedRope,
                 shard: V4Shard, parallel: TensorParallel | None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = V4RMSNorm(d, eps)
        self.attn = V4Attention(cfg, i, main_rope, compress_rope, shard, parallel)
        self.ffn_norm = V4RMSNorm(d, eps)
        self.ffn = V4MoE(cfg, i, shard, parallel)
        self.hc_attn = HyperConnection(cfg.hc_mult, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.hc_ffn = HyperConnection(cfg.hc_mult, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, meta: HybridAttentionMetadata,
                input_ids: torch.Tensor) -> torch.Tensor:
        x, post, comb = self.hc_attn(streams)
        streams = HyperConnection.expand(streams, self.attn(self.attn_norm(x), positions, meta), post, comb)
        x, post, comb = self.hc_ffn(streams)
        return HyperConnection.expand(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)
