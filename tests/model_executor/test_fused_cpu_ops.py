"""model_executor/cpu_kernels: each fused CPU op equals the torch expression it replaces (rotary
bit for bit; the others to float32 rounding, from a different summation order or exp), the layers
route to them only where they apply, and without them (switched off, no compiler) the layers run
their torch path with the same result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv import LLM, SamplingParams
from hybridkv.attention_backends.cpu_kernels import kernels_enabled
from hybridkv.model_executor import cpu_kernels, layers
from hybridkv.model_executor.layers import PackedLinearWeight, RMSNorm, SiluAndMulMLP, WidenedLinearWeight, apply_rotary

ops = cpu_kernels.fused_ops()
# The ops must build here (CI installs g++): a failed build fails these tests instead of skipping
# them; only switching the kernels off on purpose (HYBRIDKV_CPU_KERNELS=0) skips them.
needs_ops = pytest.mark.skipif(not kernels_enabled(), reason="CPU kernels switched off (HYBRIDKV_CPU_KERNELS=0)")


@pytest.fixture(autouse=True)
def _built(request):
    if request.node.get_closest_marker("skipif") and kernels_enabled():
        assert ops is not None, "the fused CPU ops did not build on this machine (g++ and ninja installed?)"


@pytest.fixture
def torch_path(monkeypatch):
    """The layers as they run without the compiled ops."""
    monkeypatch.setattr(layers, "fused_ops", lambda: None)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_ops
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 64])  # one tile, and tiles of 4 + a remainder
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear_in_float32(rows, wdtype, bias):
    # K = 100 and N = 37: a K tail past the last full vector and an N tail past the last row block
    g = _gen(rows)
    x = torch.randn(rows, 100, generator=g)
    w = torch.randn(37, 100, generator=g).to(wdtype)
    b = torch.randn(37, generator=g) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(ops.skinny_linear(x, w, b), ref, rtol=1e-5, atol=1e-5)


@needs_ops
def test_skinny_linear_of_bfloat16_rows_rounds_like_f_linear():
    g = _gen(1)
    x = torch.randn(2, 576, generator=g).bfloat16()
    w = (torch.randn(300, 576, generator=g) / 24).bfloat16()
    out = ops.skinny_linear(x, w, None)
    assert out.dtype == torch.bfloat16
    ref = F.linear(x.double(), w.double())
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3)  # one bf16 rounding of an fp32 sum


@needs_ops
def test_skinny_linear_refuses_what_it_cannot_do():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="agree on K"):
        ops.skinny_linear(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.skinny_linear(torch.randn(1, 8), w.t(), None)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_equals_the_torch_path(dtype, unit_offset, monkeypatch):
    g = _gen(2)
    norm = RMSNorm(96, 1e-6, unit_offset=unit_offset).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    wide = torch.randn(5, 3, 96 + 32, generator=g).to(dtype)
    x = wide[..., 16:112]  # a strided view, as a slice of a fused projection is
    fused = norm(x)
    monkeypatch.setattr(layers, "fused_ops", lambda: None)
    ref = norm(x)
    assert fused.shape == ref.shape and fused.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=2e-6, atol=1e-6)
    else:  # the statistics differ only in summation order: at most one bf16 rounding step apart
        torch.testing.assert_close(fused.float(), ref.float(), rtol=8e-3, atol=1e-2)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(dtype, unit_offset, monkeypatch):
    """The fused residual add + norm rounds the sum to the dtype (as torch's add does) and takes
    the norm of that: both outputs equal the add followed by the rms_norm kernel exactly, and the
    torch path (no kernels) to the rms_norm kernel's tolerance."""
    g = _gen(7)
    norm = RMSNorm(96, 1e-6, unit_offset=unit_offset).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(37, 96, generator=g).to(dtype)
    residual = (torch.randn(37, 96, generator=g) * 4).to(dtype)  # larger: the sum rounds in bf16
    total, normed = norm.add_forward(x, residual)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, norm(residual + x))
    monkeypatch.setattr(layers, "fused_ops", lambda: None)
    ref_total, ref_normed = norm.add_forward(x, residual)
    assert torch.equal(total, ref_total)
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(normed.float(), ref_normed.float(), **tol)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 20])  # whole vectors per half; 10-element halves take the scalar loop
def test_rotary_is_bit_identical_to_the_torch_expression(dtype, D, monkeypatch):
    g = _gen(3)
    T, H, Hkv = 6, 4, 2
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)  # rows strided by the whole qkv width
    cos, sin = torch.randn(T, 1, D, generator=g).to(dtype), torch.randn(T, 1, D, generator=g).to(dtype)
    fused = apply_rotary(qk, cos, sin)
    monkeypatch.setattr(layers, "fused_ops", lambda: None)
    assert torch.equal(fused, apply_rotary(qk, cos, sin))


