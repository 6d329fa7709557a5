"""Paged prefill (extend) attention over a varlen batch of multi-token chunks.

A chunk of sequence i holds queries at positions [start, context_len), start = context_len -
query_len: tokens already in the cache (a prefix hit or earlier chunks) come first. The new
K/V are written into the cache before this runs, so a query reads every one of its keys the
same way, through the block table (the approach of vLLM's unified Triton attention): no
separate path for the cached prefix and the chunk's own tokens.

One program per (sequence, block of BLOCK_M queries, query head) walks keys [window start of its
first query, position of its last query] BLOCK_N at a time with an online softmax; the mask is
causal plus the sliding window, per (query, key). Rows past the chunk's end are computed on
zeros and not stored. Keys below the block's window start (pages the window released) are not
read at all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.attention_backends.triton_attention.common import NEG_BIG, dot_block, dot_config


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_ptr, context_lens_ptr, out_ptr,
    first_seq, scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    row0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - row0
    if q_block * BLOCK_M >= q_len:  # the grid is sized for the longest chunk
        return
    ctx = tl.load(context_lens_ptr + seq)
    start = ctx - q_len
    m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = start + m
    d = tl.arange(0, BLOCK_D)
    io_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    rows = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd, mask=io_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    kv_head = (head // GROUP).to(tl.int64)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh

    first_pos = start + q_block * BLOCK_M
    lo = tl.maximum(first_pos - window + 1, 0) if USE_WINDOW else 0  # window_start(first query)
    hi = tl.minimum(first_pos + BLOCK_M, ctx)  # one past the last query's position
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(lo, hi, BLOCK_N):
        pos = k0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page = tl.load(block_table_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        see = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            see &= pos[None, :] > q_pos[:, None] - window
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on the rows past the chunk
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]: the whole step; chunk i's rows from query_start_loc
    k_cache: torch.Tensor,  # [Hkv, num_slots, D], the chunks' own K/V already written
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, width] page ids; row i = sequence i
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    first_seq: int,  # the chunks are sequences [first_seq, first_seq + num_seqs)
    num_seqs: int,
    max_query_len: int,
    page_size: int,
    window: int | None,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: the chunks' rows are written
    block_m: int,
    block_n: int,
) -> None:
    H, D = q.shape[1:]
    hkv = k_cache.shape[0]
    dot_dtype, precision = dot_config(q.dtype, _prefill_kernel)
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_m), H)](
        q, k_cache, v_cache, block_table, query_start_loc, context_lens, out,
        first_seq, scale, window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(),
        GROUP=H // hkv, HEAD_DIM=D, PAGE_SIZE=page_size,
        USE_WINDOW=window is not None, DOT_DTYPE=dot_dtype, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dot_block(D),
        num_warps=4,
    )
