"""model_executor/cpu_kernels/blocked_linear.cpp: the float32 linear from column blocks computes
F.linear for every shape the engine sends it -- rows from 1 (a decode) past one 256-row tile (a
prefill), output widths that end inside a 16-column block and inside a 3-block register group,
any K, with and without bias -- and writes nothing past the last column."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridkv.model_executor import layers
from hybridkv.model_executor.cpu_kernels import blocked_linear_ops
from fused_silu_checks import assert_mlp_fuses_silu

ops = blocked_linear_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU kernels did not build here")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 200, 300, 600])
@pytest.mark.parametrize("n, k", [(1, 5), (16, 64), (17, 37), (47, 64), (48, 8), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_linear_equals_f_linear(rows, n, k, with_bias):
    """The kernel itself, at every row count (on Intel the layer sends it at most BLOCKED_MAX_ROWS)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g)
    linear = layers.BlockedLinearWeight(w, b, ops)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = ops.blocked_linear(x, linear.packed, linear.padded_bias, n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x).double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_the_layer_sends_up_to_blocked_max_rows_to_the_kernel_and_more_to_f_linear(monkeypatch, vendor):
    """On Intel, up to BLOCKED_MAX_ROWS rows go to the kernel and more to F.linear (MKL, faster
    there); on other CPUs (where MKL is slower than the kernel) every row count goes to the kernel."""
    from hybridkv import cpu_features as features

    real_features = features.cpu_features()
    monkeypatch.setattr(features, "cpu_features", lambda: dataclasses.replace(real_features, vendor=vendor))
    w = torch.randn(20, 8)
    linear = layers.BlockedLinearWeight(w, None, ops)
    calls = []
    real = ops.blocked_linear
    monkeypatch.setattr(linear, "ops", type("Spy", (), {"blocked_linear": staticmethod(
        lambda *a: calls.append(a[0].shape[0]) or real(*a))})())
    for rows in (layers.BLOCKED_MAX_ROWS, layers.BLOCKED_MAX_ROWS + 1):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(linear(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    intel = vendor == "GenuineIntel"
    assert calls == ([layers.BLOCKED_MAX_ROWS] if intel else [layers.BLOCKED_MAX_ROWS, layers.BLOCKED_MAX_ROWS + 1])


def test_blocked_linear_takes_strided_and_batched_inputs():
    w, b = torch.randn(50, 24), torch.randn(50)
    linear = layers.BlockedLinearWeight(w, b, ops)
    x = torch.randn(4, 6, 48)[..., ::2]  # [4, 6, 24], not contiguous
    torch.testing.assert_close(linear(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_the_packed_weight_is_zero_past_the_last_column_and_the_output_is_exactly_n_wide():
    w = torch.randn(20, 8)
    packed = ops.pack_blocked_linear(w)
    assert packed.shape == (2, 8, 16)
    assert torch.equal(packed[0].t(), w[:16]) and torch.equal(packed[1, :, :4].t(), w[16:])
    assert not packed[1, :, 4:].any()
    y = ops.blocked_linear(torch.randn(9, 8), packed, None, 20)
    assert y.shape == (9, 20)


def test_mismatched_shapes_are_refused():
    packed = ops.pack_blocked_linear(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K"):
        ops.blocked_linear(torch.randn(3, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="N does not match"):
        ops.blocked_linear(torch.randn(3, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ops.blocked_linear(torch.randn(3, 8), packed, torch.zeros(20), 20)


# -- bfloat16 through vdpbf16ps (CPUs with AVX512-BF16) ------------------------------------------

needs_bf16 = pytest.mark.skipif(ops is None or not ops.blocked_bf16_available(), reason="no AVX512-BF16 here")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 300])
@pytest.mark.parametrize("n, k", [(1, 6), (16, 64), (17, 38), (47, 64), (80, 64), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_linear_bf16_rounds_the_exact_product_once(rows, n, k, with_bias):
    """bf16 x and W, float32 sums of exact products, one rounding to bf16 at the end: every output
    is within one bf16 rounding (2^-8 relative) of the float64 result, plus float32 summation
    noise. Row counts past one 8-row register block and one 256-row tile, widths ending inside a
    16-column block and inside a 3-block group, and last groups of one and two interleaved blocks
    after full ones (80 and 100 columns)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = ops.pack_interleaved_linear_bf16(w)
    bias = None if b is None else F.pad(b, (0, packed.shape[0] * 16 - n))
    got = ops.blocked_linear_bf16(x, packed, bias, n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all(), (got.double() - want).abs().max()


@needs_bf16
@pytest.mark.parametrize("n", [16, 47, 80, 100, 3072])
def test_blocked_linear_bf16_gives_a_row_the_same_bits_alone_and_in_a_batch(n):
    """Every row is summed in the same order whatever the row count (one-row decode steps and
    batched ones alike), so a sequence's logits do not depend on what it is batched with."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, 576, generator=g).bfloat16()
    x = torch.randn(19, 576, generator=g).bfloat16()
    packed = ops.pack_interleaved_linear_bf16(w)
    batched = ops.blocked_linear_bf16(x, packed, None, n)
    for i in (0, 7, 8, 18):
        assert torch.equal(ops.blocked_linear_bf16(x[i : i + 1], packed, None, n), batched[i : i + 1]), i


@needs_bf16
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_packed_linear_sends_up_to_blocked_max_rows_bf16_to_the_kernel_and_more_to_onednn(monkeypatch, amx):
    """The layer's bf16 path: beside AMX (where oneDNN runs on the tiles from 16 rows) at most
    blocked_max_rows_bf16() rows through the vdpbf16ps kernel and more through oneDNN; without
    AMX every row count through the kernel, and no oneDNN copy of the weight is made. Both agree
    with F.linear to bf16 precision."""
    if not layers.packing_supported(torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN bf16 packing here")
    from hybridkv import cpu_features as features

    real_features = features.cpu_features()
    flags = real_features.flags | {"amx_bf16"} if amx else real_features.flags - {"amx_bf16"}
    monkeypatch.setattr(features, "cpu_features", lambda: dataclasses.replace(real_features, flags=flags))
    limit = layers.BLOCKED_MAX_ROWS_BF16_BESIDE_AMX if amx else None
    assert layers.blocked_max_rows_bf16() == limit
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    linear = layers.PackedLinearWeight(w, b)
    assert linear.blocked is ops
    assert (linear.packed is None) == (limit is None), "a oneDNN copy is kept exactly where oneDNN can run"
    calls = []
    real = ops.blocked_linear_bf16
    monkeypatch.setattr(linear, "blocked", type("Spy", (), {"blocked_linear_bf16": staticmethod(
        lambda *a: calls.append(a[0].shape[0]) or real(*a))})())
    counts = (1, limit, limit + 1) if amx else (1, 513, 1100)
    for rows in counts:
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(linear(x).float(), F.linear(x.float(), w.float(), b.float()), atol=0.1, rtol=2e-2)
    assert calls == (list(counts[:2]) if amx else list(counts))


@needs_bf16
def test_blocked_linear_bf16_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="K must be even"):
        ops.pack_interleaved_linear_bf16(torch.randn(20, 7).bfloat16())
    with pytest.raises(RuntimeError, match="pack_interleaved_linear_bf16 weight"):  # the AMX kernel's layout
        ops.blocked_linear_bf16(torch.randn(3, 8).bfloat16(), ops.pack_blocked_linear_bf16(torch.randn(20, 8).bfloat16()),
                                None, 20)
    packed = ops.pack_interleaved_linear_bf16(torch.randn(20, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x must be"):
        ops.blocked_linear_bf16(torch.randn(3, 8), packed, None, 20)
    with pytest.raises(RuntimeError, match="N does not match"):
        ops.blocked_linear_bf16(torch.randn(3, 8).bfloat16(), packed, None, 40)
    assert layers.blocked_bf16_for(torch.randn(20, 7).bfloat16()) is None, "odd K keeps oneDNN"


# -- the gate/up projection with silu(gate) * up in its epilogue ----------------------------------

needs_fused_silu = pytest.mark.skipif(ops is None or not ops.blocked_silu_mul_available(),
                                      reason="blocked_linear_silu_mul needs an AVX-512 build")


@needs_fused_silu
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 300])  # remainders of the 6-row block; two row tiles
@pytest.mark.parametrize("i, k", [(16, 8), (48, 64), (96, 576)])  # one gate block; an odd count; pairs
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_gives_the_unfused_pairs_bits(rows, i, k, with_bias):
    """blocked_linear_silu_mul is fused_ops.silu_and_mul(blocked_linear(...)) bit for bit: the same
    FMA chain per output, then silu16 rounding each step as fused_ops does (its FMA contraction is
    off although the module's is on)."""
    from hybridkv.model_executor.cpu_kernels import fused_ops

    g = torch.Generator().manual_seed(rows * 1000 + i + k)
    w = torch.randn(2 * i, k, generator=g) * 0.3
    b = torch.randn(2 * i, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g) * 2
    x[0, :4] = torch.tensor([60.0, -60.0, 0.0, -0.0])  # large gates on either side of exp's range
    linear = layers.BlockedLinearWeight(w, b, ops)
    want = fused_ops().silu_and_mul(ops.blocked_linear(x, linear.packed, linear.padded_bias, 2 * i))
    got = ops.blocked_linear_silu_mul(x, linear.packed, linear.padded_bias, 2 * i)
    assert got.shape == (rows, i) and torch.equal(got, want)
    # Against float64: each float32 sum of K products is within K * 2^-24 of the sum of their
    # magnitudes (the classic bound for a chain of K roundings); silu' stays under 1.1 in size.
    gate, up = F.linear(x.double(), w.double(), None if b is None else b.double()).split(i, dim=-1)
    err_gate, err_up = ((k + 1) * 2.0**-24 * F.linear(x.double().abs(), w.double().abs(),
                                                       None if b is None else b.double().abs())).split(i, dim=-1)
    exact = F.silu(gate) * up
    bound = 1.1 * up.abs() * err_gate + F.silu(gate).abs() * err_up + 1e-6 * exact.abs() + 1e-7
    assert ((got.double() - exact).abs() <= bound).all(), "far from silu(gate) * up"


@needs_fused_silu
def test_fused_silu_refuses_a_projection_it_cannot_split():
    packed = ops.pack_blocked_linear(torch.randn(48, 64))
    with pytest.raises(RuntimeError, match="N must be twice a multiple of 16"):
        ops.blocked_linear_silu_mul(torch.randn(3, 64), packed, None, 48)
    with pytest.raises(RuntimeError, match="blocked_linear_silu_mul: x must be"):  # the error names the kernel
        ops.blocked_linear_silu_mul(torch.randn(3, 64).double(), packed, None, 48)


@needs_fused_silu
def test_silu_mlp_takes_the_fused_projection_with_the_same_bits(monkeypatch):
    """SiluAndMulMLP in float32 with its weights in column blocks goes through the fused call once
    per forward, and its output equals the unfused projection + silu_and_mul path exactly."""
    projection = assert_mlp_fuses_silu(monkeypatch, torch.float32, layers.BlockedLinearWeight)
    # An input the blocked kernel does not take (another dtype) skips the fused call too.
    assert not projection.silu_fits(torch.randn(2, 64).double())


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 300])  # remainders of the 4-row block; two row tiles
@pytest.mark.parametrize("i, k", [(48, 64), (96, 34), (1536, 576)])  # one group a half; an odd k pair count
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_bf16_gives_the_unfused_pairs_bits(rows, i, k, with_bias):
    """blocked_linear_silu_mul_bf16 is fused_ops.silu_and_mul(blocked_linear_bf16(...)) bit for
    bit: gate and up rounded to bf16, silu rounded, the product rounded, as the unfused pair does."""
    from hybridkv.model_executor.cpu_kernels import fused_ops

    g = torch.Generator().manual_seed(rows * 1000 + i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.3).bfloat16()
    b = torch.randn(2 * i, generator=g) if with_bias else None
    x = (torch.randn(rows, k, generator=g) * 2).bfloat16()
    x[0, :4] = torch.tensor([60.0, -60.0, 0.0, -0.0])  # large gates on either side of exp's range
    packed = ops.pack_interleaved_linear_bf16(w)
    want = fused_ops().silu_and_mul(ops.blocked_linear_bf16(x, packed, b, 2 * i))
    got = ops.blocked_linear_silu_mul_bf16(x, packed, b, 2 * i)
    assert got.shape == (rows, i) and got.dtype == torch.bfloat16 and torch.equal(got, want)


@needs_bf16
def test_fused_silu_bf16_refuses_halves_that_are_not_whole_groups():
    packed = ops.pack_interleaved_linear_bf16(torch.randn(64, 64).bfloat16())  # halves of 2 blocks
    with pytest.raises(RuntimeError, match="twice a multiple of 48"):
        ops.blocked_linear_silu_mul_bf16(torch.randn(3, 64).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="blocked_linear_silu_mul_bf16: packed must be"):  # x's K is 32
        ops.blocked_linear_silu_mul_bf16(torch.randn(3, 32).bfloat16(), packed, None, 64)


@needs_bf16
def test_silu_mlp_in_bf16_takes_the_fused_projection(monkeypatch):
    """SiluAndMulMLP in bf16 on the vdpbf16ps kernel goes through the fused call, with the unfused
    pair's bits; past blocked_rows only where that kernel is not the AMX CPUs' decode path."""
    if layers.amx_linear_for(torch.empty(96, 64, dtype=torch.bfloat16)) is not None:
        pytest.skip("AMX CPUs put bf16 weights on the AMX linear (its own fused test)")
    projection = assert_mlp_fuses_silu(monkeypatch, torch.bfloat16, layers.PackedLinearWeight)
    # Every row count where the kernel takes them all (no AMX beside it); beside AMX, only up to
    # its few rows.
    longer = torch.randn(1100, 64).bfloat16()
    assert projection.silu_fits(longer) == (projection.blocked_rows is None)
    monkeypatch.setattr(projection, "blocked_rows", layers.BLOCKED_MAX_ROWS_BF16_BESIDE_AMX)
    assert not projection.silu_fits(torch.randn(layers.BLOCKED_MAX_ROWS_BF16_BESIDE_AMX + 1, 64).bfloat16())