@needs_ops
@pytest.mark.parametrize("rows", [1, 7])
def test_silu_and_mul_mlp_equals_the_torch_path(rows, monkeypatch):
    g = _gen(4)
    mlp = SiluAndMulMLP(48, 80)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(2, rows, 48, generator=g) * 3  # large gates: both tails of the sigmoid
    fused = mlp(x)
    monkeypatch.setattr(layers, "fused_ops", lambda: None)
    torch.testing.assert_close(fused, mlp(x), rtol=1e-5, atol=1e-5)


@needs_ops
@pytest.mark.parametrize("width", [96, 300, 1536])  # whole vectors; a tail of 12 after 18 vectors of 16; 6 tiles
def test_silu_and_mul_in_bfloat16_rounds_like_torch(width):
    g = _gen(6)
    gate_up = (torch.randn(5, 2 * width, generator=g) * 4).bfloat16()
    gate, up = gate_up.split(width, dim=-1)
    ref = F.silu(gate) * up
    out = ops.silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16
    # silu differs from torch's in the last float32 bits (another exp); after the bf16 rounding
    # of silu and of the product, at most one bf16 step apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-6)
    assert (out == ref).float().mean() > 0.95


@needs_ops
def test_silu_and_mul_in_bfloat16_keeps_nan_and_infinities():
    """The vector bf16 rounding (cpu_math.h to_bf16_bits) must not turn a NaN into an infinity or
    a large finite value into NaN; torch gives NaN, +-inf and 0 here."""
    gate = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.0e38, 1.0] * 8).bfloat16()
    up = torch.tensor([1.0, 1.0, 1.0, 2.0, float("nan")] * 8).bfloat16()
    out = ops.silu_and_mul(torch.cat([gate, up])[None])
    ref = F.silu(gate) * up
    assert torch.equal(out[0].isnan(), ref.isnan()), "NaN lanes must stay NaN and only those"
    finite = ~ref.isnan()
    assert torch.equal(out[0][finite], ref[finite])


