"""The check every fused gate/up + SiLU linear shares (AMX, float32 blocked, bf16 vdpbf16ps):
SiluAndMulMLP goes through the projection's silu_and_mul once per forward, and its output is the
unfused projection + fused_ops' silu_and_mul path's, bit for bit."""
from __future__ import annotations

import torch

from hybridkv.model_executor import layers


def assert_mlp_fuses_silu(monkeypatch, dtype: torch.dtype, kind: type):
    """Build a packed SiluAndMulMLP(64, 48) in `dtype`, check its gate/up projection is a `kind`
    that fuses, and that a forward takes the fused call with the unfused path's bits. Returns the
    projection (for dtype-specific checks after)."""
    torch.manual_seed(0)
    mlp = layers.SiluAndMulMLP(64, 48).to(dtype)
    layers.pack_linear_weights(mlp)
    projection = mlp.gate_up_proj.forward
    assert isinstance(projection, kind) and projection.fuses_silu
    x = torch.randn(2, 5, 64).to(dtype)
    calls = []
    real = projection.silu_and_mul
    monkeypatch.setattr(projection, "silu_and_mul", lambda v: calls.append(v.shape) or real(v))
    fused = mlp(x)
    assert calls == [x.shape] and fused.shape == (2, 5, 64), "the MLP did not take the fused call"
    monkeypatch.setattr(projection, "fuses_silu", False)
    assert torch.equal(fused, mlp(x)) and len(calls) == 1, "fused and unfused paths differ"
    return projection
