"""RMSNorms of DeepSeek-V4: weighted (weight kept in float32) and unweighted."""
from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), the scale computed in float32, result in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(nn.Module):
    """Weighted RMSNorm; like transformers, normalises and multiplies in float32, casts once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)