@needs_ops
@pytest.mark.parametrize("rows", [1, 4, 5, 33])
def test_packed_linear_routes_few_rows_to_the_kernel_and_agrees_with_onednn(rows):
    if not layers.packing_supported(torch.zeros(1)):
        pytest.skip("oneDNN cannot prepack float32 here")
    g = _gen(5)
    w, b = torch.randn(70, 40, generator=g), torch.randn(70, generator=g)
    linear = PackedLinearWeight(w, b)
    assert linear.skinny_rows == layers.SKINNY_ROWS_FLOAT32
    x = torch.randn(rows, 40, generator=g)
    torch.testing.assert_close(linear(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_without_the_ops_the_layers_take_their_torch_path(torch_path):
    w = torch.randn(20, 12)
    assert layers.skinny_linear_for(w) == (None, 0)
    if layers.packing_supported(w):
        assert PackedLinearWeight(w).skinny_rows == 0
    assert WidenedLinearWeight(w.bfloat16()).skinny_rows == 0
    x = torch.randn(3, 12)
    torch.testing.assert_close(WidenedLinearWeight(w.bfloat16())(x.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))


@needs_ops
def test_bfloat16_weights_on_a_native_bf16_cpu_stay_with_onednn(monkeypatch):
    monkeypatch.setattr(layers, "cpu_computes_natively", lambda dtype: True)
    assert layers.skinny_linear_for(torch.randn(4, 4).bfloat16()) == (None, 0)
    monkeypatch.setattr(layers, "cpu_computes_natively", lambda dtype: dtype == torch.float32)
    assert layers.skinny_linear_for(torch.randn(4, 4).bfloat16()) == (ops, layers.SKINNY_ROWS_HALF)


def test_a_failed_build_leaves_none_and_the_switch_turns_them_off(monkeypatch):
    from torch.utils import cpp_extension

    cpu_kernels.fused_ops.cache_clear()
    try:
        monkeypatch.setenv("HYBRIDKV_CPU_KERNELS", "0")
        assert cpu_kernels.fused_ops() is None
        cpu_kernels.fused_ops.cache_clear()
        monkeypatch.delenv("HYBRIDKV_CPU_KERNELS")

        def no_compiler(*args, **kwargs):
            raise RuntimeError("g++: not found")

        monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
        assert cpu_kernels.fused_ops() is None
    finally:
        cpu_kernels.fused_ops.cache_clear()


@needs_ops
def test_demo_model_decodes_the_same_tokens_with_and_without_the_ops(tiny_ckpt, monkeypatch):
    """Greedy decode of a tiny Llama (kernels on every layer op it routes) equals the torch path."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run():
        llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=256, seed=0)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [list(c.token_ids) for c in outs], [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in outs]

    fused_tokens, fused_lp = run()
    monkeypatch.setattr(layers, "fused_ops", lambda: None)
    ref_tokens, ref_lp = run()
    assert fused_tokens == ref_tokens
    for a, b in zip(fused_lp, ref_lp):
        assert a == pytest.approx(b, abs=1e-4)


@needs_ops
@pytest.mark.parametrize("n,iters", [(4, 20), (3, 1), (2, 2)])
def test_hc_sinkhorn_equals_the_torch_loop(n, iters, monkeypatch):
    """DeepSeek-V4's mHC Sinkhorn loop: the fused op (in place) against mhc.sinkhorn_'s torch path,
    with the same division order, so only a sum of n terms could round differently."""
    from hybridkv.model_executor.models.deepseek_v4 import mhc

    comb = torch.softmax(torch.randn(300, n, n, generator=_gen(n)) * 3, dim=-1) + 1e-6
    monkeypatch.setattr(mhc, "fused_ops", lambda: None)
    want = mhc.sinkhorn_(comb.clone(), iters, 1e-6)
    monkeypatch.undo()
    got = comb.clone()
    assert mhc.sinkhorn_(got, iters, 1e-6) is got  # routed to the op, in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(1, 49152), (6, 4100), (33, 2048), (2, 1), (6, 2049)])
def test_argmax_rows_is_torch_max_indices(dtype, rows, n):
    """Greedy sampling's argmax gives torch.max(dim=-1).indices' answer: the first index on ties
    (also when the tied maxima lie in different 2,048-entry blocks of the kernel), the first NaN
    of a row, a row of -inf only, a constant row, -0 against +0; from a strided view too."""
    x = torch.randn(rows, n, generator=_gen(rows + n)).to(dtype)
    top = float(x.float().max()) + 1
    x[0, n // 2] = top
    x[0, n - 1] = top  # a later tie, in another block when n > 2,048
    if rows > 1:
        x[1, n // 3] = float("nan")
        x[1, n - 1] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3:
        x[3] = 0.5
    if rows > 4:
        x[4] = -1.0
        x[4, n // 4] = -0.0
        x[4, n - 2] = 0.0
    if rows > 5:
        x[5, 0] = float("inf")
    for t in (x, x.t().contiguous().t()):
        assert torch.equal(ops.argmax_rows(t), t.max(dim=-1).indices)


@needs_ops
def test_greedy_sampling_takes_the_kernel_argmax(monkeypatch):
    """The sampler's greedy rows go through argmax_rows (CPU, float32 / bfloat16), and every
    other tensor through torch's max."""
    from hybridkv.model_executor import sampler

    calls = []
    monkeypatch.setattr(sampler, "fused_ops", lambda: type("Spy", (), {"argmax_rows": staticmethod(
        lambda x: calls.append(x.dtype) or ops.argmax_rows(x))})())
    x = torch.randn(4, 300, generator=_gen())
    for t in (x, x.bfloat16(), x.double()):
        assert torch.equal(sampler.greedy_tokens(t), t.max(dim=-1).indices)
    assert calls == [torch.float32, torch.bfloat16]
