"""Manifold-constrained hyper-connections (mHC): the residual is hc_mult parallel streams.

Each sublayer (attention, MoE) reads one collapsed stream and writes back into all streams:
    pre, post, comb = f(streams)          (comb made doubly stochastic by Sinkhorn)
    y = F(norm(Σ_i pre_i X_i));  X'_k = post_k·y + Σ_j comb[j,k]·X_j
All mixing weights are computed in float32 (the parameters stay float32 in every dtype).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridkv.model_executor.cpu_kernels import fused_ops
from hybridkv.model_executor.models.deepseek_v4.norms import rms_normalize


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [T, n, n] made doubly stochastic in place: columns, then (rows, columns) iters - 1 times,
    each divided by its sum + eps. On the CPU one fused pass (model_executor/cpu_kernels:
    hc_sinkhorn_): in torch it is 3 x iters small ops over the whole [T, n, n], which cost more
    than the sublayer's matmuls for a prefill chunk of a small model."""
    if comb.is_cpu and comb.dtype == torch.float32 and comb.is_contiguous() and (ops := fused_ops()):
        return ops.hc_sinkhorn_(comb, iters, eps)
    # In place (the same arithmetic as out-of-place; allocating each step cost more than the divisions).
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return comb


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, d] -> (collapsed [T, d], post [T, n], comb [T, n, n]) (weights float32)."""
        n, eps = self.n, self.hc_eps
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + eps
        sinkhorn_(comb, self.iters, eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X' = post ⊗ out + combᵀ X (comb is not symmetric: sum over its first axis)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams before the last norm (no post/comb)."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden))
        self.hc_base = nn.Parameter(torch.empty(hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
