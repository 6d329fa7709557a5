"""The xformers attention biases hybridkv builds (attention_backends/xformers_attention/bias.py),
checked on the CPU without any xformers kernel: each bias is materialize()d by xformers itself
and applied with plain float32 attention, softmax(Q K^T * scale + bias) V, over the key layout
the builder produces; the result must equal the torch-native backend's output on the same
cache (rtol = atol = 1e-5, float32).

Batches: ragged prompts from position 0, chunks after a cached prefix whose pages are shuffled
(not consecutive), sliding windows (released pages are NULL_PAGE in the table), GQA (8 query
heads over 2 KV heads) and MQA, decodes mixed with prefill chunks. The pool outside the null
page is NaN for the gathered layouts (a gathered padding key that is not the null page would
poison the output); the paged layout reads the whole pool by construction, so there the pool
holds finite garbage instead. Skipped when xformers is not installed."""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.attention_backends.metadata import StepSequences, TileSizes, build_attention_metadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.block_manager.space_spec import NULL_PAGE, window_start

try:
    from hybridkv.attention_backends.xformers_attention.bias import (
        build_xformers_step, default_layout, load_attn_bias, prefill_step, supported_layouts,
    )

    load_attn_bias()
except ImportError as e:  # pragma: no cover - xformers not installed
    pytest.skip(f"xformers is not installed ({e})", allow_module_level=True)

P, D = 4, 16
NUM_PAGES = 120
RTOL = ATOL = 1e-5


