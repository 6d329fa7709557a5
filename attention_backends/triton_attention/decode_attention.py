"""Paged decode attention with split-KV: one query token per sequence, its keys read through
the block table, in two stages (the design of SGLang's two-stage Triton decode kernel).

  Stage 1: one program per (sequence, KV head, split). The keys a query reads, positions
  [window start, context length), are cut into num_splits equal ranges (multiples of BLOCK_N
  keys); each program walks its range BLOCK_N keys at a time, looking up each key's page in the
  block table, and keeps an online softmax for all GROUP query heads of its KV head at once (one
  [BLOCK_H, D] x [D, BLOCK_N] dot: GQA heads share each K/V load). It writes its normalised
  partial output and the log-sum-exp of its scores, in float32.
  Stage 2: one program per (sequence, query head) merges the splits by their log-sum-exp.

Splitting is what keeps a GPU busy on a small decode batch with long contexts: B x Hkv programs
alone would leave most SMs idle. A split with no keys (short sequences) writes output 0 and a
log-sum-exp of -1e30, so it weighs nothing in the merge. Keys are gathered by position, so pages
the window released (NULL_PAGE in the table) are never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.attention_backends.triton_attention.common import NEG_BIG, dot_block, dot_config


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr,
    scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    key_start = tl.maximum(ctx - window, 0) if USE_WINDOW else 0  # window_start(ctx - 1)
    per_split = tl.cdiv(tl.cdiv(ctx - key_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = key_start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page = tl.load(block_table_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)  # an empty split: output 0, log-sum-exp NEG_BIG
    row = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [B, H, NUM_SPLITS] order
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / safe_l[:, None], mask=q_mask)
    tl.store(part_lse_ptr + row, m_i + tl.log(safe_l), mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 always holds the query's own key: the max is real
    mask = (sp < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # [B, H, D]: the decode rows of the step (sequence i = row i)
    k_cache: torch.Tensor,  # [Hkv, num_slots, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= B, width] page ids; row i = sequence i
    context_lens: torch.Tensor,  # [>= B] tokens in the cache, the query's own included
    page_size: int,
    window: int | None,
    scale: float,
    out: torch.Tensor,  # [B, H, D], written
    num_splits: int,
    block_n: int,
) -> None:
    B, H, D = q.shape
    hkv = k_cache.shape[0]
    group = H // hkv
    dot_dtype, precision = dot_config(q.dtype, _decode_split_kernel)
    part_out = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, block_table, context_lens, part_out, part_lse,
        scale, window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        GROUP=group, HEAD_DIM=D, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        USE_WINDOW=window is not None, DOT_DTYPE=dot_dtype, PRECISION=precision,
        BLOCK_H=dot_block(group), BLOCK_N=block_n, BLOCK_D=dot_block(D),
        num_warps=4,
    )
    _decode_merge_kernel[(B, H)](
        part_out, part_lse, out, *out.stride(),
        HEAD_DIM=D, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )
