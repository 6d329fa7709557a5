"""The KV cache's element type (`kv_cache_dtype`, vLLM's names) and the FP8 conversions.

"auto" stores K/V in the model's dtype. "fp8" (= "fp8_e4m3") and "fp8_e5m2" store them as
torch.float8_e4m3fn / torch.float8_e5m2, one byte an element: an equal budget holds twice the
pages of a bfloat16 cache (four times a float32 one).

Scale. Every write is `clamp(x, -max, max).to(fp8)` and every read `x.to(float)` with a
per-tensor scale of 1.0, which is what vLLM does when a checkpoint ships no KV scales (its
`k_scale = v_scale = 1.0` default). Why no computed scale: the checkpoints this engine loads carry
none, and FP8 is floating point, so a scale only moves values between its normal range (relative
precision 2^-4 for e4m3 at every magnitude) and its ends (saturation above 448, subnormals below
2^-6). The demo model's keys peak at 10-25 and its values at 0.6-16 per layer over 1,024 tokens of
source code (a few per cent of the values under 2^-6, 38% in the first layer), so nothing
saturates; a fixed per-layer power-of-two scale mapping each layer's K and V maximum to 224,
emulated over 3,069 teacher-forced positions, gave next-token agreement 0.961 against 0.958 with
scale 1.0 and a larger mean |delta logprob| (0.087 against 0.085): the loss is the 3-bit mantissa,
which no scale recovers. The measured agreement is in benchmarks/README.md (kv_cache_dtype.py).

Saturating: a value beyond the format's finite maximum is clamped to it before the cast (e5m2
would otherwise overflow to inf, and an inf key turns a whole softmax row into NaN).
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def validate_kv_cache_dtype_name(name: str) -> None:
    """ValueError listing the choices when `name` is not one of them."""
    if name not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {list(KV_CACHE_DTYPE_CHOICES)}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV pools are stored in: the model's for "auto", else the FP8 format."""
    validate_kv_cache_dtype_name(name)
    return model_dtype if name == "auto" else _FP8_BY_NAME[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in cache_dtype, as a cache of that dtype stores it: cast for a model-dtype cache, else
    saturated to the FP8 format's finite range and cast (round to nearest even, scale 1.0). Rows
    already in cache_dtype (an FP8 mirror's) are returned as they are: torch has no clamp for FP8."""
    if x.dtype == cache_dtype:
        return x
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return x.clamp(-limit, limit).to(cache_dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, dim: int = 0) -> None:
    """cache's entries `slots` along dim = values, as the cache stores them (quantize_kv), moved
    as bytes: torch has no index_copy_ for FP8. Every torch-side KV write goes through here."""
    byte_view(cache).index_copy_(dim, slots, byte_view(quantize_kv(values, cache.dtype)))


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements as `dtype` (exact: every FP8 value is a bfloat16 and a float32 value)."""
    return x if x.dtype == dtype else x.to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as an attention read gets it back from a cache of cache_dtype, in x's dtype: the rows a
    chunk attends to before (or without) reading them from the cache must be these, so that a
    chunk's own keys and a cached prefix's are the same numbers."""
    return x if not is_fp8(cache_dtype) else quantize_kv(x, cache_dtype).to(x.dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as uint8 (the same bytes; torch has no index_copy_ for FP8), others as they
    are: page copies move FP8 bytes exactly as stored."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
