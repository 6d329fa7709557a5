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

import torch

from hybridkv.attention_backends.hybrid_metadata import HybridAttentionMetadata, KeySet

INDEXER_SCORE_ELEMS = 1 << 24  # cap on [queries, heads, entries] elements per indexer matmul


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
    """Σ_h w[t,h] · ReLU(q[t,h] · K[e]) · scale  ->  [n, L].  keys [L, c] (shared) or [n, L, c]."""
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
        out.append((torch.relu(s) * scale * wa[:, :, None]).sum(dim=1))
    return torch.cat(out) if out else q.new_zeros(0, L, dtype=torch.float32)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [n, k] of the k largest scores per row; ties broken towards the lower index.

    torch.topk's choice among equal scores depends on the call shape, so a full prefill and
    token-by-token decode could pick different entries when scores tie (ReLU makes exact
    zeros common). Everything strictly above the k-th value is taken, then the lowest-index
    entries equal to it. Masked (-inf) entries come last and are dropped by the caller.
    """
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    above = scores > kth
    tie = scores == kth
    need = k - above.sum(dim=-1, keepdim=True)
    take = above | (tie & (torch.cumsum(tie.to(torch.int32), dim=-1) <= need))
    return take.nonzero()[:, 1].view(scores.shape[0], k)


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


def _gather(cache: torch.Tensor, ks: KeySet) -> torch.Tensor:
    return cache[ks.slots]


def _take(ks: KeySet, idx: torch.Tensor) -> KeySet:
    """The entries idx [n, k] of a key set, as a per-query key set."""
    if ks.shared:
        return KeySet(ks.slots[idx], ks.mask.gather(1, idx))
    return KeySet(ks.slots.gather(1, idx), ks.mask.gather(1, idx))


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
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for blk in meta.blocks:
            rows = slice(blk.start, blk.end)
            qb = q[rows]
            sets = [(_gather(swa_cache, blk.swa), blk.swa.mask)]
            if entry_cache is not None:
                ks = blk.entries[entry_space]
                if ks.length:
                    if indexer is not None:
                        iks = blk.entries[indexer.space]
                        scores = indexer_scores(indexer.q[rows], indexer.weights[rows], _gather(indexer.keys, iks), indexer.scale)
                        scores = scores.masked_fill(~iks.mask, float("-inf"))
                        ks = _take(ks, select_topk(scores, min(indexer.topk, ks.length)))
                    sets.append((_gather(entry_cache, ks), ks.mask))
            out[rows] = joint_softmax_attention(qb, sets, sinks, scale)
        return out
