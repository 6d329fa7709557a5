"""DeepSeek-V4 hybrid attention and lightning-indexer scoring as Triton kernels.

Same math as the torch-native reference (attention_backends/hybrid_v4.py), same metadata
(hybrid_metadata.py: every read goes through a KeySet's slot list):

  _indexer_scores_kernel   one program per (query, key block): gathers the indexer keys of
                           the block by slot, s = Σ_h w[t,h] · ReLU(q[t,h] · K[e]) · scale with
                           the heads reduced in registers, -inf past the query's causal count.
  _hybrid_attention_kernel one program per (query, block of heads): one online softmax over
                           the SWA window keys (by slot, explicit mask), then the compressed
                           entries (by slot: the CSA top-k list or every causal C128 entry),
                           started from the sink logit (value 0). V4 attention is MQA: one
                           shared K=V head for all query heads, so a key block is loaded once
                           per program and multiplied against all its heads. fp32 throughout.

Reused from the torch reference, not kernelized: the top-k selection (select_topk /
merge_topk through blockwise_topk, on the kernel's scores), HybridV4Attention.entries (which
entries a block reads: KeySet.take of the chosen ones, or HiSparse's hot-buffer key set), the
metadata itself, and the compressor's pooling (model side). The cache writes the model makes
through `backend.write` (SWA keys, compressor state rows, pooled entries) are kv_write.write_rows.

FP8 caches (kv_cache_dtype): the writes store write_slots' bytes (write_rows quantizes by
torch, then copies), and both kernels widen each FP8 key to float32 as they load it -- exact,
as the reference's reads widen them (dequantize_kv) -- so they compute on the same numbers.

Top-k guarantee: the selection is the reference's strict total order (score descending,
then entry index ascending) applied to the kernel's scores, and blockwise selection equals
the one-shot one. So the chosen entries are exactly the torch path's whenever the scores are
bit-equal: exact zeros (every head's ReLU 0, common) and exactly representable sums tie and
break identically. Scores only differ by fp32 summation order (~1e-7 relative), so two
entries whose true scores are that close may swap; the tests check identical indices on
exact data and identical sets on random data.

Checked on the CPU under TRITON_INTERPRET=1 (tests/attention_backends/test_triton_hybrid_v4.py);
block sizes are untuned (tl.dot's 16-wide minimum is respected, so the kernels compile for GPUs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.attention_backends.hisparse_reads import HiSparseLayer
from hybridkv.attention_backends.triton_attention.hisparse_swap_in import triton_swap_in
from hybridkv.attention_backends.triton_attention.kv_write import write_rows
from hybridkv.attention_backends.hybrid_metadata import HybridAttentionMetadata, KeySet
from hybridkv.attention_backends.hybrid_v4 import (
    INDEXER_BLOCK_ELEMS, INDEXER_KEY_BLOCK, HybridV4Attention, IndexerQuery, blockwise_topk,
)

ATTENTION_BLOCK_N = 32  # keys per inner step of the attention kernel
INDEXER_BLOCK_N = 32  # indexer keys per program of the scoring kernel


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dimension >= 16


@triton.jit
def _indexer_scores_kernel(
    q_ptr, sq_t, sq_h, sq_c,  # [n, nI, cI]
    w_ptr, sw_t, sw_h,  # [n, nI]
    keys_ptr, sk_s, sk_c,  # [slots, cI]
    slots_ptr, ss_t, ss_l,  # [L] (ss_t = 0) or [n, L]
    visible_ptr,  # [n] causal entry count per query
    out_ptr, so_t,  # [n, hi - lo]
    lo, hi, n_heads, dim, scale,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    cols = lo + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_C)
    in_range = cols < hi
    slots = tl.load(slots_ptr + t * ss_t + cols * ss_l, mask=in_range, other=0)
    # Keys of any cache dtype, FP8 included, widened exactly to float32.
    keys = tl.load(keys_ptr + slots[:, None] * sk_s + c[None, :] * sk_c,
                   mask=in_range[:, None] & (c < dim)[None, :], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + c[None, :] * sq_c,
                mask=(h < n_heads)[:, None] & (c < dim)[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * sw_t + h * sw_h, mask=h < n_heads, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [heads, keys]
    score = tl.sum(tl.maximum(s, 0.0) * scale * w[:, None], axis=0)
    score = tl.where(cols < tl.load(visible_ptr + t), score, float("-inf"))
    tl.store(out_ptr + t * so_t + (cols - lo), score, mask=in_range)


def indexer_block_scores(indexer: IndexerQuery, rows: slice, iks: KeySet, lo: int, hi: int) -> torch.Tensor:
    """Masked indexer scores [n, hi - lo] of columns [lo, hi) of iks for the queries in rows.

    iks must be a causal prefix (visible counts): the metadata builds every indexer key set so.
    """
    q, w, keys, slots = indexer.q[rows], indexer.weights[rows], indexer.keys, iks.slots
    n, heads, dim = q.shape
    out = torch.empty(n, hi - lo, dtype=torch.float32, device=q.device)
    grid = (n, triton.cdiv(hi - lo, INDEXER_BLOCK_N))
    _indexer_scores_kernel[grid](
        q, *q.stride(), w, *w.stride(), keys, *keys.stride(),
        slots, 0 if iks.shared else slots.stride(0), slots.stride(-1), iks.visible, out, out.stride(0),
        lo, hi, heads, dim, indexer.scale,
        BLOCK_H=_pow2(heads), BLOCK_C=_pow2(dim), BLOCK_N=INDEXER_BLOCK_N,
    )
    return out


def triton_indexer_topk(
    indexer: IndexerQuery, rows: slice, iks: KeySet, k: int, key_block: int | None = None
) -> torch.Tensor:
    """indexer_topk with the kernel's scores: columns [n, k] of iks, merged key block by key block.

    The heads are reduced inside the kernel, so a key block's scores are [n, key_block] (no
    heads dimension): the block is INDEXER_BLOCK_ELEMS / n entries wide (at least INDEXER_KEY_BLOCK).
    """
    n = indexer.q[rows].shape[0]
    if key_block is None:
        key_block = max(INDEXER_KEY_BLOCK, INDEXER_BLOCK_ELEMS // max(1, n))
    # blockwise_topk builds its running top-k and column indices with factory calls: on the
    # queries' device, so that the kernel's scores and the indices stay on the GPU.
    with torch.device(indexer.q.device):
        return blockwise_topk(lambda lo, hi: indexer_block_scores(indexer, rows, iks, lo, hi), n, iks.length, k,
                              key_block)


@triton.jit
def _attend(
    q, m, l, acc, t,
    cache_ptr, sc_s, sc_d,  # [slots, D]
    slots_ptr, ss_t, ss_l,  # [L] (ss_t = 0) or [n, L]
    valid_ptr, sv_t, sv_l,  # HAS_MASK: mask [n, L] as uint8; else visible counts [n]
    length, dim, scale,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold one key set of query t into the running softmax (max m, sum l, output acc)."""
    d = tl.arange(0, BLOCK_D)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_range = cols < length
        slots = tl.load(slots_ptr + t * ss_t + cols * ss_l, mask=in_range, other=0)
        # Keys of any cache dtype, FP8 included, widened exactly to float32.
        keys = tl.load(cache_ptr + slots[:, None] * sc_s + d[None, :] * sc_d,
                       mask=in_range[:, None] & (d < dim)[None, :], other=0.0).to(tl.float32)
        if HAS_MASK:
            ok = tl.load(valid_ptr + t * sv_t + cols * sv_l, mask=in_range, other=0) != 0
        else:
            ok = cols < tl.load(valid_ptr + t * sv_t)
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale  # [heads, keys]
        logits = tl.where((ok & in_range)[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, keys, input_precision="ieee")  # values = keys
        m = m_new
    return m, l, acc


@triton.jit
def _hybrid_attention_kernel(
    q_ptr, sq_t, sq_h, sq_d,  # [n, H, D]
    out_ptr, so_t, so_h, so_d,
    sink_ptr, n_heads, dim, scale,
    a_cache, a_sc_s, a_sc_d, a_slots, a_ss_t, a_ss_l, a_valid, a_sv_t, a_sv_l, a_len,  # SWA window
    b_cache, b_sc_s, b_sc_d, b_slots, b_ss_t, b_ss_l, b_valid, b_sv_t, b_sv_l, b_len,  # entries
    A_MASK: tl.constexpr, B_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hd_ok = (h < n_heads)[:, None] & (d < dim)[None, :]
    q = tl.load(q_ptr + t * sq_t + h[:, None] * sq_h + d[None, :] * sq_d, mask=hd_ok, other=0.0).to(tl.float32)
    # The sink starts the running max and sum: every row has a finite max from the start.
    m = tl.load(sink_ptr + h, mask=h < n_heads, other=0.0).to(tl.float32)
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m, l, acc = _attend(q, m, l, acc, t, a_cache, a_sc_s, a_sc_d, a_slots, a_ss_t, a_ss_l, a_valid, a_sv_t, a_sv_l,
                        a_len, dim, scale, A_MASK, BLOCK_N, BLOCK_D)
    m, l, acc = _attend(q, m, l, acc, t, b_cache, b_sc_s, b_sc_d, b_slots, b_ss_t, b_ss_l, b_valid, b_sv_t, b_sv_l,
                        b_len, dim, scale, B_MASK, BLOCK_N, BLOCK_D)
    out = acc / l[:, None]
    tl.store(out_ptr + t * so_t + h[:, None] * so_h + d[None, :] * so_d, out.to(out_ptr.dtype.element_ty), mask=hd_ok)


def _key_set_args(cache: torch.Tensor, ks: KeySet) -> tuple[tuple, bool]:
    """The kernel arguments of one (cache, key set) source, and whether it carries a mask."""
    slots = ks.slots
    if ks.visible is None:
        valid = ks.explicit_mask.view(torch.uint8)
        valid_args = (valid, valid.stride(0), valid.stride(1))
    else:
        valid_args = (ks.visible, ks.visible.stride(0), 0)
    slot_args = (slots, 0 if ks.shared else slots.stride(0), slots.stride(-1))
    args = (cache, *cache.stride(), *slot_args, *valid_args, ks.length)
    return args, ks.visible is None


def hybrid_attention(
    q: torch.Tensor, sinks: torch.Tensor, scale: float, swa_cache: torch.Tensor, swa: KeySet,
    entry_cache: torch.Tensor | None = None, entries: KeySet | None = None,
) -> torch.Tensor:
    """joint softmax over [swa keys | entries | sink] for q [n, H, D] (one shared K=V head) -> [n, H, D]."""
    n, H, D = q.shape
    out = torch.empty_like(q)
    a, a_mask = _key_set_args(swa_cache, swa)
    # No entries (sliding layers, or none causal yet): a zero-length second source.
    b, b_mask = _key_set_args(entry_cache, entries) if entries is not None else (a[:-1] + (0,), a_mask)
    block_h = min(_pow2(H), 64)
    _hybrid_attention_kernel[(n, triton.cdiv(H, block_h))](
        q, *q.stride(), out, *out.stride(), sinks.detach(), H, D, scale, *a, *b,
        A_MASK=a_mask, B_MASK=b_mask, BLOCK_H=block_h, BLOCK_N=ATTENTION_BLOCK_N, BLOCK_D=_pow2(D),
    )
    return out


class TritonHybridV4Attention(HybridV4Attention):
    """HybridV4Attention with the indexer scoring and the attention itself as Triton kernels.

    Which entries a block reads is the reference's `entries` (HiSparse decode rows included:
    their key set then points into the hot buffer), with its `topk` scoring by kernel and
    HiSparse's swap-in (hits, LRU victims, slot map, copy) as one fused kernel."""

    name = "hybrid_v4_triton"
    write = staticmethod(write_rows)
    topk = staticmethod(triton_indexer_topk)
    swap_in = staticmethod(triton_swap_in)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] roped queries
        swa_cache: torch.Tensor,  # [swa slots, D] (new keys already written)
        meta: HybridAttentionMetadata,
        sinks: torch.Tensor,  # [H]
        scale: float,
        entry_cache: torch.Tensor | None = None,  # [entry slots, D] compressed entries of this layer
        entry_space: str | None = None,  # "c4" / "c128"
        indexer: IndexerQuery | None = None,  # CSA layers: selects the top-k entries
        hisparse: HiSparseLayer | None = None,  # CSA layers with HiSparse: decode reads the hot buffer
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for blk in meta.blocks:
            cache, entries = self.entries(blk, meta, entry_cache, entry_space, indexer, hisparse) or (None, None)
            out[blk.start : blk.end] = hybrid_attention(q[blk.start : blk.end], sinks, scale, swa_cache, blk.swa,
                                                        cache, entries)
        return out
