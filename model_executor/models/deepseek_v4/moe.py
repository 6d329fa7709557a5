"""DeepSeek-V4 MoE: hash-routed or top-k routed experts plus one shared expert.

Router scores s = score_fn(W_r v) (sqrt-softplus for V4). `moe` layers pick the top-k of
s + correction bias (the bias only selects); `hash_moe` layers take the experts from a
frozen token-id table. Weights are the selected scores renormalised, times the routed
scaling factor. Every expert (shared included) is a SwiGLU with clamped pre-activations.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridkv.model_executor.models.deepseek_v4.config import V4Config
from hybridkv.model_executor.models.deepseek_v4.sharding import V4Shard
from hybridkv.model_executor.parallel.state import TensorParallel


class ClampedSwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)  # gate
        self.w3 = nn.Linear(hidden, intermediate, bias=False)  # up
        self.w2 = nn.Linear(intermediate, hidden, bias=False)  # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.top_k = cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.scoring = cfg.scoring_func
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            # float32 in every dtype: it only decides which experts run.
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def _score(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring == "sigmoid":
            return torch.sigmoid(logits)
        if self.scoring == "softmax":
            return torch.softmax(logits, dim=-1)
        raise ValueError(f"DeepSeek-V4 scoring_func {self.scoring!r} is not supported")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self._score(F.linear(x, self.weight))
        if self.hashed:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


class V4MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer_idx: int, shard: V4Shard | None = None,
                 parallel: TensorParallel | None = None) -> None:
        """shard / parallel: this tensor-parallel rank's experts and intermediate columns
        (sharding.py); the router stays whole, so every rank routes every token the same way.
        None: the whole layer."""
        super().__init__()
        shard = shard if shard is not None else V4Shard.of(cfg, None)
        self.parallel = parallel
        self.num_routed = cfg.n_routed_experts
        self.first_expert = shard.experts[0]  # experts[i] is routed expert first_expert + i
        self.gate = Router(cfg, hashed=cfg.mlp_layer_types[layer_idx] == "hash_moe")
        d, lim = cfg.hidden_size, cfg.swiglu_limit
        f_routed = shard.expert_mlp[1] - shard.expert_mlp[0]
        f_shared = shard.shared_mlp[1] - shard.shared_mlp[0]
        self.experts = nn.ModuleList(ClampedSwiGLU(d, f_routed, lim) for _ in range(shard.num_experts))
        self.shared_experts = ClampedSwiGLU(d, f_shared, lim)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        idx, weights = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        # Group tokens by expert: one matmul per expert of this rank that has any token this step.
        flat_idx = idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_routed).tolist()
        token_of = order // idx.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, cnt in enumerate(counts):
            local = e - self.first_expert
            if cnt and 0 <= local < len(self.experts):
                tok = token_of[start : start + cnt]
                y = self.experts[local](x[tok]) * w_sorted[start : start + cnt, None].to(x.dtype)
                out.index_add_(0, tok, y)
            start += cnt
        out = out + self.shared_experts(x)
        # Each rank's part: its experts' (or every expert's columns') share plus the shared
        # expert's columns; one all-reduce sums them.
        return out if self.parallel is None else self.parallel.all_reduce(out)
