"""Writes the step's new cache rows into their slots.

write_kv: a dense layer's cache is head-major, [Hkv, num_slots, D]; slot_mapping [T] names the
slot of each new token (metadata.build_space_metadata). One program per token copies its [Hkv, D]
key and value rows.

write_rows: DeepSeek-V4's caches are one row per slot, [num_slots, D] (the SWA keys, the
compressor's raw state rows and gates, the C4/C128/indexer entries a closed window pooled into;
hybrid_metadata names their slots). One program per row copies it. Rows in another dtype are
converted by torch first, as the torch twin (hybrid_v4.write_slots) converts them (into an FP8
cache: kv_cache_dtype.quantize_kv, saturated, round to nearest even), so the kernel only copies,
FP8 as bytes: a kernel-side cast rounds differently from torch's under the interpreter, and the
cache must hold the same bits.

Either way a step costs one program per new row whatever the pool size. Addresses are computed
in int64: a pool of millions of slots times the row stride overflows int32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.attention_backends.kv_cache_dtype import byte_view, is_fp8, quantize_kv


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kch, stride_kcs, stride_kcd,
    stride_vch, stride_vcs, stride_vcd,
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + h * stride_kch + slot * stride_kcs + d * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + h * stride_vch + slot * stride_vcs + d * stride_vcd, v, mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [Hkv, num_slots, D], same dtype as k, or FP8 (kv_cache_dtype)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    """k_cache[:, slot_mapping[t]] = k[t] (and the same for v), for every token t. Into an FP8
    cache the rows are quantized by torch first (kv_cache_dtype.quantize_kv: saturated, round to
    nearest even), so the cache holds the torch-native backend's bits; the kernels widen them back
    as they load them."""
    T, hkv, D = k.shape
    if T == 0:
        return
    if not is_fp8(k_cache.dtype) and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype):
        raise TypeError(f"K/V of dtype {k.dtype} cannot be written into a {k_cache.dtype} cache")
    k, v = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
    _kv_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        hkv, D,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(D),
    )


@triton.jit
def _row_write_kernel(
    src_ptr, dst_ptr, slot_ptr,
    stride_src_r, stride_src_d, stride_dst_s, stride_dst_d,
    dim,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    for start in range(0, dim, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        mask = d < dim
        row = tl.load(src_ptr + r * stride_src_r + d * stride_src_d, mask=mask)
        tl.store(dst_ptr + slot * stride_dst_s + d * stride_dst_d, row, mask=mask)


ROW_BLOCK_D = 256  # columns per inner step: V4's head_dim (512) in two


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots[r]] = values[r] as the cache stores it (cast to its dtype, or quantized into its
    FP8 format), for every row r (cache [num_slots, D]): the bytes hybrid_v4.write_slots stores."""
    if not slots.numel():
        return
    if values.dim() != 2 or cache.dim() != 2 or values.shape[1] != cache.shape[1]:
        raise ValueError(f"rows of shape {tuple(values.shape)} cannot be written into a cache of "
                         f"shape {tuple(cache.shape)}")
    if values.shape[0] != slots.numel():
        raise ValueError(f"{values.shape[0]} rows for {slots.numel()} slots")
    # A no-op when the model computes in the cache's dtype. FP8 moves as bytes: the kernel never converts.
    rows = byte_view(quantize_kv(values, cache.dtype))
    dst = byte_view(cache)
    D = cache.shape[1]
    _row_write_kernel[(slots.numel(),)](
        rows, dst, slots,
        *rows.stride(), *dst.stride(),
        D,
        BLOCK_D=min(ROW_BLOCK_D, triton.next_power_of_2(D)),
    )
