"""Fused C++ ops for the decoder layers on the CPU (fused_ops.cpp), compiled on first use.

A decode step of a small model is its weight stream plus ~60 small torch ops per layer, each a
few microseconds of dispatch and allocation; single-stream decode of the demo model spent ~8 of
its ~35 ms per token there (Zen 3). These replace the hot ones -- the few-row linear (decode's
GEMV, also bf16 weights widened in registers), RMSNorm, RoPE, SiLU x mul, mHC's Sinkhorn loop -- where they apply;
the torch code stays as the fallback and as the reference the tests hold them to. Built like the
attention kernels (attention_backends/cpu_kernels/build.py): HYBRIDKV_CPU_KERNELS=0, no compiler
or a failed build leave `fused_ops()` None (logged once) and every layer on its torch path.

`blocked_linear_ops()` (blocked_linear.cpp) is the float32 linear of any row count from a weight
in column blocks; layers.BlockedLinearWeight uses it on AVX-512 CPUs instead of oneDNN's packed
weight. Its own module: it is built with FMA contraction on, which fused_ops.cpp turns off.

`decode_layers_ops()` (decode_layers.cpp) runs a Llama-family decode step through every layer in
one call: it calls these modules' kernels (and the paged attention kernel) through the addresses
their `kernel_addresses()` give, so each keeps the flags it was built with.
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from hybridkv.attention_backends.cpu_kernels import (
    AMX_TILES_HEADER, build_cpu_extension, load_paged_attention_module, load_prefill_attention,
    load_prefill_attention_bf16,
)

_FUNCTIONS = ["skinny_linear", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "hc_sinkhorn_", "argmax_rows",
              "kernel_addresses"]


@functools.lru_cache(maxsize=1)
def fused_ops() -> ModuleType | None:
    """The compiled module (functions in _FUNCTIONS), or None when it cannot be built here."""
    # -ffp-contract=off: a*b + c*d rounds each product as torch's separate ops do (see the source)
    return build_cpu_extension("hybridkv_fused_ops", Path(__file__).with_name("fused_ops.cpp"), _FUNCTIONS,
                               "CPU fused ops", extra_cflags=("-ffp-contract=off",))


@functools.lru_cache(maxsize=1)
def blocked_linear_ops() -> ModuleType | None:
    """blocked_linear.cpp compiled (`pack_blocked_linear`, `blocked_linear`, the fused gate/up +
    SiLU `blocked_linear_silu_mul` where `blocked_silu_mul_available()`, and for bf16
    `pack_interleaved_linear_bf16` / `blocked_linear_bf16` / `blocked_linear_silu_mul_bf16` where
    `blocked_bf16_available()`, and
    `pack_blocked_linear_bf16`, the plain column blocks amx_linear.cpp reads), or None when it
    cannot be built here."""
    return build_cpu_extension("hybridkv_blocked_linear", Path(__file__).with_name("blocked_linear.cpp"),
                               ["pack_blocked_linear", "blocked_linear", "blocked_linear_silu_mul", "blocked_silu_mul_available",
                                "pack_blocked_linear_bf16",
                                "pack_interleaved_linear_bf16", "blocked_linear_bf16", "blocked_linear_silu_mul_bf16",
                                "blocked_bf16_available",
                                "kernel_addresses"],
                               "CPU blocked linear")


@functools.lru_cache(maxsize=1)
def decode_layers_ops() -> ModuleType | None:
    """decode_layers.cpp compiled (`decode_layers`: a Llama-family decode step through every
    layer in one call, calling the other modules' kernels by address (fused_decode.py);
    `decode_burst`: several greedy steps of it with the logits head and argmax in between), or
    None when it cannot be built here."""
    return build_cpu_extension("hybridkv_decode_layers", Path(__file__).with_name("decode_layers.cpp"),
                               ["decode_layers", "decode_burst"], "CPU fused decode layers")


@functools.lru_cache(maxsize=1)
def amx_linear_ops() -> ModuleType | None:
    """amx_linear.cpp compiled (`amx_linear_bf16`, `amx_linear_silu_mul_bf16`, `amx_available`):
    the bf16 linear on AMX tiles from blocked_linear.cpp's bf16 layout, or None where the CPU has no AMX-BF16, the process may
    not use the tile state, or it cannot be built here."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is None or not probe():
        return None
    module = build_cpu_extension("hybridkv_amx_linear", Path(__file__).with_name("amx_linear.cpp"),
                                 ["amx_linear_bf16", "amx_linear_silu_mul_bf16", "amx_available"], "CPU AMX linear",
                                 # -ffp-contract=off: the fused SiLU rounds as fused_ops' silu_and_mul does
                                 extra_cflags=("-mamx-tile", "-mamx-bf16", "-mavx512bf16", "-ffp-contract=off"),
                                 headers=(AMX_TILES_HEADER,))
    return module if module is not None and module.amx_available() else None


def dense_model_kernel_loaders(dtype: torch.dtype) -> list[Callable[[], object]]:
    """The modules a dense (Llama-family) model in `dtype` uses on the CPU: attention (paged and
    prefill; the bf16 prefill kernel and the AMX linear only for bfloat16), the fused ops, the
    blocked linear and the fused decode layers. The attention modules first: the attention
    backend waits for them before the weights load."""
    loaders: list[Callable[[], object]] = [load_paged_attention_module, load_prefill_attention, decode_layers_ops,
                                           blocked_linear_ops, fused_ops]
    if dtype == torch.bfloat16:
        loaders += [load_prefill_attention_bf16, amx_linear_ops]
    return loaders
