"""FP8 KV caches in the torch-native backend and its C++ kernels: writes quantize (saturating, the
same bits on every path), and attention over an FP8 cache equals attention over the dequantized
cache, with the chunk's own K/V taken as the cache holds them.

Reference: the same backend on a float32 cache holding the FP8 cache's values widened (exact),
and the new K/V rounded through FP8. The C++ kernels load FP8 bytes and widen them in the inner
loop to the floats the float32 cache holds, so their outputs are compared bit for bit; the torch
paths (decode tiles, SDPA, flash blocks) widen each gathered block first, and are compared at
float32 round-off.
"""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.attention_backends.cpu_kernels import load_paged_attention_module, load_prefill_attention
from hybridkv.attention_backends.kv_cache_dtype import as_stored, quantize_kv
from hybridkv.attention_backends.metadata import StepSequences, build_attention_metadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.block_manager.space_spec import NULL_PAGE, window_start

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
NUM_PAGES = 64
# decodes (one past a page edge, one long) and prefill chunks: from 0, after a cached prefix
SPANS = [(40, 1), (3, 1), (0, 1), (0, 12), (20, 15), (33, 40)]


def _values(shape, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Normal values scaled by 4, a few beyond both formats' finite range (saturation), and
    subnormal-sized ones."""
    x = torch.randn(*shape, generator=g) * 4
    flat = x.view(-1)
    flat[:: 97] = 1e6
    flat[1 :: 89] = -7e4
    flat[2 :: 83] = 3e-3
    return x.to(dtype)


class _Step:
    """One step over an FP8 pool: shuffled pages (released ones NULL_PAGE), the cached positions
    written through quantize_kv, the new tokens' q/k/v in the model dtype."""

    def __init__(self, fmt: torch.dtype, window: int | None, page: int, heads: int, kv_heads: int, d: int,
                 dtype: torch.dtype, seed: int) -> None:
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        pool = list(range(1, NUM_PAGES + 1))
        rng.shuffle(pool)
        # Outside the null page the pool holds the format's largest value: a read of a masked or
        # released slot would show in the output.
        self.k_cache = torch.full((kv_heads, (NUM_PAGES + 1) * page, d), torch.finfo(fmt).max).to(fmt)
        self.v_cache = self.k_cache.clone()
        self.k_cache[:, :page] = 0
        self.v_cache[:, :page] = 0
        tables, ks, vs = [], [], []
        for start, n in SPANS:
            table = [pool.pop() for _ in range(-(-(start + n) // page))]
            for i in range(window_start(start, window) // page):
                table[i] = NULL_PAGE
            keys, vals = _values((start + n, kv_heads, d), g, dtype), _values((start + n, kv_heads, d), g, dtype)
            for t in range(window_start(start, window), start):
                slot = table[t // page] * page + t % page
                self.k_cache[:, slot], self.v_cache[:, slot] = quantize_kv(keys[t], fmt), quantize_kv(vals[t], fmt)
            tables.append(table)
            ks.append(keys[start:])
            vs.append(vals[start:])
        self.seqs = StepSequences.from_page_lists([n for _, n in SPANS], [s + n for s, n in SPANS], {"full": tables})
        self.q = (torch.randn(sum(n for _, n in SPANS), heads, d, generator=g)).to(dtype)
        self.k, self.v = torch.cat(ks), torch.cat(vs)
        self.window, self.page, self.fmt, self.scale = window, page, fmt, d**-0.5

    def run(self, be: TorchNativeAttention, widened: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, k cache, v cache after the step's writes): on the FP8 caches, or (widened) on
        float32 caches of their values with the new K/V rounded through FP8."""
        self.seqs.decode_tiles = be.needs_decode_tiles
        meta = build_attention_metadata(self.seqs, {"full": self.window}, self.page)
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        q, k, v = self.q, self.k, self.v
        if widened:
            kc, vc = kc.float(), vc.float()
            q, k, v = q.float(), as_stored(k, self.fmt).float(), as_stored(v, self.fmt).float()
        out = be.forward(q, k, v, kc, vc, meta, "full", self.scale)
        return out, kc, vc


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16])
def test_the_cpp_writer_saturates_and_rounds_as_quantize_kv(fmt, rows):
    module = load_paged_attention_module()
    assert module is not None, "the CPU kernels must build here (CI installs g++)"
    g = torch.Generator().manual_seed(0)
    k, v = _values((50, 2, 24), g, rows), _values((50, 2, 24), g, rows)
    k[0, 0, :6] = torch.tensor([float("inf"), float("-inf"), 449.0, 464.0, 57343.0, 61440.0]).to(rows)
    slots = torch.randperm(200, generator=g)[:50] + 8
    kc = torch.zeros(2, 208, 24, dtype=fmt)
    vc = torch.zeros_like(kc)
    module.write_kv(kc, vc, slots, k, v)
    for cache, rows_in in ((kc, k), (vc, v)):
        want = quantize_kv(rows_in, fmt)
        assert torch.equal(cache[:, slots].view(torch.uint8), want.transpose(0, 1).view(torch.uint8))
        assert torch.isfinite(cache.float()).all(), "a saturating write stored inf or NaN"
    assert kc[0, slots[0], 0].float() == torch.finfo(fmt).max and kc[0, slots[0], 1].float() == -torch.finfo(fmt).max


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("d", [64, 24])
def test_every_finite_fp8_byte_is_read_as_torch_widens_it(fmt, d):
    """A query with one visible key returns that key's value row exactly: each finite byte value
    placed in the V cache comes back as torch's float of it, through the vector loads (D 64) and
    the scalar loop (D 24), in the paged kernel and (D 64) the prefill kernel."""
    module, prefill = load_paged_attention_module(), load_prefill_attention()
    byte = torch.arange(256, dtype=torch.uint8)
    finite = byte[torch.isfinite(byte.view(fmt).float())]
    rows = -(-finite.numel() // d)
    values = torch.zeros(rows * d, dtype=torch.uint8)
    values[: finite.numel()] = finite
    page = 16
    vc = torch.zeros(1, (rows + 1) * page, d, dtype=torch.uint8)  # sequence i: one token, on page i + 1
    vc[0, page::page][:rows] = values.view(rows, d)
    vc = vc.view(fmt)
    kc = torch.zeros_like(vc)
    table = torch.arange(1, rows + 1, dtype=torch.int32).view(rows, 1)
    groups = torch.arange(rows + 1, dtype=torch.int32)
    q = torch.randn(rows, 2, d)
    kernels = [module.paged_attention] + ([prefill] if d % 16 == 0 else [])
    for kernel in kernels:
        out = kernel(q, kc, vc, table, groups, groups[:-1], torch.zeros(rows, dtype=torch.int32), page, -1, 0.1)
        want = vc[0, page::page][:rows].float()
        assert torch.equal(out[:, 0], want) and torch.equal(out[:, 1], want)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("d,heads", [(64, 6), (128, 4)])
def test_cpu_kernels_over_fp8_equal_the_float32_cache_of_its_values_bit_for_bit(fmt, window, d, heads, threads):
    """The paged decode kernel and the prefill kernel (float32 queries, head sizes of whole vector
    blocks): the same arithmetic on the same floats, so the same bits, whether the cache holds them
    as FP8 or as float32. (Other head sizes take the paged kernel's scalar loop, whose reduction
    the compiler may order differently for FP8 loads: the next test holds them to round-off.)"""
    step = _Step(fmt, window, 16, heads, 2, d, torch.float32, seed=d + heads)
    be = TorchNativeAttention()
    assert not be.needs_decode_tiles and be._prefill_kernel is not None
    out, kc, vc = step.run(be, widened=False)
    ref, kw, vw = step.run(be, widened=True)
    assert torch.equal(out, ref)
    assert torch.equal(kc.float(), kw) and torch.equal(vc.float(), vw), "the writes stored other values"


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "torch"])
@pytest.mark.parametrize("d", [64, 8])
def test_backend_over_fp8_matches_attention_over_the_dequantized_cache(fmt, window, kernels, d):
    """Every path of the backend (the kernels, or the torch fallback's decode tiles, SDPA and flash
    blocks; D 8 takes the torch prefill even with the kernels) against the float32 cache."""
    step = _Step(fmt, window, 4, 4, 2, d, torch.float32, seed=7)
    be = TorchNativeAttention(cpu_kernels=kernels)
    out, _, _ = step.run(be, widened=False)
    ref, _, _ = step.run(TorchNativeAttention(cpu_kernels=False), widened=True)
    assert torch.isfinite(out).all()
    # Keys up to the formats' maxima make sharp softmaxes: float32 round-off of the large scores,
    # summed in another order by each path, is ~1e-5 of the outputs' scale.
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "torch"])
def test_bfloat16_queries_over_fp8_match_the_dequantized_cache(fmt, kernels):
    """bfloat16 models: the FP8 cache goes to the paged kernel, the float32-FMA prefill kernel
    (never the bf16-products one) or the torch path; against float32 attention over the same values the only
    difference is the bf16 rounding of the queries' inputs and of the output."""
    step = _Step(fmt, 9, 16, 6, 2, 64, torch.bfloat16, seed=3)
    be = TorchNativeAttention(cpu_kernels=kernels)
    if kernels:
        assert be._prefill_kernel_for(step.q, step.k_cache) is be._prefill_kernel
    out, _, _ = step.run(be, widened=False)
    ref, _, _ = step.run(TorchNativeAttention(cpu_kernels=False), widened=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("d", [64, 128])
def test_bfloat16_decode_over_fp8_equals_the_bfloat16_cache_of_its_values_bit_for_bit(fmt, d):
    """bfloat16 queries in the paged kernel: FP8 keys are scored as the bf16 numbers they are (by
    vdpbf16ps through a byte -> bf16 table where the CPU has AVX512-BF16, else widened to float),
    so the output equals the kernel's over a bfloat16 cache of the same values, bit for bit. The
    keys hold every finite FP8 byte, in blocks of 16 keys and a tail."""
    module = load_paged_attention_module()
    g = torch.Generator().manual_seed(d)
    byte = torch.arange(256, dtype=torch.uint8)
    finite = byte[torch.isfinite(byte.view(fmt).float())]
    page, seqs, keys = 16, 3, 37  # 37 keys: two 16-key score blocks and a 5-key tail per sequence
    codes = finite[torch.randint(0, finite.numel(), (2, seqs * 3 * page, d), generator=g)]
    codes[0].view(-1)[: finite.numel()] = finite  # every finite byte among the keys
    kc, vc = codes[0][None].view(fmt).clone(), codes[1][None].view(fmt).clone()
    table = torch.arange(seqs * 3, dtype=torch.int32).view(seqs, 3)
    groups = torch.arange(seqs + 1, dtype=torch.int32)
    q = (torch.randn(seqs, 3, d, generator=g) * 0.01).to(torch.bfloat16)
    positions = torch.full((seqs,), keys - 1, dtype=torch.int32)
    args = (table, groups, groups[:-1], positions, page, -1, d**-0.5)
    out = module.paged_attention(q, kc, vc, *args)
    want = module.paged_attention(q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), *args)
    assert torch.isfinite(want.float()).all()
    assert torch.equal(out, want)


@pytest.mark.slow
@pytest.mark.parametrize("isa,flags", [("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("base", [])])
def test_fp8_reads_of_the_avx2_and_plain_builds_are_exact(monkeypatch, isa, flags):
    """The paged kernel and its writer as an AVX2-only CPU builds them (8 lanes, F16C's 8-lane
    widening) and as the plain build does (no F16C: c10's conversion lane by lane)."""
    from pathlib import Path

    from hybridkv.attention_backends.cpu_kernels import _PAGED_GROUPS, build

    monkeypatch.setattr(build, "isa_flags", lambda: (isa, flags))
    module = build.build_cpu_extension("hybridkv_paged_attention", Path(build.__file__).with_name("paged_attention.cpp"),
                                       ["paged_attention", "write_kv"], f"CPU paged-attention kernel ({isa} build)",
                                       headers=(_PAGED_GROUPS,))
    assert module is not None, f"the paged kernel did not build for {isa}"
    for fmt in FORMATS:
        byte = torch.arange(256, dtype=torch.uint8)
        finite = byte[torch.isfinite(byte.view(fmt).float())]
        d, rows, page = 64, -(-finite.numel() // 64), 16
        values = torch.zeros(rows * d, dtype=torch.uint8)
        values[: finite.numel()] = finite
        vc = torch.zeros(1, (rows + 1) * page, d, dtype=torch.uint8)
        vc[0, page::page][:rows] = values.view(rows, d)
        vc = vc.view(fmt)
        groups = torch.arange(rows + 1, dtype=torch.int32)
        out = module.paged_attention(torch.randn(rows, 1, d), torch.zeros_like(vc), vc,
                                     torch.arange(1, rows + 1, dtype=torch.int32).view(rows, 1), groups, groups[:-1],
                                     torch.zeros(rows, dtype=torch.int32), page, -1, 0.1)
        assert torch.equal(out[:, 0], vc[0, page::page][:rows].float())
        k = _values((9, 1, d), torch.Generator().manual_seed(1), torch.float32)
        kc, slots = torch.zeros(1, 32, d, dtype=fmt), torch.arange(9) + 16
        module.write_kv(kc, torch.zeros_like(kc), slots, k, k)
        assert torch.equal(kc[:, slots].view(torch.uint8), quantize_kv(k, fmt).transpose(0, 1).view(torch.uint8))
