"""Lightning indexer of CSA layers: its own CSA-style compressor (keys at index_head_dim)
plus per-token queries and head weights; the backend scores and picks the top-k entries.

Score of entry w for query t: Σ_h ω_{t,h} · ReLU(q^I_{t,h} · K^I_w) · c_I^-½, with
ω = weights_proj(x) · n_I^-½ (may be negative) and q^I = RoPE(wq_b(c_q)) (no norm).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.model_executor.models.deepseek_v4.compressor import Compressor
from hybridkv.model_executor.models.deepseek_v4.config import V4Config
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope


class Indexer(nn.Module):
    def __init__(self, cfg: V4Config, rope: InterleavedRope) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps, rope)
        self.rope = rope
        self.scale = self.head_dim**-0.5

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q^I [T, nI, cI] roped, ω [T, nI] float32)."""
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        q = self.rope(q, positions)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w
