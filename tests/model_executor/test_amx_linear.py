"""model_executor/cpu_kernels/amx_linear.cpp: the bf16 linear on AMX tiles, from blocked_linear.cpp's
bf16 column blocks. Every output is one rounding of the exact product (float32 sums of exact bf16
products), for row counts inside one 16-row tile, across tiles and across 256-row chunks, widths
ending inside a 16-column block and on an odd block (a pair's lone half), K of one and of many
32-wide chunks, with and without bias. On a CPU without AMX the module is not built and these tests
skip; where the CPU has AMX they must run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from amx_helpers import require_amx  # tests/ is on sys.path (conftest's folder)
from fused_silu_checks import assert_mlp_fuses_silu
from hybridkv.model_executor import layers
from hybridkv.model_executor.cpu_kernels import amx_linear_ops, blocked_linear_ops


@pytest.fixture(scope="module")
def ops():
    blocked, amx = blocked_linear_ops(), amx_linear_ops()
    require_amx(blocked, amx, what="the AMX linear")
    return blocked, amx


def _packed(blocked, w, b):
    packed = blocked.pack_blocked_linear_bf16(w)
    bias = None if b is None else F.pad(b, (0, packed.shape[0] * 16 - w.shape[0]))
    return packed, bias


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300, 529])
@pytest.mark.parametrize("n, k", [(1, 32), (16, 64), (17, 96), (40, 64), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_rounds_the_exact_product_once(ops, rows, n, k, with_bias):
    """Within one bf16 rounding (2^-8 relative) of the float64 result, plus float32 summation noise."""
    blocked, amx = ops
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed, bias = _packed(blocked, w, b)
    got = amx.amx_linear_bf16(x, packed, bias, n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all(), (got.double() - want).abs().max()


def test_amx_linear_reads_x_through_its_row_stride_and_writes_only_its_output(ops):
    """A row-sliced view of x (not contiguous) gives the contiguous copy's result, and nothing
    past N is written (the output is exactly [M, N])."""
    blocked, amx = ops
    w = torch.randn(24, 64).bfloat16()
    packed, _ = _packed(blocked, w, None)
    wide = torch.randn(20, 128).bfloat16()
    x = wide[:, :64]
    assert not x.is_contiguous()
    assert torch.equal(amx.amx_linear_bf16(x, packed, None, 24), amx.amx_linear_bf16(x.contiguous(), packed, None, 24))


def test_amx_linear_gives_the_same_bits_on_one_thread_and_two(ops):
    """Each output's sum runs in one fixed order whatever the split of work items."""
    blocked, amx = ops
    w, x = torch.randn(200, 320).bfloat16(), torch.randn(300, 320).bfloat16()
    packed, _ = _packed(blocked, w, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx.amx_linear_bf16(x, packed, None, 200)
        torch.set_num_threads(2)
        two = amx.amx_linear_bf16(x, packed, None, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_amx_linear_refuses_what_it_cannot_take(ops):
    blocked, amx = ops
    packed = blocked.pack_blocked_linear_bf16(torch.randn(20, 48).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx.amx_linear_bf16(torch.randn(3, 48).bfloat16(), packed, None, 20)
    packed = blocked.pack_blocked_linear_bf16(torch.randn(20, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x must be"):
        amx.amx_linear_bf16(torch.randn(3, 64), packed, None, 20)
    with pytest.raises(RuntimeError, match="weight of x's K"):
        amx.amx_linear_bf16(torch.randn(3, 96).bfloat16(), packed, None, 20)
    with pytest.raises(RuntimeError, match="N does not match"):
        amx.amx_linear_bf16(torch.randn(3, 64).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        amx.amx_linear_bf16(torch.randn(3, 64).bfloat16(), packed, torch.zeros(20), 20)
    assert amx.amx_linear_bf16(torch.randn(0, 64).bfloat16(), packed, None, 20).shape == (0, 20)


def test_fast_linear_puts_bf16_weights_on_amx_for_every_row_count(ops):
    """On an AMX CPU a bf16 weight whose K is a multiple of 32 becomes an AmxLinearWeight that
    serves every row count and input shape; other K keep the previous paths."""
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    linear = layers.fast_linear(w, b)
    assert isinstance(linear, layers.AmxLinearWeight)
    for shape in [(1, 64), (3, 7, 64), (300, 64)]:
        x = torch.randn(*shape).bfloat16()
        want = F.linear(x.double(), w.double(), b.double())
        got = linear(x)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-2).all()
    assert not isinstance(layers.fast_linear(torch.randn(40, 48).bfloat16()), layers.AmxLinearWeight)


# -- the gate/up projection with silu(gate) * up in its epilogue ----------------------------------

@pytest.mark.parametrize("rows", [1, 16, 17, 33, 300])
@pytest.mark.parametrize("i, k", [(16, 32), (48, 64), (96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_gives_the_unfused_pairs_bits(ops, rows, i, k, with_bias):
    """amx_linear_silu_mul_bf16 is fused_ops.silu_and_mul(amx_linear_bf16(...)) bit for bit: the
    gate and up rounded to bf16, silu with the same exp, each product rounded as torch does."""
    from hybridkv.model_executor.cpu_kernels import fused_ops

    blocked, amx = ops
    g = torch.Generator().manual_seed(rows * 1000 + i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.3).bfloat16()
    b = torch.randn(2 * i, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    x[0, :4] = torch.tensor([60.0, -60.0, 0.0, -0.0])  # large gates on either side of exp's range
    packed, bias = _packed(blocked, w, b)
    want = fused_ops().silu_and_mul(amx.amx_linear_bf16(x, packed, bias, 2 * i))
    got = amx.amx_linear_silu_mul_bf16(x, packed, bias, 2 * i)
    assert got.shape == (rows, i) and torch.equal(got, want)
    gate, up = F.linear(x.double(), w.double(), None if b is None else b.double()).split(i, dim=-1)
    exact = F.silu(gate) * up
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-6 + 0.05).all(), "far from silu(gate) * up"


def test_fused_silu_refuses_a_projection_it_cannot_split(ops):
    blocked, amx = ops
    packed = blocked.pack_blocked_linear_bf16(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="N / 2 must be a multiple of 16"):
        amx.amx_linear_silu_mul_bf16(torch.randn(3, 64).bfloat16(), packed, None, 48)


def test_silu_mlp_takes_the_fused_projection_with_the_same_bits(ops, monkeypatch):
    """SiluAndMulMLP in bf16 with its weights on AMX goes through the fused call once per forward,
    and its output equals the unfused projection + silu_and_mul path exactly."""
    assert_mlp_fuses_silu(monkeypatch, torch.bfloat16, layers.AmxLinearWeight)