class _Step:
    def __init__(self, spans, window, hkv, h, seed, fill="nan"):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.h, self.hkv = h, hkv
        pool = list(range(1, NUM_PAGES + 1))
        rng.shuffle(pool)  # pages of one sequence are not consecutive
        shape = (hkv, (NUM_PAGES + 1) * P, D)
        if fill == "nan":
            self.k_cache, self.v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        else:
            self.k_cache, self.v_cache = 50 * torch.randn(shape, generator=g), 50 * torch.randn(shape, generator=g)
        self.k_cache[:, :P] = 0
        self.v_cache[:, :P] = 0
        tables, ks, vs = [], [], []
        for start, n in spans:
            end = start + n
            table = [pool.pop() for _ in range(-(-end // P))]
            for i in range(window_start(start, window) // P):
                table[i] = NULL_PAGE  # released: out of the window
            keys, vals = torch.randn(end, hkv, D, generator=g), torch.randn(end, hkv, D, generator=g)
            for t in range(window_start(start, window), start):  # written by earlier steps
                slot = table[t // P] * P + t % P
                self.k_cache[:, slot], self.v_cache[:, slot] = keys[t], vals[t]
            tables.append(table)
            ks.append(keys[start:end])
            vs.append(vals[start:end])
        self.seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
        self.q = torch.randn(sum(n for _, n in spans), h, D, generator=g)
        self.k, self.v = torch.cat(ks), torch.cat(vs)
        self.window = window


def _torch_native(step, tiles=TileSizes()):
    meta = build_attention_metadata(step.seqs, {"full": step.window}, P, tiles)
    out = TorchNativeAttention().forward(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, "full", D**-0.5)
    return meta, out  # the caches now hold the step's K/V too


def _apply_bias(xstep, q, k_cache, v_cache):
    """softmax(Q K^T * scale + bias) V in float32 over the builder's K/V layout."""
    keys, vals = xstep.keys(k_cache)[0], xstep.keys(v_cache)[0]  # [M, Hkv, D]
    bias = xstep.materialize(xstep.num_keys(k_cache))  # [T, M] from xformers' materialize()
    group = q.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,mhd->htm", q, keys) * D**-0.5 + bias[None]
    return torch.einsum("htm,mhd->thd", torch.softmax(scores, dim=-1), vals)


RAGGED = [(0, 9), (0, 3), (0, 17), (0, 1 + P)]
PREFIX = [(13, 6), (30, 2), (5, 21), (0, 7)]  # cached prefixes over shuffled pages
MIXED = [(40, 1), (3, 1), (0, 1), (22, 1), (0, 12), (20, 15), (33, 9)]  # decodes first, then prefill


@pytest.mark.parametrize("hkv, h", [(2, 8), (1, 4)], ids=["gqa4", "mqa"])
@pytest.mark.parametrize("window", [None, 5, 16], ids=["full", "win5", "win16"])
@pytest.mark.parametrize("spans", [RAGGED, PREFIX, MIXED], ids=["ragged", "prefix", "mixed"])
@pytest.mark.parametrize("layout", ["padded", "packed", "paged"])
def test_materialized_bias_matches_torch_native(layout, spans, window, hkv, h):
    if layout == "paged" and window is not None:
        with pytest.raises(ValueError, match="window"):
            build_xformers_step([1], [1], torch.ones(1, 1, dtype=torch.int32), P, window, "paged")
        return
    step = _Step(spans, window, hkv, h, seed=len(spans) + (window or 0) + hkv, fill="garbage" if layout == "paged" else "nan")
    meta, ref = _torch_native(step)
    assert not ref.isnan().any()
    # The whole step (decodes included) as one call ...
    table = step.seqs.block_tables["full"]
    whole = build_xformers_step(step.seqs.query_lens, step.seqs.context_lens, table, P, window, layout)
    got = _apply_bias(whole, step.q, step.k_cache, step.v_cache)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    # ... and the backend's call: the prefill chunks after the decodes, from the metadata alone.
    nd = meta.num_decode_tokens
    if nd < step.q.shape[0]:
        part = prefill_step(meta, "full", layout)
        torch.testing.assert_close(_apply_bias(part, step.q[nd:], step.k_cache, step.v_cache), ref[nd:],
                                   rtol=RTOL, atol=ATOL)


def test_bias_types_are_the_documented_xformers_masks():
    ab = load_attn_bias()
    table = torch.tensor([[3, 5, 1], [2, 4, NULL_PAGE]], dtype=torch.int32)
    kinds = {
        ("padded", None): ab.BlockDiagonalCausalWithOffsetPaddedKeysMask,
        ("padded", 4): ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask,
        ("paged", None): ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
        ("packed", None): ab.BlockDiagonalCausalFromBottomRightMask,
        ("packed", 4): ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    }
    for (layout, window), cls in kinds.items():
        s = build_xformers_step([3, 2], [10, 6], table, P, window, layout)
        assert type(s.attn_bias) is cls, (layout, window)
    # padded: every key row holds one sequence's window range, padding points at the null page
    s = build_xformers_step([3, 2], [10, 6], table, P, 4, "padded")
    assert s.key_slots.numel() == 2 * 6 and s.key_slots.view(2, 6)[1, 5].item() == 0


def test_default_layout(monkeypatch):
    monkeypatch.delenv("HYBRIDKV_XFORMERS_LAYOUT", raising=False)
    assert default_layout(torch.bfloat16, None) == "padded"
    assert default_layout(torch.bfloat16, 128) == "padded"
    assert default_layout(torch.float32, None) == "padded"
    assert default_layout(torch.float32, 128) == "packed"  # cutlass: no padded-keys local mask
    monkeypatch.setenv("HYBRIDKV_XFORMERS_LAYOUT", "paged")
    assert default_layout(torch.bfloat16, None) == "paged"
    assert default_layout(torch.bfloat16, 128) == "padded"
    assert default_layout(torch.float32, None) == "padded"  # cutlass has no paged masks
    assert default_layout(torch.float32, 128) == "packed"
    monkeypatch.setenv("HYBRIDKV_XFORMERS_LAYOUT", "padded")
    assert default_layout(torch.float32, 128) == "packed"
    assert supported_layouts(torch.float16, None) == ["paged", "padded", "packed"]
    assert supported_layouts(torch.bfloat16, 64) == ["padded", "packed"]
    assert supported_layouts(torch.float32, None) == ["padded", "packed"]
    assert supported_layouts(torch.float32, 64) == ["packed"]
    monkeypatch.setenv("HYBRIDKV_XFORMERS_LAYOUT", "bogus")
    with pytest.raises(ValueError, match="HYBRIDKV_XFORMERS_LAYOUT"):
        default_layout(torch.float16, None)


# -- the backend's plumbing on the CPU ---------------------------------------------------------
def _fake_memory_efficient_attention(q, k, v, attn_bias, scale):
    """memory_efficient_attention's contract on BMGHK inputs, through the bias's materialize()."""
    assert q.dim() == k.dim() == 5 and k.stride(3) == 0, "GQA goes in as BMGHK, K/V expanded over the group"
    bias = attn_bias.materialize((q.shape[1], k.shape[1]))
    s = torch.einsum("tghd,mghd->ghtm", q[0], k[0]) * scale + bias
    return torch.einsum("ghtm,mghd->tghd", torch.softmax(s, dim=-1), v[0])[None]


def run_backend_on_cpu(spans, window, use_triton_decode: bool) -> float:
    """XformersAttention.forward on the CPU with the xformers kernel replaced by the fake above
    (and the Triton decode kernel interpreted, or the torch-native fallback): max |err| vs
    TorchNativeAttention on the same step, every layer of a step sharing one bias."""
    from hybridkv.attention_backends.xformers_attention import backend as xb

    xb.attention_backend_problem = lambda name, device: None  # allow the CPU
    be = xb.XformersAttention(device="cpu")
    be._fmha = _fake_memory_efficient_attention
    if not use_triton_decode:
        be._decode_kernel = None
    else:
        assert be._decode_kernel is not None
    step = _Step(spans, window, 2, 8, seed=7)
    meta, ref = _torch_native(step)
    errs = []
    for _ in range(2):  # two "layers" of one step: the bias is built once
        kc, vc = step.k_cache.clone(), step.v_cache.clone()
        got = be.forward(step.q, step.k, step.v, kc, vc, meta, "full", D**-0.5)
        errs.append(float((got - ref).abs().max()))
    if meta.num_decode_tokens < step.q.shape[0]:
        assert be._memo[0] is meta and list(be._memo[1]) == ["full"]
    else:
        assert be._memo is None  # decode only: no xformers call, no bias
    return max(errs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("spans", [PREFIX, MIXED, MIXED[:4]], ids=["prefill", "mixed", "decode_only"])
def test_backend_forward_on_cpu_with_torch_native_decode(spans, window, monkeypatch):
    import hybridkv.attention_backends.xformers_attention.backend as xb

    monkeypatch.setattr(xb, "attention_backend_problem", xb.attention_backend_problem)  # restored after
    assert run_backend_on_cpu(spans, window, use_triton_decode=False) <= ATOL


def test_backend_forward_on_cpu_with_the_triton_decode_kernel():
    """The decode call into engineer A's kernel (arguments, block table, context lengths), under
    Triton's CPU interpreter in a subprocess (the interpreter must be on before the kernels load)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import test_xformers_bias as t\n"
        "for window in (None, 5):\n"
        "    err = t.run_backend_on_cpu(t.MIXED, window, use_triton_decode=True)\n"
        "    assert err <= t.ATOL, (window, err)\n"
        "print('OK')\n" % here
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_attn_bias_loads_from_its_file_when_the_package_does_not_import(monkeypatch):
    """The fallback of load_attn_bias: xformers installed but `import xformers.ops` failing (a
    wheel whose extensions break the package import) -> attn_bias.py is loaded by file path."""
    import sys

    from hybridkv.attention_backends.xformers_attention import bias as xbias

    monkeypatch.setitem(sys.modules, "xformers.ops", None)  # `import xformers.ops...` raises ImportError
    monkeypatch.delitem(sys.modules, "xformers.ops.fmha", raising=False)
    monkeypatch.delitem(sys.modules, "xformers.ops.fmha.attn_bias", raising=False)
    monkeypatch.delitem(sys.modules, xbias._PRIVATE_NAME, raising=False)
    ab = xbias.load_attn_bias()
    assert ab.__name__ == xbias._PRIVATE_NAME and hasattr(ab, "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask")
    step = _Step(PREFIX, 5, 2, 8, seed=3)
    _, ref = _torch_native(step)
    x = build_xformers_step(step.seqs.query_lens, step.seqs.context_lens, step.seqs.block_tables["full"], P, 5, "padded")
    assert type(x.attn_bias).__module__ == xbias._PRIVATE_NAME
    torch.testing.assert_close(_apply_bias(x, step.q, step.k_cache, step.v_cache), ref, rtol=RTOL, atol=ATOL)
