"""The Triton backend over FP8 KV caches, run on CPU tensors by Triton's interpreter: its writes
store the torch-native backend's bytes (quantize_kv), and its decode and prefill kernels, which
load the FP8 bytes and widen them to float32, match the torch-native backend on the same caches."""
from __future__ import annotations

import os
import random

import pytest
import torch

# Kernels pick compiled or interpreted when decorated, i.e. on first import: set it before that.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from hybridkv.attention_backends.kv_cache_dtype import quantize_kv  # noqa: E402
from hybridkv.attention_backends.metadata import StepSequences, build_attention_metadata  # noqa: E402
from hybridkv.attention_backends.torch_native import TorchNativeAttention  # noqa: E402
from hybridkv.attention_backends.triton_attention.backend import TritonAttention  # noqa: E402
from hybridkv.attention_backends.triton_attention.common import is_interpreted  # noqa: E402
from hybridkv.attention_backends.triton_attention.decode_attention import _decode_split_kernel  # noqa: E402
from hybridkv.attention_backends.triton_attention.kv_write import write_kv  # noqa: E402
from hybridkv.block_manager.space_spec import NULL_PAGE, window_start  # noqa: E402

P, D, NUM_PAGES = 4, 16, 40
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
BLOCKS = dict(decode_block_n=16, prefill_block_m=16, prefill_block_n=16)
# decodes around page and block edges, chunks from 0 and after a cached prefix
SPANS = [(16, 1), (4, 1), (0, 1), (0, 5), (7, 9), (13, 20)]


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    assert is_interpreted(_decode_split_kernel), (
        "the triton kernels were imported before TRITON_INTERPRET=1 was set (by another test module?)"
    )


def _step(fmt: torch.dtype, window: int | None, seed: int):
    """(q, k, v, k_cache, v_cache, meta) of one step over an FP8 pool whose unused slots hold the
    format's maximum (a masked read would show), released pages NULL_PAGE."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    pool = list(range(1, NUM_PAGES + 1))
    rng.shuffle(pool)
    k_cache = torch.full((2, (NUM_PAGES + 1) * P, D), torch.finfo(fmt).max).to(fmt)
    v_cache = k_cache.clone()
    k_cache[:, :P] = 0
    v_cache[:, :P] = 0
    tables, ks, vs = [], [], []
    for start, n in SPANS:
        table = [pool.pop() for _ in range(-(-(start + n) // P))]
        for i in range(window_start(start, window) // P):
            table[i] = NULL_PAGE
        keys, vals = torch.randn(start + n, 2, D, generator=g) * 4, torch.randn(start + n, 2, D, generator=g) * 4
        keys[0, 0, 0] = 1e6  # saturates
        for t in range(window_start(start, window), start):
            slot = table[t // P] * P + t % P
            k_cache[:, slot], v_cache[:, slot] = quantize_kv(keys[t], fmt), quantize_kv(vals[t], fmt)
        tables.append(table)
        ks.append(keys[start:])
        vs.append(vals[start:])
    seqs = StepSequences.from_page_lists([n for _, n in SPANS], [s + n for s, n in SPANS], {"full": tables})
    q = torch.randn(sum(n for _, n in SPANS), 4, D, generator=g)
    return q, torch.cat(ks), torch.cat(vs), k_cache, v_cache, build_attention_metadata(seqs, {"full": window}, P)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_triton_writes_store_the_quantized_bytes(fmt):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(7, 2, D, generator=g) * 300, torch.randn(7, 2, D, generator=g) * 3e4
    slots = torch.randperm(NUM_PAGES * P, generator=g)[:7] + P
    kc = torch.zeros(2, (NUM_PAGES + 1) * P, D, dtype=fmt)
    vc = torch.zeros_like(kc)
    write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc[:, slots].view(torch.uint8), quantize_kv(k, fmt).transpose(0, 1).view(torch.uint8))
    assert torch.equal(vc[:, slots].view(torch.uint8), quantize_kv(v, fmt).transpose(0, 1).view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [None, 6])
def test_triton_over_fp8_matches_torch_native_over_the_same_cache(fmt, window):
    q, k, v, kc, vc, meta = _step(fmt, window, seed=3)
    got = TritonAttention(num_kv_splits=3, **BLOCKS).forward(q, k, v, kc.clone(), vc.clone(), meta, "full", D**-0.5)
    want = TorchNativeAttention(cpu_kernels=False).forward(q, k, v, kc.clone(), vc.clone(), meta, "full", D**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
