"""Writes the step's new keys and values into their cache slots.

The cache of a layer is head-major, [Hkv, num_slots, D]; slot_mapping [T] names the slot of each
new token (metadata.build_space_metadata). One program per token copies its [Hkv, D] key and
value rows, so a step costs T programs whatever the pool size. Addresses are computed in int64:
a pool of millions of slots times the head stride overflows int32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    k_cache: torch.Tensor,  # [Hkv, num_slots, D], same dtype as k
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    """k_cache[:, slot_mapping[t]] = k[t] (and the same for v), for every token t."""
    T, hkv, D = k.shape
    if T == 0:
        return
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise TypeError(f"K/V of dtype {k.dtype} cannot be written into a {k_cache.dtype} cache")
    _kv_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        hkv, D,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(D),
    )
