"""The bf16 prefill kernel (cpu_kernels/prefill_attention_bf16.cpp): bfloat16 with both products
on bf16 dot products, prefill_attention.cpp's call, in each of its builds (AMX tiles, AVX512-BF16
vectors). Held to attention written from the definition, to the float32 kernel, and to the
backend's torch path in a mixed step. On a CPU without a build's instructions that build is not
made (the loader returns None) and its tests skip; where the CPU has them they must run."""
from __future__ import annotations

import pytest
import torch

from hybridkv.attention_backends.cpu_kernels import (BF16_PREFILL_PRODUCTS, load_prefill_attention,
                                                     load_prefill_attention_bf16)
from hybridkv.attention_backends.metadata import StepSequences, build_attention_metadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention

# this folder is on sys.path (rootdir-less test modules)
from test_torch_native import _prefill_kernel_case, assert_same_bits_on_one_and_two_threads


def _cpu_has(products: str) -> bool:
    """The build's instructions on this CPU, as torch probes them (the loader asks the same probe)."""
    probe = getattr(torch.cpu, BF16_PREFILL_PRODUCTS[products][1], None)
    return bool(probe is not None and probe())


@pytest.fixture(scope="module", params=list(BF16_PREFILL_PRODUCTS))
def bf16_kernel(request):
    """Each build of the kernel; skipped where the CPU lacks its instructions, a failure where it
    has them (a missing build there is a broken build, not an absent feature)."""
    kernel = load_prefill_attention_bf16(request.param)
    if kernel is None:
        assert not _cpu_has(request.param), f"this CPU has {request.param} but the kernel's build for it did not build"
        pytest.skip(f"no {request.param} on this CPU")
    return kernel


# bf16 inputs, float32 scores and softmax, weights rounded to bf16: SDPA's bf16 flash attention's
# precision. Measured against float64 attention on these cases: max error ~8e-3.
BF16_TOL = 2e-2


@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("d, grp", [(64, 1), (64, 3), (128, 4)])
def test_bf16_prefill_kernel_matches_attention_from_the_definition(bf16_kernel, window, d, grp):
    """Chunks from position 0 (1, 7 and 300 queries: inside one 16-row tile, across tiles and
    64-key blocks) and after a cached prefix (a short chunk late in a long context, a long one
    after a short prefix), in one call. Each row sees the keys up to its own position inside its
    window and nothing else: unwritten slots and pages outside the chunks are NaN, so a stray read
    poisons the output."""
    spans = [(0, 1), (0, 7), (0, 300), (1000, 37), (50, 200)]
    args, want = _prefill_kernel_case(spans, window, torch.bfloat16, d, grp)
    got = bf16_kernel(*args)
    assert not got.float().isnan().any(), "the kernel read a key outside a row's causal window"
    torch.testing.assert_close(got.double(), want, atol=BF16_TOL, rtol=BF16_TOL)


def test_bf16_prefill_kernel_is_as_close_to_the_definition_as_the_float32_kernel(bf16_kernel):
    """The bf16 products cost no more precision than the weights' bf16 rounding: the bf16 kernel's
    error against float64 attention is within 1.5x of the float32-FMA kernel's on the same bf16
    inputs (that kernel rounds only its output), over a 1,024-token prompt."""
    args, want = _prefill_kernel_case([(0, 1024)], None, torch.bfloat16, 64, 3, hkv=1, seed=2)
    bf16_err = (bf16_kernel(*args).double() - want).abs().max().item()
    fma_err = (load_prefill_attention()(*args).double() - want).abs().max().item()
    assert bf16_err <= 1.5 * fma_err, f"bf16 kernel error {bf16_err:.2e} against the float32 kernel's {fma_err:.2e}"


def test_bf16_prefill_kernel_output_does_not_depend_on_the_thread_count(bf16_kernel):
    """Items go to threads from a shared counter and each owns its rows: one thread or two, the
    same bits."""
    assert_same_bits_on_one_and_two_threads(bf16_kernel, torch.bfloat16)


def test_bf16_prefill_kernel_refuses_what_it_cannot_take(bf16_kernel):
    args, _ = _prefill_kernel_case([(0, 8)], None, torch.bfloat16, 32, 1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        bf16_kernel(*args)
    args, _ = _prefill_kernel_case([(0, 8)], None, torch.float32, 64, 1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_kernel(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))


@pytest.mark.parametrize("window", [None, 40])
def test_bfloat16_prefills_through_the_bf16_kernel_match_the_torch_path_in_a_mixed_step(bf16_kernel, window,
                                                                                     monkeypatch):
    """A step of decodes and prefill chunks (from 0, after a prefix) with the engine's shapes: on
    a CPU with bf16 dot products the backend takes the best build there is (AMX first) and sends
    the bf16 prefills to the kernel once, and the result matches the SDPA / tile path's
    (cpu_kernels=False). Each build runs the step in turn."""
    from hybridkv.attention_backends import torch_native

    monkeypatch.setattr(torch_native, "_native_bf16_matmuls", lambda: True)
    g = torch.Generator().manual_seed(3)
    page, hkv, grp, d = 16, 2, 3, 64
    spans = [(40, 1), (130, 1), (0, 90), (64, 33), (300, 120)]
    pool = 1 + sum(-(-(s + n) // page) for s, n in spans)
    k_cache = torch.randn(hkv, (pool + 1) * page, d, generator=g).bfloat16()
    v_cache = torch.randn_like(k_cache)
    perm = (torch.randperm(pool, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-(s + n) // page))] for s, n in spans]
    T = sum(n for _, n in spans)
    q, k, v = (torch.randn(T, h, d, generator=g).bfloat16() for h in (hkv * grp, hkv, hkv))
    outs = {}
    for name, kernels in (("kernel", True), ("torch", False)):
        be = TorchNativeAttention(cpu_kernels=kernels)
        seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
        seqs.decode_tiles = be.needs_decode_tiles
        meta = build_attention_metadata(seqs, {"full": window}, page)
        calls = []
        if kernels:
            assert be._prefill_bf16 is load_prefill_attention_bf16(), "the backend did not take the best build"
            be._prefill_bf16 = lambda *a: calls.append(1) or bf16_kernel(*a)
        outs[name] = be.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, "full", d**-0.5)
        assert len(calls) == kernels, "the bf16 prefills did not go to the bf16 kernel exactly once for the step"
    torch.testing.assert_close(outs["kernel"].float(), outs["torch"].float(), atol=BF16_TOL, rtol=BF16_TOL)
