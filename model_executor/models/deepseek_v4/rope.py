"""Interleaved partial RoPE on the trailing channels, with optional YaRN frequencies.

DeepSeek-V4 rotates pairs (x[2i], x[2i+1]) of the last `rope_dim` channels of every vector
(layout [nope | rope]). Sliding layers use the "main" parameters (plain θ); CSA/HCA layers
use the "compress" parameters (θ_c, YaRN when configured) for everything they rotate.
YaRN here changes only the frequencies: V4 never rescales cos/sin (attention_factor = 1).
cos/sin are computed from the positions on the fly (no table), so any context length works.
"""
from __future__ import annotations

import math

import torch


def default_inv_freq(theta: float, rope_dim: int) -> torch.Tensor:
    # Same float ops as transformers, so the frequencies agree bit for bit.
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))


def yarn_inv_freq(
    theta: float,
    rope_dim: int,
    factor: float,
    original_max_positions: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rope_dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def inv_freq_from_params(params: dict, rope_dim: int, max_positions: int | None = None) -> torch.Tensor:
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return default_inv_freq(theta, rope_dim)
    if rope_type == "yarn":
        factor = params.get("factor")
        orig = params["original_max_position_embeddings"]
        if factor is None:
            factor = max_positions / orig
        return yarn_inv_freq(
            theta, rope_dim, float(factor), int(orig),
            float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
            bool(params.get("truncate", True)),
        )
    raise ValueError(f"DeepSeek-V4 rope_type {rope_type!r} is not supported (default, yarn)")


class InterleavedRope(torch.nn.Module):
    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_dim = 2 * inv_freq.numel()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate x [N, ..., D] at positions [N]; inverse=True undoes the rotation (angle -pos)."""
        freqs = positions.float()[:, None] * self.inv_freq  # [N, r/2]
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos, sin = cos.view(shape).float(), sin.view(shape).float()
        r = self.rope_dim
        rope = x[..., -r:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)
