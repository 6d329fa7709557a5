"""Hybrid attention over paged spaces (DeepSeek-V4 CSA / HCA / sliding layers), torch-native.

Per layer and query: one joint softmax over
    [SWA window keys | compressed entries | sink]
where the compressed entries are all causal C128 entries (HCA layers) or the lightning
indexer's top-k causal C4 entries (CSA layers), and the sink is a learned per-head logit
with a zero value vector. Keys are also the values (shared K=V). Decode queries and
prefill chunks of any length are handled in one call, block by block (see
hybrid_metadata.py); every read and write goes through the metadata's slot lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridkv.attention_backends.hisparse_reads import HiSparseLayer, select_from_buffer
from hybridkv.attention_backends.hybrid_metadata import HybridAttentionMetadata, KeySet, QueryBlock

INDEXER_SCORE_ELEMS = 1 << 24  # cap on [queries, heads, entries] elements per indexer matmul
# Indexer keys scored per matmul: each query block is scored against its causal C4 entries in
# key blocks of this many entries, and each block's candidates are merged into a running top-k,
# so the largest indexer intermediate is [rows, heads, INDEXER_KEY_BLOCK] whatever the context.
# The key block widens when a block has few queries (decode) so that its score tensor still
# fills INDEXER_BLOCK_ELEMS: a decode step then scores its entries in one or a few matmuls
# instead of paying the merge many times; the bound stays
# max(rows x heads x INDEXER_KEY_BLOCK, INDEXER_BLOCK_ELEMS) elements.
INDEXER_KEY_BLOCK = 1024
INDEXER_BLOCK_ELEMS = 1 << 20
# C4/C128 entries per attention pass: long entry lists (HCA prefill at long context) are read
# in key blocks with an online softmax, bounding the logits to [rows, heads, ENTRY_KEY_BLOCK].
ENTRY_KEY_BLOCK = 1024


@dataclass
class IndexerQuery:
    """Lightning-indexer inputs of one CSA layer for the step's tokens."""

    q: torch.Tensor  # [T, nI, cI] roped queries
    weights: torch.Tensor  # [T, nI] per-head weights (already scaled by nI^-0.5)
    keys: torch.Tensor  # [slots, cI] the layer's indexer-key cache
    space: str  # the indexer space's name in the metadata
    topk: int
    scale: float  # cI^-0.5


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    if slots.numel():
        cache.index_copy_(0, slots, values.to(cache.dtype))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Σ_h w[t,h] · ReLU(q[t,h] · K[e]) · scale  ->  [n, L].  keys [L, c] (shared) or [n, L, c].

    The elementwise steps run in place on the matmul's output (same values as the out-of-place
    expression, one [n, h, L] buffer instead of four).
    """
    n, heads = q.shape[0], q.shape[1]
    L = keys.shape[-2]
    step = max(1, INDEXER_SCORE_ELEMS // max(1, heads * L))
    out = []
    for a in range(0, n, step):
        qa, wa = q[a : a + step].float(), w[a : a + step].float()
        if keys.dim() == 2:
            s = torch.matmul(qa, keys.float().t())  # [n, h, L]
        else:
            s = torch.einsum("nhc,nlc->nhl", qa, keys[a : a + step].float())
        out.append(s.relu_().mul_(scale).mul_(wa[:, :, None]).sum(dim=1))
    return torch.cat(out) if out else q.new_zeros(0, L, dtype=torch.float32)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [n, k] of the k largest scores per row; ties broken towards the lower index.

    torch.topk's choice among equal scores depends on the call shape, so a full prefill and
    token-by-token decode could pick different entries when scores tie (ReLU makes exact
    zeros common). Everything strictly above the k-th value is taken, then the lowest-index
    entries equal to it. Masked (-inf) entries come last and are dropped by the caller.
    The indices come out ascending (which merge_topk relies on).
    """
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    above = scores > kth
    tie = scores == kth
    need = k - above.sum(dim=-1, keepdim=True)
    take = above | (tie & (torch.cumsum(tie.to(torch.int32), dim=-1) <= need))
    return take.nonzero()[:, 1].view(scores.shape[0], k)


