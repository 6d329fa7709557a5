"""Building blocks shared by the decoder models: norms, rotary embedding, fused linears."""
from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.attention_backends.cpu_kernels.build import isa_flags
from hybridkv.model_executor.cpu_kernels import amx_linear_ops, blocked_linear_ops, fused_ops
from hybridkv.model_executor.huge_pages import HugePageArena, on_huge_pages
from hybridkv.model_executor.heap_retention import release_free_heap

logger = logging.getLogger(__name__)


_FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what cpu_kernels' fused ops take


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the model dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma stores weight - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dtype == self.weight.dtype and x.dtype in _FUSED_DTYPES and (ops := fused_ops()):
            return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)  # the expression below, one pass
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, the norm of that sum): a residual add and the norm that reads its result,
        fused into one pass over the rows where the CPU kernel applies (bit-identical to the two
        steps: the sum is rounded to the dtype before its statistics are taken)."""
        if (x.is_cpu and x.dtype == self.weight.dtype == residual.dtype and x.dtype in _FUSED_DTYPES
                and (ops := fused_ops())):
            total, normed = ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
            return total, normed
        total = x + residual
        return total, self.forward(total)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position.

    inv_freq and the attention scaling come from transformers' rope init functions, so every
    rope_type the config names (default, linear, llama3, yarn, ...) is handled the same way.
    """

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = _rope_inv_freq(config, head_dim, layer_type)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        # (dtype, device) -> the tables as [positions, 1, D] in that dtype, made at first lookup.
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for a step's positions, shaped [T, 1, D] to broadcast over heads.

        Looked up once per step and shared by every layer: one index_select per table from a
        copy already in the model's dtype and shape (casting the table once gives the same bits
        as casting the rows). Two ops instead of six matters at decode, where small ops after
        the weight stream cost tens of microseconds each (2-core Zen 4, bf16 single-stream: the
        six took 69-78 us a step, the two 25-32)."""
        key = (dtype, self.cos.device)
        tables = self._tables.get(key)
        if tables is None:
            tables = self._tables[key] = (self.cos.unsqueeze(1).to(dtype), self.sin.unsqueeze(1).to(dtype))
        return tables[0].index_select(0, positions), tables[1].index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, heads, D] with cos/sin [T, 1, D]."""
    if (x.is_cpu and x.dtype in _FUSED_DTYPES and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and cos.dtype == x.dtype and (ops := fused_ops())):
        return ops.rotary(x, cos, sin)  # bit-identical to the expression below, in one pass
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_inv_freq(config, head_dim: int, layer_type: str | None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if rope_type == "default":
        dim = int(head_dim * partial)
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if fn is None:
        raise ValueError(f"rope_type {rope_type!r} is not supported; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    # Computed on the CPU whatever device the model is being built on (transformers' functions
    # need values: the meta device of a model skeleton has none), then moved there.
    target = torch.get_default_device()
    with torch.device("cpu"):
        inv, scaling = fn(config, torch.device("cpu"), **kwargs)
    return inv.float().to(target), float(scaling)


class SiluAndMulMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.intermediate = intermediate
        self.activation = act  # the config's hidden_act name (fused_decode reads it)
        self.is_silu = act in ("silu", "swish")
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        if act in ("silu", "swish"):
            self.act = nn.functional.silu
        elif act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act = lambda x: nn.functional.gelu(x, approximate="tanh")
        elif act == "gelu":
            self.act = nn.functional.gelu
        else:
            raise ValueError(f"hidden_act {act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .forward, not __call__: no hooks here, and the per-call checks show in decode (llama.py).
        projection = self.gate_up_proj.forward
        if self.is_silu and getattr(projection, "fuses_silu", False) and projection.silu_fits(x):
            return self.down_proj.forward(projection.silu_and_mul(x))  # the lines below' bits, in one pass
        gate_up = projection(x)
        if self.is_silu and gate_up.is_cpu and gate_up.dtype in _FUSED_DTYPES and (ops := fused_ops()):
            # The explicit width, not -1: a chunk that samples no row hands the last layer 0 rows.
            return self.down_proj.forward(
                ops.silu_and_mul(gate_up.view(-1, 2 * self.intermediate)).view(*x.shape[:-1], self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(self.act(gate) * up)


# -- CPU weight prepacking ----------------------------------------------------------------------
#
# On CPU, F.linear with a plain row-major weight takes a slow path for one-row inputs in
# bfloat16 (about 0.5 GB/s of weights read on the machines we measured, against 16 GB/s for
# oneDNN with a weight reordered into its blocked layout once). Decode is exactly that case,
# so every Linear of a loaded model gets a oneDNN-packed copy of its weight and calls the
# packed kernel where the CPU supports it for the weight's dtype (`packing_supported` decides);
# elsewhere the weight stays plain. The numerics are oneDNN's, as F.linear's already are in bfloat16.


def packing_supported(weight: torch.Tensor) -> bool:
    """THE decision: does `weight` take the oneDNN-prepacked path, or plain F.linear?

    Every caller (pack_linear_weights, a model's own pack_weights, e.g. Llama's logits matrix)
    asks this one function. Prepacking needs a CPU weight, a dtype oneDNN packs (float32,
    bfloat16), and a CPU whose ISA oneDNN's packed kernels support for that dtype: bfloat16
    packing needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT, so on an AVX2-only CPU (e.g. AMD Zen 3)
    it raises at load time. Those CPUs keep the plain path, which is slower but correct.
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and cpu_supports_prepack(weight.dtype)
    )


@functools.lru_cache(maxsize=None)
def cpu_supports_prepack(dtype: torch.dtype) -> bool:
    """Whether this CPU can prepack (and run) a oneDNN linear weight of `dtype`; probed once per dtype.

    torch exposes no public per-dtype ISA query for oneDNN's packed linear (the requirement is
    checked inside the op, against the CPU's feature flags), so a tiny pack + matmul is the
    ground truth; the result is cached, so the probe costs microseconds once per process.
    Tests monkeypatch this function to pretend the CPU lacks support.
    """
    try:
        weight = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as e:
        logger.debug("oneDNN cannot prepack %s linear weights on this CPU: %s", dtype, e)
        return False
    return True


# The row count oneDNN lays a packed weight out for. The layout serves every row count, but its
# speed depends on the hint (benchmarks/packed_linear_hint.py: the demo model's projections +
# logits for one step of M rows, weights from memory as in a real step). Zen 3 (AVX2, float32,
# 2 threads), hint 1 / hint 16, two runs: M=1 33.9 / 31.9 and 33.9 / 31.1 ms, M=2 54.0 / 30.2 and
# 62.4 / 32.9, M=16 85.9 / 62.3 and 93.9 / 82.8, M=32 111.6 / 85.1 and 158.1 / 92.9; a 1,024-row
# prefill 2.29 / 2.14 s. A hint of 1 is tuned for one row and falls off a cliff from two; 16 is
# as fast for one row and 1.1-1.9x faster for the batched decode steps a server runs.
PACK_ROWS_HINT = 16


# Up to how many rows a step's linear goes through cpu_kernels' skinny_linear rather than oneDNN
# (Zen 3, 2 threads, the demo model's projections + logits, weights from memory):
#   float32: it streams the weights at ~28 GB/s against oneDNN's ~24 up to 4 rows; from 8 rows the
#     tiled variants tried were no faster (8 rows 33.7-46.5 ms against oneDNN's 34.8-38.2 in the
#     same runs, 32 rows 67.7-111 against 68.9-84.1), so oneDNN keeps those.
#   bfloat16 on a CPU without native bf16: against F.linear in bf16 (3-8x slower per row than fp32
#     at 8-32 rows) or widening the whole weight per call, the kernel widens each weight row once,
#     in registers or an L1 buffer: the demo model's batch-32 decode step 221-232 -> 125-128 ms
#     (float32: 109), batch 8 127-128 -> 56-60 ms (float32: 55).
SKINNY_ROWS_FLOAT32 = 4
SKINNY_ROWS_HALF = 64


def skinny_linear_for(weight: torch.Tensor):
    """cpu_kernels' decode linear for `weight` and up to how many rows it serves, or (None, 0)."""
    if weight.device.type != "cpu" or not weight.is_contiguous() or (ops := fused_ops()) is None:
        return None, 0
    if weight.dtype == torch.float32:
        return ops, SKINNY_ROWS_FLOAT32
    if weight.dtype == torch.bfloat16 and not cpu_computes_natively(torch.bfloat16):
        return ops, SKINNY_ROWS_HALF  # a native-bf16 CPU keeps oneDNN's bf16 kernels (unmeasured here)
    return None, 0


# Up to how many rows a bf16 linear goes through blocked_linear.cpp's vdpbf16ps kernel rather than
# oneDNN's packed copy, on CPUs with AVX512-BF16. Where it pays depends on what oneDNN runs there
# (2 threads, the demo model's projections x 30 layers, weights from memory, oneDNN / blocked, ms):
#  - with AMX, oneDNN turns to the tiles from 16 rows. Intel AMX VM: 1 row 16.1 / 10.1, 4 rows
#    16.2 / 12.4, 8 rows 16.0 / 15.4, 16 rows 16.5 / 24.3 (the kernel is bound by vdpbf16ps from
#    there). (On such CPUs AmxLinearWeight takes every weight whose K is a multiple of 32.)
#  - without AMX, oneDNN's own AVX512-BF16 kernels, which the blocked kernel matches or beats at
#    every row count, so it takes them all (None) and no oneDNN copy is made. 2-core AMD EPYC,
#    family 25 model 17 (Zen 4), two runs each: 1 row 9.3 / 4.7-4.9, 4 rows 8.8 / 5.6-5.8, 16 rows
#    13.7-13.9 / 10.7-11.0, 32 rows 21.8-22.3 / 18.2-18.3, 128 rows 71.5-72.1 / 63.7-64.2, 256 rows
#    128.6-129.9 / 126.1-127.5, 512 rows 260.1-260.3 / 254.4-255.2, 1,024 rows 508.8-519.3 /
#    513.7-520.1; a later sitting (qkv, o and down only, four alternating rounds) 513 rows
#    133.6-139.8 / 126.8-135.8, 1,024 rows 266.2-277.2 / 257.2-260.5, 2,048 rows 517.6-544.7 /
#    521.4-531.2. One kernel for every row count also keeps a row's bits independent of the rows
#    beside it: with oneDNN past 512 rows, a bf16 prompt's tokens changed with the prompts batched
#    beside it (tests/engine/test_batch_invariance.py).
BLOCKED_MAX_ROWS_BF16_BESIDE_AMX = 4


def blocked_max_rows_bf16() -> int | None:
    """Up to how many rows a bf16 PackedLinearWeight runs the vdpbf16ps kernel on this CPU
    (None: every row count)."""
    from hybridkv.cpu_features import cpu_features

    return BLOCKED_MAX_ROWS_BF16_BESIDE_AMX if "amx_bf16" in cpu_features().flags else None


def blocked_bf16_for(weight: torch.Tensor) -> ModuleType | None:
    """cpu_kernels' blocked linear module when its bf16 kernel serves `weight` here (a CPU bf16
    weight with an even K, a CPU with AVX512-BF16), else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        return None
    ops = blocked_linear_ops()
    return ops if ops is not None and ops.blocked_bf16_available() else None


def _streamed(copy: torch.Tensor, arena: HugePageArena | None) -> torch.Tensor:
    """The packed copy of a weight that decode steps stream, on huge pages: in the model's arena
    (huge_pages.HugePageArena, small weights too), or alone when it is large enough."""
    return arena.place(copy) if arena is not None else on_huge_pages(copy)


class PackedLinearWeight:
    """A weight [N, K] prepacked for oneDNN (or, where the vdpbf16ps kernel takes every bf16
    input, for that kernel alone); call it like F.linear(x, weight, bias). Inputs of
    up to `skinny_rows` rows (decode) go through cpu_kernels' skinny_linear when it is built here;
    bf16 inputs of up to `blocked_rows` rows (blocked_max_rows_bf16; None: every row count)
    through the vdpbf16ps blocked kernel where the CPU has AVX512-BF16 (decode steps and short
    chunks beside AMX, where it is one more copy of the weight; every input without AMX, where
    oneDNN's copy is never made)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, arena: HugePageArena | None = None) -> None:
        self.out_features = weight.shape[0]
        self.weight, self.bias = weight.detach(), bias
        self.skinny, self.skinny_rows = skinny_linear_for(self.weight)
        self.blocked = blocked_bf16_for(self.weight)
        self.blocked_rows = 0 if self.blocked is None else blocked_max_rows_bf16()
        # Where the blocked kernel takes every bf16 input, only an input of another dtype could
        # reach oneDNN: it takes F.linear on the parameter instead of a second copy of the weight.
        takes_all = self.blocked is not None and self.blocked_rows is None
        self.packed = None if takes_all else torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
        if self.blocked is not None:
            self.blocked_packed = _streamed(self.blocked.pack_interleaved_linear_bf16(self.weight), arena)
            padded = self.blocked_packed.shape[0] * 16  # column blocks x 16
            self.padded_bias = None if bias is None else F.pad(bias.detach().float(), (0, padded - self.out_features))
        # A gate/up projection whose halves are whole groups of three interleaved 16-column blocks
        # can hand silu(gate) * up from the vdpbf16ps kernel's registers (SiluAndMulMLP asks).
        self.fuses_silu = self.blocked is not None and self.out_features % 96 == 0

    def _blocked_takes(self, x: torch.Tensor) -> bool:
        return (self.blocked is not None and x.dtype == torch.bfloat16
                and (self.blocked_rows is None or x.numel() <= self.blocked_rows * x.shape[-1]))

    def silu_fits(self, x: torch.Tensor) -> bool:
        """Whether silu_and_mul(x) runs here (else the MLP takes self(x) and fused_ops' SiLU):
        wherever self(x) takes the vdpbf16ps kernel. 2-core Zen 4, the demo model's 576 -> 2 x
        1,536 at 1,024 rows, fused 8.6-8.9 ms against oneDNN + silu_and_mul 9.2-9.7 (the plain
        kernel + silu_and_mul 9.0-9.2)."""
        return self._blocked_takes(x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection of bf16 `x`, bit for bit fused_ops'
        silu_and_mul of self(x) through the vdpbf16ps kernel, without writing and re-reading the
        projection."""
        shape = x.shape
        out = self.blocked.blocked_linear_silu_mul_bf16(x.reshape(-1, shape[-1]), self.blocked_packed,
                                                        self.padded_bias, self.out_features)
        return out.view(*shape[:-1], self.out_features // 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._blocked_takes(x2):
            out = self.blocked.blocked_linear_bf16(x2, self.blocked_packed, self.padded_bias, self.out_features)
        elif x2.shape[0] <= self.skinny_rows and x.dtype == self.weight.dtype:
            out = self.skinny.skinny_linear(x2, self.weight, self.bias)
        elif self.packed is None:
            out = F.linear(x2, self.weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)


def blocked_linear_for(weight: torch.Tensor) -> ModuleType | None:
    """cpu_kernels' blocked linear module when it serves `weight` here, else None: a float32 CPU
    weight, on a CPU whose kernels are built for AVX-512 (16 lanes). On AVX2 the same kernel was
    faster than oneDNN for decode steps but 16% slower for a 1,024-row prefill (emulated on the
    Intel VM with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), and never measured on a real
    AVX2 CPU, so those keep oneDNN."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or isa_flags()[0] != "avx512":
        return None
    return blocked_linear_ops()


# Inputs of up to this many rows go through the blocked kernel (one row tile of blocked_linear.cpp),
# more through F.linear on the parameter (MKL), on Intel CPUs. Intel AMX VM, 2 threads, the demo
# model's projections x 30 layers, F.linear / blocked, ms: 64 rows 94-98 / 69-70, 128 rows 133-135 /
# 117-121, 193 rows 214-215 / 170-178, 256 rows 254-266 / 226, 320 rows 298-320 / 304-306, 512 rows
# 464-509 / 466-490 (a slower phase of the VM than the first rows'); 1,024 rows: F.linear 788-807,
# oneDNN's packed weight 832-861. A step of ~180 prompt tokens beside ~13 decodes (serve defaults
# under benchmarks/online_peer.py's load) lands just here.
# Elsewhere MKL does not take its fast paths (it dispatches on the vendor), and the blocked kernel
# keeps every row count. 2-core AMD EPYC, family 25 model 17 (Zen 4), the same projections, ms
# (GFLOP/s): F.linear / blocked / oneDNN's packed weight, 32 rows 71.9 (95) / 38.5 (176) / 44.5
# (153), 256 rows 314.9 (173) / 249.6 (218) / 258.8 (210), 1,024 rows 1,328.9 (164) / 1,073.9 (202)
# / 1,003.3 (217).
BLOCKED_MAX_ROWS = 256


def blocked_max_rows() -> int | None:
    """Up to how many rows a float32 BlockedLinearWeight runs the blocked kernel on this CPU
    (None: every row count)."""
    from hybridkv.cpu_features import cpu_features

    return BLOCKED_MAX_ROWS if cpu_features().vendor == "GenuineIntel" else None


class BlockedLinearWeight:
    """A float32 weight [N, K] in cpu_kernels' column-block layout (blocked_linear.cpp, which has
    the measurements against oneDNN) for inputs of up to blocked_max_rows() rows (on Intel:
    decode steps, short chunks; elsewhere every input), F.linear on the parameter for more; call
    it like F.linear(x, weight, bias). It
    replaces PackedLinearWeight's oneDNN copy, so the weight memory stays the parameter plus one
    copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: ModuleType,
                 arena: HugePageArena | None = None) -> None:
        self.ops, self.out_features = ops, weight.shape[0]
        self.weight, self.bias = weight.detach(), bias
        self.max_rows = blocked_max_rows()
        # On huge pages like the parameters (huge_pages.py): a decode step streams this copy.
        # Intel AMX VM, the demo model's projections x 30 layers: 1 row 15.7-16.2 -> 14.8 ms,
        # 16 rows 25.8-27.7 -> 24.9-25.0 ms.
        self.packed = _streamed(ops.pack_blocked_linear(self.weight), arena)
        padded = self.packed.shape[0] * self.packed.shape[2]
        self.padded_bias = None if bias is None else F.pad(bias.detach().float(), (0, padded - self.out_features))

        # A gate/up projection ([gate; up], each a whole number of 16-column blocks) can hand
        # silu(gate) * up without writing the [rows, N] projection (SiluAndMulMLP asks).
        self.fuses_silu = self.out_features % 32 == 0 and ops.blocked_silu_mul_available()

    def _blocked_takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and (self.max_rows is None or x.numel() <= self.max_rows * x.shape[-1])

    @property
    def serves_every_input(self) -> bool:
        """Whether the column-block copy serves every float32 input (no row limit on this CPU):
        the parameter is then read by nothing and may be released (release_packed_parameter)."""
        return self.max_rows is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None and x.dtype != torch.float32:  # the parameter is gone: the copy serves
            return self(x.float()).to(x.dtype)
        if not self._blocked_takes(x):
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        out = self.ops.blocked_linear(x.reshape(-1, shape[-1]), self.packed, self.padded_bias, self.out_features)
        return out.view(*shape[:-1], self.out_features)

    def silu_fits(self, x: torch.Tensor) -> bool:
        """Whether silu_and_mul(x) runs here (else the MLP takes self(x) and fused_ops' SiLU)."""
        return self._blocked_takes(x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection of float32 `x`, bit for bit fused_ops'
        silu_and_mul of self(x), without writing and re-reading the [rows, N] projection
        (blocked_linear.cpp has the timings)."""
        shape = x.shape
        out = self.ops.blocked_linear_silu_mul(x.reshape(-1, shape[-1]), self.packed, self.padded_bias,
                                               self.out_features)
        return out.view(*shape[:-1], self.out_features // 2)


def amx_linear_for(weight: torch.Tensor) -> tuple[ModuleType, ModuleType] | None:
    """(blocked linear module, AMX linear module) when amx_linear.cpp serves `weight` here: a CPU
    bf16 weight whose K is a multiple of 32, on a CPU with AMX-BF16; else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 32:
        return None
    blocked, amx = blocked_linear_ops(), amx_linear_ops()
    return None if blocked is None or amx is None else (blocked, amx)


class AmxLinearWeight:
    """A bfloat16 weight [N, K] in blocked_linear.cpp's bf16 column blocks, multiplied on AMX tiles
    (amx_linear.cpp) for every row count; call it like F.linear(x, weight, bias). Intel AMX VM,
    2 threads, the demo model's projections x 30 layers, weights from memory, oneDNN's packed bf16
    linear / this, ms: 1 row 13.1 / 8.7, 4 rows 12.6 / 8.7, 16 rows 13.1 / 8.2, 32 rows 14.8 / 9.5,
    64 rows 16.8 / 11.8, 128 rows 21.9 / 17.1, 256 rows 28.7 / 26.0, 1,024 rows 116.8 / 88.2 (one
    sitting). It replaces oneDNN's packed copy (and the vdpbf16ps path's), so the weight memory
    stays the parameter plus one copy. Inputs of another dtype take F.linear on the parameter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: tuple[ModuleType, ModuleType],
                 arena: HugePageArena | None = None) -> None:
        blocked, self.amx = ops
        self.out_features = weight.shape[0]
        self.weight, self.bias = weight.detach(), bias
        self.packed = _streamed(blocked.pack_blocked_linear_bf16(self.weight), arena)
        padded = self.packed.shape[0] * self.packed.shape[2]
        self.padded_bias = None if bias is None else F.pad(bias.detach().float(), (0, padded - self.out_features))

        # A gate/up projection ([gate; up], each a whole number of 16-column blocks) can hand
        # silu(gate) * up straight from the tiles (SiluAndMulMLP asks).
        self.fuses_silu = self.out_features % 32 == 0

    def silu_fits(self, x: torch.Tensor) -> bool:
        """Whether silu_and_mul(x) runs here (else the MLP takes self(x) and fused_ops' SiLU)."""
        return x.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        out = self.amx.amx_linear_bf16(x.reshape(-1, shape[-1]), self.packed, self.padded_bias, self.out_features)
        return out.view(*shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection of bf16 `x`, bit for bit fused_ops'
        silu_and_mul of self(x), without writing and re-reading the [rows, N] projection: on the
        Intel AMX VM, 1,024 rows x 576 -> 2 x 1,536, 2.04-2.06 ms -> 1.45 ms."""
        shape = x.shape
        out = self.amx.amx_linear_silu_mul_bf16(x.reshape(-1, shape[-1]), self.packed, self.padded_bias,
                                                self.out_features)
        return out.view(*shape[:-1], self.out_features // 2)


def fast_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, arena: HugePageArena | None = None):
    """The fastest F.linear(x, weight, bias) this CPU has for `weight`: BlockedLinearWeight,
    AmxLinearWeight, PackedLinearWeight (oneDNN) or WidenedLinearWeight; None when plain F.linear
    is it. The copy a decode step streams goes into `arena` (a model's weights share one, in the
    order forward reads them)."""
    if (ops := blocked_linear_for(weight)) is not None:
        return BlockedLinearWeight(weight, bias, ops, arena)
    if (amx := amx_linear_for(weight)) is not None:
        return AmxLinearWeight(weight, bias, amx, arena)
    if packing_supported(weight):
        return PackedLinearWeight(weight, bias, arena)
    if needs_widening(weight):
        return WidenedLinearWeight(weight, bias)
    return None


# -- half-precision weights on CPUs without native half compute ---------------------------------
#
# On an AVX2-only CPU (e.g. AMD Zen 3) torch's bfloat16/float16 matmul of many rows runs 3-8x
# slower than float32 (measured there: F.linear of 1,024 rows, 576 -> 1,536, 116 ms in bfloat16
# vs 14 ms in float32), while a matmul of one or a few rows is as fast or faster (it is
# bandwidth-bound and streams half the bytes: the demo model's 49k x 576 logits matrix, 4.0 vs
# 9.9 ms at one row). So such weights stay in half precision -- half the memory, half the bytes
# per decode step -- and an input of many rows (prefill) widens the weight to float32 for that
# call: the conversion is one pass over the weight, small next to a GEMM of that many rows.
# The crossover measured there: ~8 rows for the projections, ~24 for the logits matrix (whose
# widening is DRAM-bound); WIDEN_MIN_ROWS and twice it for weights above LARGE_WEIGHT sit past both.
WIDEN_MIN_ROWS = 16
LARGE_WEIGHT = 1 << 22  # elements


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has native compute for `dtype` (cpu_features decides; tests patch this)."""
    from hybridkv.cpu_features import cpu_features

    return cpu_features().native(dtype)


def needs_widening(weight: torch.Tensor) -> bool:
    """Whether `weight` is a half-precision CPU weight this CPU has no native compute for."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and not cpu_computes_natively(weight.dtype))


class WidenedLinearWeight:
    """F.linear(x, weight, bias) for a half-precision weight on a CPU without native half
    compute: a bfloat16 decode step (up to SKINNY_ROWS_HALF rows) through cpu_kernels'
    skinny_linear, which widens the weight in registers; without it, as it is for inputs of few
    rows. Through float32 (result rounded back to the input dtype) for inputs of more rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight.detach(), bias
        self.min_rows = WIDEN_MIN_ROWS * (2 if weight.numel() > LARGE_WEIGHT else 1)
        self.skinny, self.skinny_rows = skinny_linear_for(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.skinny_rows and x.dtype == self.weight.dtype:
            return self.skinny.skinny_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias).view(
                *x.shape[:-1], self.weight.shape[0])
        if rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def packed_forward(linear: nn.Module):
    """The prepacked weight object pack_linear_weights put in front of nn.Linear `linear` (its
    instance-level forward), or None where it kept plain F.linear."""
    return linear.__dict__.get("forward")


# Released parameter bytes between two trims of the heap while packing: the released memory
# goes back to the OS as it goes, so the load's peak stays near the weights' size.
TRIM_EVERY_BYTES = 32 << 20


def packed_copy_serves_every_input(weight: torch.Tensor) -> bool:
    """Whether fast_linear(weight) will be a BlockedLinearWeight that serves every input here
    (float32 weights on a non-Intel AVX-512 CPU): its parameter is then dead weight once packed."""
    return blocked_linear_for(weight) is not None and blocked_max_rows() is None


def release_packed_parameter(module: nn.Linear, linear: BlockedLinearWeight) -> int:
    """Drop the parameter `linear` (module's packed forward) no longer reads: module.weight becomes a
    meta tensor of its shape and dtype (introspection keeps working, the values and their memory
    go). Returns the bytes released."""
    assert linear.serves_every_input, "the parameter serves inputs past the row limit"
    w = module.weight
    linear.weight = None
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    return w.numel() * w.element_size()


def pack_linear_weights(model: nn.Module, arena: HugePageArena | None = None,
                        release: frozenset[int] = frozenset()) -> int:
    """Route every nn.Linear of `model` through a prepacked weight where `packing_supported`
    says so; the others keep plain F.linear. Returns how many were packed, and logs which path
    each weight dtype took (so a slow bfloat16 decode on an AVX2-only CPU is explained in the log).

    Call after the weights are loaded and cast. The parameters stay in place (state_dict and
    introspection keep working), the packed copy is what forward reads; except that the modules
    whose id() is in `release` (ones nothing reads but their forward) whose packed copy serves
    every input give up their parameter's memory (release_packed_parameter): the weights are then held
    once, not twice.
    """
    blocked_by_dtype: dict[torch.dtype, int] = {}
    amx_by_dtype: dict[torch.dtype, int] = {}
    packed_by_dtype: dict[torch.dtype, int] = {}
    plain_by_dtype: dict[torch.dtype, int] = {}
    widened_by_dtype: dict[torch.dtype, int] = {}
    released_bytes = trimmed_at = 0
    arena = arena or HugePageArena()
    for module in model.modules():  # registration order, which is forward order in every model here
        if not isinstance(module, nn.Linear):
            continue
        dtype = module.weight.dtype
        linear = fast_linear(module.weight, module.bias, arena)
        if linear is not None:
            module.forward = linear  # instance attribute shadows nn.Linear.forward
        if id(module) in release and isinstance(linear, BlockedLinearWeight) and linear.serves_every_input:
            released_bytes += release_packed_parameter(module, linear)
            if released_bytes - trimmed_at >= TRIM_EVERY_BYTES:  # the heap keeps freed memory (heap_retention.py)
                release_free_heap()
                trimmed_at = released_bytes
        by_type = {BlockedLinearWeight: blocked_by_dtype, AmxLinearWeight: amx_by_dtype,
                   PackedLinearWeight: packed_by_dtype, WidenedLinearWeight: widened_by_dtype}
        counts = by_type.get(type(linear), plain_by_dtype)
        counts[dtype] = counts.get(dtype, 0) + 1
    capability = torch.backends.cpu.get_cpu_capability()
    for dtype, n in blocked_by_dtype.items():
        logger.info("linear weights: %d %s layer(s) in column blocks for the CPU blocked linear (CPU capability %s)",
                    n, dtype, capability)
    for dtype, n in amx_by_dtype.items():
        logger.info("linear weights: %d %s layer(s) in column blocks for the AMX linear", n, dtype)
    for dtype, n in packed_by_dtype.items():
        logger.info("linear weights: %d %s layer(s) prepacked for oneDNN (CPU capability %s)", n, dtype, capability)
    for dtype, n in widened_by_dtype.items():
        logger.info("linear weights: %d %s layer(s) kept in %s, widened to float32 for inputs of >= %d rows "
                    "(no native %s compute on this CPU, capability %s)", n, dtype, dtype, WIDEN_MIN_ROWS, dtype,
                    capability)
    for dtype, n in plain_by_dtype.items():
        logger.info(
            "linear weights: %d %s layer(s) use plain F.linear (oneDNN prepacking is not available for "
            "this dtype on this CPU, capability %s)", n, dtype, capability,
        )
    if released_bytes:
        logger.info("linear weights: %.0f MiB of parameters released (their column-block copies serve every input)",
                    released_bytes / 2**20)
    return sum(packed_by_dtype.values()) + sum(blocked_by_dtype.values()) + sum(amx_by_dtype.values())
