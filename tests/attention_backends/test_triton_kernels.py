"""The Triton kernels against the torch-native backend (the CPU reference), run on CPU tensors by
Triton's interpreter: K/V writes, split-KV decode, paged prefill, and both in one step.

The interpreter is slow, so every shape is tiny: page size 4 and blocks of 16 keys/queries, with
lengths k*4 +- 1 (page edges) and past 16/32 (block edges), windows whose edge falls inside a
page, GQA ratios 1, 2 and 4, one split and several. As in test_torch_native, the pool outside the
null page is NaN and pages the window released are NULL_PAGE in the table: a masked read of
either poisons the output. float32 outputs must equal the reference to rtol 1e-5 / atol 2e-6.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

# Kernels pick compiled or interpreted when decorated, i.e. on first import: set it before that.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from hybridkv.attention_backends.metadata import StepSequences, build_attention_metadata  # noqa: E402
from hybridkv.attention_backends.torch_native import TorchNativeAttention  # noqa: E402
from hybridkv.attention_backends.triton_attention.backend import TritonAttention  # noqa: E402
from hybridkv.attention_backends.triton_attention.common import is_interpreted  # noqa: E402
from hybridkv.attention_backends.triton_attention.decode_attention import _decode_split_kernel  # noqa: E402
from hybridkv.attention_backends.triton_attention.kv_write import write_kv  # noqa: E402
from hybridkv.block_manager.space_spec import NULL_PAGE, window_start  # noqa: E402

P, D = 4, 8
NUM_PAGES = 64
TOL = dict(rtol=1e-5, atol=2e-6)
GQA = [(2, 2), (4, 2), (4, 1)]  # (query heads, KV heads): ratios 1, 2, 4
# Small blocks so tiny lengths cross block edges.
BLOCKS = dict(decode_block_n=16, prefill_block_m=16, prefill_block_n=16)

# One-token queries at context lengths on and around page edges, a block edge (16) and two (32).
DECODES = [(t - 1, 1) for t in (1, 3, 4, 5, 7, 8, 9, 16, 17, 33)]
PREFILLS_FROM_ZERO = [(0, 3), (0, 5), (0, 17)]  # empty cached prefix
PREFILLS_AFTER_PREFIX = [(4, 5), (7, 9), (13, 20)]  # a cached prefix, chunks across page edges


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    assert is_interpreted(_decode_split_kernel), (
        "the triton kernels were imported before TRITON_INTERPRET=1 was set (by another test module?)"
    )


class _Step:
    """One step over a NaN pool: block-table rows of shuffled pages (released ones NULL_PAGE),
    the cached K/V of the positions before each chunk, and the chunks' new q/k/v."""

    def __init__(self, spans: list[tuple[int, int]], window: int | None, heads: int, kv_heads: int,
                 seed: int, dtype: torch.dtype = torch.float32) -> None:
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        pool = list(range(1, NUM_PAGES + 1))
        rng.shuffle(pool)
        self.k_cache = torch.full((kv_heads, (NUM_PAGES + 1) * P, D), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.k_cache[:, :P] = 0  # the null page
        self.v_cache[:, :P] = 0
        tables, ks, vs = [], [], []
        for start, n in spans:
            table = [pool.pop() for _ in range(-(-(start + n) // P))]
            for i in range(window_start(start, window) // P):  # out of the window: released
                table[i] = NULL_PAGE
            keys = torch.randn(start + n, kv_heads, D, generator=g).to(dtype)
            vals = torch.randn(start + n, kv_heads, D, generator=g).to(dtype)
            for t in range(window_start(start, window), start):  # written by earlier steps
                slot = table[t // P] * P + t % P
                self.k_cache[:, slot], self.v_cache[:, slot] = keys[t], vals[t]
            tables.append(table)
            ks.append(keys[start:])
            vs.append(vals[start:])
        self.seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
        self.window = window
        self.q = torch.randn(sum(n for _, n in spans), heads, D, generator=g).to(dtype)
        self.k, self.v = torch.cat(ks), torch.cat(vs)

    def run(self, backend) -> torch.Tensor:
        """backend's output on fresh copies of the caches (a run writes the new K/V into them)."""
        meta = build_attention_metadata(self.seqs, {"full": self.window}, P)
        return backend.forward(self.q, self.k, self.v, self.k_cache.clone(), self.v_cache.clone(), meta, "full", D**-0.5)


def _check(step: _Step, splits: int = 3) -> None:
    got = step.run(TritonAttention(num_kv_splits=splits, **BLOCKS))
    assert not got.isnan().any(), "a masked key read NaN pool memory or a released page"
    torch.testing.assert_close(got, step.run(TorchNativeAttention()), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_puts_each_token_in_its_slot(dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 3 * 2 * D, generator=g).to(dtype)  # k and v as views of a fused projection
    k, v = qkv[:, : 2 * D].view(7, 2, D), qkv[:, 2 * D : 4 * D].view(7, 2, D)
    slots = torch.randperm(NUM_PAGES * P, generator=g)[:7] + P
    caches = [torch.zeros(2, (NUM_PAGES + 1) * P, D, dtype=dtype) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots)
    caches[2].index_copy_(1, slots, k.transpose(0, 1))
    caches[3].index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_matches_torch_native(heads, kv_heads, window, splits):
    """Split-KV decode: one split (no merge) and three (some empty for the short contexts)."""
    _check(_Step(DECODES, window, heads, kv_heads, seed=heads + kv_heads), splits)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("spans", [PREFILLS_FROM_ZERO, PREFILLS_AFTER_PREFIX], ids=["no_prefix", "cached_prefix"])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_matches_torch_native(heads, kv_heads, spans, window):
    """Causal chunks over several query blocks (17, 20 rows), the window edge inside a page."""
    _check(_Step(spans, window, heads, kv_heads, seed=heads * kv_heads))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("splits", [1, 4])
def test_decodes_and_prefill_chunks_in_one_step(window, splits):
    spans = [(40, 1), (2, 1), (0, 1), (0, 6), (9, 12), (30, 3)]
    _check(_Step(spans, window, 4, 2, seed=splits), splits)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_reduced_precision_accumulates_in_float32(dtype, tol):
    """bf16/fp16 inputs: the output is the float32 attention of those inputs, rounded once."""
    step = _Step([(17, 1), (5, 1), (0, 9), (6, 11)], 7, 4, 2, seed=5, dtype=dtype)
    got = step.run(TritonAttention(**BLOCKS))
    assert got.dtype == dtype
    step.q, step.k, step.v, step.k_cache, step.v_cache = (
        t.float() for t in (step.q, step.k, step.v, step.k_cache, step.v_cache)
    )
    torch.testing.assert_close(got.float(), step.run(TorchNativeAttention()), rtol=tol, atol=tol)


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from hybridkv.attention_backends.triton_attention.backend import TritonAttention\n"
        "try:\n"
        "    TritonAttention().forward(*[torch.zeros(1, 1, 16)] * 5, None, 'full', 1.0)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    res = _run_python(code, env)
    assert "TRITON_INTERPRET=1" in res.stdout, res.stderr


def test_the_engine_imports_without_triton():
    """Nothing outside attention_backends/triton_attention imports triton at module load."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # any import of triton now raises ImportError\n"
        "import hybridkv.attention_backends.registry, hybridkv.entrypoints, hybridkv.model_executor.model_runner\n"
        "from hybridkv.attention_backends.registry import get_attention_backend\n"
        "print(get_attention_backend('torch_native').name)\n"
    )
    res = _run_python(code, dict(os.environ))
    assert res.returncode == 0 and res.stdout.strip() == "torch_native", res.stderr


_COMPILE_FOR_SM90 = """
import inspect
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridkv.attention_backends.triton_attention.decode_attention import _decode_merge_kernel, _decode_split_kernel
from hybridkv.attention_backends.triton_attention.kv_write import _kv_write_kernel
from hybridkv.attention_backends.triton_attention.prefill_attention import _prefill_kernel

INT_PTRS = {"block_table_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_ptr": "*i32", "slot_ptr": "*i64"}

def compile_for_gpu(kernel, dtype, cache=None, **constexprs):  # cache: the K/V caches' type if not dtype (FP8)
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr") and cache is not None:
            sig[name] = "*" + cache
        elif name.endswith("_ptr"):
            sig[name] = INT_PTRS.get(name, "*fp32" if name.startswith("part_") else "*" + dtype)
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

# Llama-3-8B-like shapes, the backend's default blocks.
for dtype, dot, precision in (("bf16", tl.bfloat16, "tf32"), ("fp32", tl.float32, "ieee")):
    compile_for_gpu(_decode_split_kernel, dtype, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=8, USE_WINDOW=True,
                    DOT_DTYPE=dot, PRECISION=precision, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128)
compile_for_gpu(_decode_merge_kernel, "bf16", HEAD_DIM=128, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128)
compile_for_gpu(_prefill_kernel, "bf16", GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, USE_WINDOW=True, DOT_DTYPE=tl.bfloat16,
                PRECISION="tf32", BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)
compile_for_gpu(_kv_write_kernel, "bf16", BLOCK_H=8, BLOCK_D=128)
for fp8 in ("fp8e4nv", "fp8e5"):  # kv_cache_dtype "fp8" / "fp8_e5m2": bf16 queries, FP8 caches
    compile_for_gpu(_decode_split_kernel, "bf16", cache=fp8, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=8,
                    USE_WINDOW=True, DOT_DTYPE=tl.bfloat16, PRECISION="tf32", BLOCK_H=16, BLOCK_N=64, BLOCK_D=128)
    compile_for_gpu(_prefill_kernel, "bf16", cache=fp8, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, USE_WINDOW=True,
                    DOT_DTYPE=tl.bfloat16, PRECISION="tf32", BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)

# DeepSeek-V4's kernels (pointer names do not all end in _ptr: explicit signatures), at its
# sizes (head_dim 512, 64 indexer heads of 128), blocks kept small enough to compile in seconds.
def compile_explicit(kernel, types, constexprs):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
    triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

from hybridkv.attention_backends.triton_attention.hisparse_swap_in import _swap_in_kernel
from hybridkv.attention_backends.triton_attention.hybrid_v4 import _hybrid_attention_kernel, _indexer_scores_kernel
from hybridkv.attention_backends.triton_attention.kv_write import _row_write_kernel

for keys in ("bf16", "fp8e4nv", "fp8e5"):  # the model dtype, or an FP8 KV cache (kv_cache_dtype)
    compile_explicit(_indexer_scores_kernel, {"q_ptr": "*bf16", "w_ptr": "*bf16", "keys_ptr": "*" + keys,
                                              "slots_ptr": "*i64", "visible_ptr": "*i64", "out_ptr": "*fp32",
                                              "scale": "fp32"},
                     dict(BLOCK_H=64, BLOCK_C=128, BLOCK_N=32))
    for a_mask, b_mask in ((True, False), (True, True)):  # C128 (causal prefix) and CSA top-k (explicit mask)
        types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "sink_ptr": "*fp32", "scale": "fp32"}
        for src, masked in (("a", a_mask), ("b", b_mask)):
            types |= {f"{src}_cache": "*" + keys, f"{src}_slots": "*i64", f"{src}_valid": "*u8" if masked else "*i64"}
        compile_explicit(_hybrid_attention_kernel, types,
                         dict(A_MASK=a_mask, B_MASK=b_mask, BLOCK_H=16, BLOCK_N=32, BLOCK_D=512))
for copy, rows in ((True, "bf16"), (False, "bf16"), (True, "u8")):  # on the device, the host mirror, FP8 bytes
    compile_explicit(_swap_in_kernel, {"entry_ptr": "*i64", "used_ptr": "*i64", "rows_ptr": "*i64", "req_ptr": "*i64",
                                       "mslot_ptr": "*i64", "hot_ptr": "*" + rows, "mirror_ptr": "*" + rows,
                                       "slots_out_ptr": "*i64", "found_out_ptr": "*i8", "clock": "i64"},
                     dict(BLOCK_K=128, BLOCK_S=128, BLOCK_D=64, COPY=copy))
compile_explicit(_row_write_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16", "slot_ptr": "*i64"}, dict(BLOCK_D=256))
compile_explicit(_row_write_kernel, {"src_ptr": "*u8", "dst_ptr": "*u8", "slot_ptr": "*i64"}, dict(BLOCK_D=256))  # FP8 bytes
print("compiled")
"""


def test_kernels_compile_for_a_gpu():
    """The interpreter accepts things the GPU compiler refuses (a plain-float global in a kernel,
    a dot below 16x16): lower every kernel -- dense, DeepSeek-V4's indexer, hybrid attention and
    row write, HiSparse's swap-in, each also over FP8 caches -- to an sm_90 cubin with triton's
    own ptxas, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when it is unset
    res = _run_python(_COMPILE_FOR_SM90, env)
    assert res.stdout.strip() == "compiled", res.stderr[-3000:]