def merge_topk(
    run_scores: torch.Tensor, run_idx: torch.Tensor, block_scores: torch.Tensor, block_idx: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running top-k ([n, <=k] scores and indices) merged with one key block's scores.

    select_topk's order (score descending, then index ascending, -inf as a score like any
    other) is a strict total order, so the top-k of a union equals the top-k of (top-k of the
    earlier blocks) ∪ (the new block): merging block by block gives exactly the one-shot
    selection. The tie rule is positional, so the candidates must be laid out in ascending
    index order: the running indices are ascending (select_topk returns them so) and all below
    the new block's, which are ascending too.
    """
    scores = torch.cat([run_scores, block_scores], dim=1)
    idx = torch.cat([run_idx, block_idx], dim=1)
    if scores.shape[1] <= k:
        return scores, idx
    keep = select_topk(scores, k)
    return scores.gather(1, keep), idx.gather(1, keep)


def blockwise_topk(
    block_scores: Callable[[int, int], torch.Tensor], n: int, length: int, k: int, key_block: int
) -> torch.Tensor:
    """Indices [n, k] equal to select_topk(all scores, k), computed key block by key block.

    block_scores(lo, hi) returns the (already masked) scores [n, hi - lo] of columns [lo, hi);
    only one block's scores and the running top-k are alive at a time.
    """
    run_scores = torch.empty(n, 0, dtype=torch.float32)
    run_idx = torch.empty(n, 0, dtype=torch.long)
    for lo in range(0, length, key_block):
        hi = min(length, lo + key_block)
        cols = torch.arange(lo, hi).expand(n, hi - lo)
        run_scores, run_idx = merge_topk(run_scores, run_idx, block_scores(lo, hi), cols, k)
    return run_idx


def indexer_topk(indexer: IndexerQuery, rows: slice, iks: KeySet, k: int, key_block: int | None = None) -> torch.Tensor:
    """The lightning indexer's top-k [n, k] (columns of iks) for the queries in rows.

    Keys are gathered, scored and masked one key block at a time (blockwise_topk), so neither
    the gathered keys nor the [rows, heads, entries] scores ever exist for the whole entry list.
    """
    q, w = indexer.q[rows], indexer.weights[rows]
    if key_block is None:
        key_block = max(INDEXER_KEY_BLOCK, INDEXER_BLOCK_ELEMS // max(1, q.shape[0] * q.shape[1]))

    def block_scores(lo: int, hi: int) -> torch.Tensor:
        keys = indexer.keys[iks.slots[..., lo:hi]]  # [Lb, c] shared or [n, Lb, c] per query
        scores = indexer_scores(q, w, keys, indexer.scale)
        if iks.all_visible(hi):
            return scores
        return scores.masked_fill_(~iks.column_mask(lo, hi), float("-inf"))

    return blockwise_topk(block_scores, q.shape[0], iks.length, k, key_block)


def _logits(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D], keys [L, D] or [n, L, D] -> [n, H, L]."""
    if keys.dim() == 2:
        return torch.matmul(q, keys.t()) * scale
    return torch.einsum("nhd,nld->nhl", q, keys) * scale


def _weighted(p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if keys.dim() == 2:
        return torch.matmul(p, keys)
    return torch.einsum("nhl,nld->nhd", p, keys)


def joint_softmax_attention(
    q: torch.Tensor, key_sets: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """One softmax per (query, head) over every key set plus the sink logit; values = keys.

    q [n, H, D]; key_sets: (keys [L, D] or [n, L, D], mask [n, L]); sinks [H] (float32).
    """
    n, H, _ = q.shape
    logits = [_logits(q, k, scale).masked_fill(~m[:, None, :], float("-inf")) for k, m in key_sets]
    sink = sinks.to(q.dtype).view(1, H, 1).expand(n, H, 1)
    combined = torch.cat(logits + [sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)
    out = torch.zeros_like(q)
    col = 0
    for (k, _), lg in zip(key_sets, logits):
        L = lg.shape[-1]
        if L:
            out = out + _weighted(probs[..., col : col + L], k)
        col += L
    return out


def online_joint_attention(
    q: torch.Tensor, sources: list[tuple[torch.Tensor, KeySet]], sinks: torch.Tensor, scale: float, key_block: int
) -> torch.Tensor:
    """joint_softmax_attention over key sets read in key blocks, with a running (online) softmax.

    sources: (cache, key set) pairs; each key set's keys are gathered and scored key_block
    columns at a time, so the logits never exceed [n, H, key_block] however long the entry list
    (HCA prefill reads every causal C128 entry). The sink starts the running max and sum (its
    value vector is zero), so every (query, head) has a finite max from the start and fully
    masked blocks contribute exactly nothing. Same math as the one-pass softmax; only the
    rounding of the normaliser differs.
    """
    n, H, D = q.shape
    run_max = sinks.to(q.dtype).view(1, H, 1).expand(n, H, 1).clone()
    run_sum = torch.ones(n, H, 1, dtype=q.dtype)
    acc = torch.zeros_like(q)
    for cache, ks in sources:
        for lo in range(0, ks.length, key_block):
            hi = min(ks.length, lo + key_block)
            keys = cache[ks.slots[..., lo:hi]]
            logits = _logits(q, keys, scale)
            if not ks.all_visible(hi):
                logits = logits.masked_fill_(~ks.column_mask(lo, hi)[:, None, :], float("-inf"))
            new_max = torch.maximum(run_max, logits.amax(dim=-1, keepdim=True))
            rescale = torch.exp(run_max - new_max)
            p = torch.exp(logits.sub_(new_max))
            run_sum = run_sum * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + _weighted(p, keys)
            run_max = new_max
    return acc / run_sum


def _gather(cache: torch.Tensor, ks: KeySet) -> torch.Tensor:
    return cache[ks.slots]


class HybridV4Attention:
    name = "hybrid_v4_torch"

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
            rows = slice(blk.start, blk.end)
            qb = q[rows]
            sources = [(swa_cache, blk.swa)]
            picked = self.entries(blk, meta, entry_cache, entry_space, indexer, hisparse)
            if picked is not None:
                sources.append(picked)
            if sum(ks.length for _, ks in sources[1:]) <= ENTRY_KEY_BLOCK:
                # Short entry lists (every CSA block: top-k; HCA below ENTRY_KEY_BLOCK entries): one pass.
                sets = [(_gather(cache, ks), ks.mask) for cache, ks in sources]
                out[rows] = joint_softmax_attention(qb, sets, sinks, scale)
            else:
                out[rows] = online_joint_attention(qb, sources, sinks, scale, ENTRY_KEY_BLOCK)
        return out

    def entries(self, blk: QueryBlock, meta: HybridAttentionMetadata, entry_cache: torch.Tensor | None,
                entry_space: str | None, indexer: IndexerQuery | None,
                hisparse: HiSparseLayer | None) -> tuple[torch.Tensor, KeySet] | None:
        """(cache, key set) of the compressed entries this block reads: every causal C128 entry,
        or the indexer's top-k C4 entries -- from the hot buffer for HiSparse decode rows."""
        if entry_cache is None or not blk.entries[entry_space].length:
            return None
        ks = blk.entries[entry_space]
        if indexer is None:
            return entry_cache, ks
        rows = slice(blk.start, blk.end)
        idx = self.topk(indexer, rows, blk.entries[indexer.space], min(indexer.topk, ks.length))
        if hisparse is not None and blk.start < meta.num_decodes:
            h = hisparse
            return h.hot, select_from_buffer(h.step, h.layer, h.hot, entry_cache, blk.start, blk.end, ks, idx)
        return entry_cache, ks.take(idx)

    topk = staticmethod(indexer_topk)  # the Triton backend scores with its kernel
