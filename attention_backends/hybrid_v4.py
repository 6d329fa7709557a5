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

from hybridkv.attention_backends.backend import HybridAttentionBackend
from hybridkv.attention_backends.cpu_kernels import load_indexer_topk, load_joint_attention
from hybridkv.attention_backends.hisparse_reads import HiSparseLayer, read_mirror, select_from_buffer, swap_in
from hybridkv.attention_backends.hybrid_metadata import HybridAttentionMetadata, KeySet, QueryBlock
from hybridkv.attention_backends.kv_cache_dtype import FP8_DTYPES, dequantize_kv, store_rows

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
# Head-reduced indexer scores [rows, entries] held for one top-k (32 MB in float32): a query
# block is split into row groups of INDEXER_ROW_SCORES / entries rows, down to MIN_SCORE_ROWS
# rows (a 2M-token context at 256 rows); beyond that the top-k is merged key block by block.
INDEXER_ROW_SCORES = 1 << 23
MIN_SCORE_ROWS = 16
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
    """values [n, D] into cache rows `slots`, as the cache stores them: cast to its dtype, or
    saturated and rounded into its FP8 format (kv_cache_dtype.quantize_kv)."""
    if slots.numel():
        store_rows(cache, slots, values)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Σ_h w[t,h] · ReLU(q[t,h] · K[e]) · scale  ->  [n, L].  keys [L, c] (shared) or [n, L, c].

    Two GEMMs and one in-place pass: the scores [n, h, L] from one matmul, ReLU in place, then
    the head-weighted sum as a batched matmul w[n, 1, h] @ scores (instead of scale, weight and
    sum passes over the [n, h, L] buffer, which cost more than the scoring matmul at small
    index_head_dim).
    """
    n, heads = q.shape[0], q.shape[1]
    L = keys.shape[-2]
    step = max(1, INDEXER_SCORE_ELEMS // max(1, heads * L))
    out = []
    for a in range(0, n, step):
        qa, wa = q[a : a + step].float(), w[a : a + step].float()
        if keys.dim() == 2:
            s = torch.matmul(qa, keys.float().t())  # [n, h, L]
        elif L >= 2 * SCORE_CHUNK:
            out.append(_per_query_scores_chunked(qa, wa, keys[a : a + step].float(), scale))
            continue
        else:
            s = torch.bmm(qa, keys[a : a + step].float().transpose(1, 2))
        out.append(torch.bmm(wa[:, None, :], s.relu_()).squeeze(1).mul_(scale))
    if not out:
        return q.new_zeros(0, L, dtype=torch.float32)
    return torch.cat(out) if len(out) > 1 else out[0]


SCORE_CHUNK = 512  # entries per matmul when a few decode queries score their own long key lists


def _per_query_scores_chunked(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """indexer_scores for per-query keys [n, L, c] with few queries (decode): q [n, h, c] against
    [n, L, c] is a matmul with only h rows per query, which oneDNN/MKL run far below their GEMM
    rate (~16 GFLOP/s measured at 32k entries); viewing the keys as SCORE_CHUNK-entry chunks
    makes it a batch of [h, c] x [c, SCORE_CHUNK] products, measured ~1.5-3x faster."""
    n, L, c = keys.shape
    B = SCORE_CHUNK
    main = L - L % B
    if keys.stride(2) != 1 or keys.stride(1) != c:
        keys = keys.contiguous()
    # The first `main` entries of every row as [n, chunks, B, c], without a copy.
    chunks = keys.as_strided((n, main // B, B, c), (keys.stride(0), B * c, c, 1))
    s = torch.matmul(q[:, None], chunks.transpose(-1, -2)).relu_()  # [n, chunks, h, B]
    if out is None:
        out = torch.empty(n, L, dtype=torch.float32, device=keys.device)
    out[:, :main] = torch.matmul(w[:, None, None, :], s).view(n, main)
    if main < L:
        tail = torch.bmm(q, keys[:, main:].transpose(1, 2)).relu_()  # [n, h, L - main]
        out[:, main:] = torch.bmm(w[:, None, :], tail).squeeze(1)
    return out.mul_(scale)


# Decode rows whose indexer pages lie in runs of consecutive pages averaging at least this many
# entries are scored on views of the key cache, run by run (no copy); other rows are gathered
# page by page with the batch. A copy costs about its bytes at memory speed (~0.5 ms for 32k
# entries of 64 floats, written and then read again, evicting the model's weights from the
# cache on the way); a view costs one matmul call per run (~30 us), so short runs are cheaper
# to copy. The block pool hands out pages in order, so a long request's pages mostly are runs.
IN_PLACE_RUN_ENTRIES = 2048


def paged_decode_scores(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, iks: KeySet, scale: float,
                        key_block: int) -> torch.Tensor:
    """Masked indexer scores [n, L] of a page-form key set (decode rows), reading the key cache
    in place where a row's pages are runs of consecutive pages (see IN_PLACE_RUN_ENTRIES)."""
    n, L, spp = q.shape[0], iks.length, iks.slots_per_page
    scores = torch.full((n, L), float("-inf"), dtype=torch.float32, device=q.device)
    npages = -(-iks.visible // spp)  # [n] pages each row reads
    pages = iks.pages
    starts = torch.ones(pages.shape, dtype=torch.bool, device=pages.device)  # a run begins here
    starts[:, 1:] = pages[:, 1:] != pages[:, :-1] + 1
    starts &= torch.arange(pages.shape[1], device=pages.device) < npages[:, None]
    in_place = (iks.visible >= starts.sum(dim=1) * IN_PLACE_RUN_ENTRIES) & (npages > 0)
    for r in in_place.nonzero()[:, 0].tolist():
        visible = int(iks.visible[r])
        cols = starts[r].nonzero()[:, 0].tolist() + [int(npages[r])]
        first = pages[r, cols[:-1]].tolist()
        for a, b, page in zip(cols[:-1], cols[1:], first):
            lo, hi = a * spp, min(visible, b * spp)
            keys = cache[page * spp : page * spp + hi - lo].float()[None]  # a view: no copy
            _per_query_scores_chunked(q[r : r + 1].float(), w[r : r + 1].float(), keys, scale, out=scores[r : r + 1, lo:hi])
    rest = (~in_place).nonzero()[:, 0]
    if rest.numel():
        sub = KeySet(pages=pages[rest], slots_per_page=spp, length=L, visible=iks.visible[rest])
        qr, wr = q[rest], w[rest]
        part = torch.empty(rest.numel(), L, dtype=torch.float32, device=q.device)
        for lo in range(0, L, key_block):
            hi = min(L, lo + key_block)
            part[:, lo:hi] = indexer_scores(qr, wr, sub.read_unmasked(cache, lo, hi), scale)
        scores[rest] = part.masked_fill_(~sub.column_mask(0, L), float("-inf"))
    return scores


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [n, k] of the k largest scores per row; ties broken towards the lower index.

    torch.topk's choice among equal scores depends on the call shape, so a full prefill and
    token-by-token decode could pick different entries when scores tie (ReLU makes exact
    zeros common). When every row's k-th score is strictly above its (k+1)-th the top-k set is
    unique and torch.topk's is taken (one pass); otherwise everything strictly above the k-th
    value is taken, then the lowest-index entries equal to it. Masked (-inf) entries come last
    and are dropped by the caller. The indices come out ascending (which merge_topk relies on).
    """
    n, L = scores.shape
    if k >= L:
        return torch.arange(L, device=scores.device).expand(n, L)
    vals, idx = torch.topk(scores, k + 1, dim=-1)
    out = idx[:, :k].sort(dim=-1).values
    tied = ~(vals[:, k - 1] > vals[:, k])  # rows whose k-th score is shared with an entry left out
    if bool(tied.any()):
        rows = tied.nonzero()[:, 0]
        out[rows] = _select_tied(scores[rows], vals[rows, k - 1 : k], k)
    return out


def _select_tied(scores: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """select_topk's rule for rows whose k-th score kth [n, 1] ties: everything above it, then
    the lowest-index entries equal to it."""
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


CANDIDATE_CHUNK = 64  # columns per chunk when block_candidates screens a key block by chunk maxima


def block_candidates(scores: torch.Tensor, threshold: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The entries of one key block scoring strictly above each row's threshold, as [n, m]
    (scores, column indices) in ascending column order, padded with -inf; None when there are none.

    Every index of the block is above every index of the running top-k, so under select_topk's
    order a block entry can displace the running k-th entry only by a strictly larger score:
    the candidates are all that a merge needs, and past the first few key blocks they are a
    small fraction of the block (about k / entries seen), so the merge works on [n, k + m].
    The block is screened by the maxima of CANDIDATE_CHUNK-column chunks (one reduction); only
    the chunks above the threshold are searched entry by entry.
    """
    n, L = scores.shape
    C = CANDIDATE_CHUNK
    if L % C == 0 and L > C:
        chunks = scores.reshape(n, L // C, C)
        r, ch = (chunks.amax(dim=2) > threshold[:, None]).nonzero(as_tuple=True)  # row-major
        if r.numel() == 0:
            return None
        vals = chunks[r, ch]  # [hot chunks, C]
        hot, col = (vals > threshold[r][:, None]).nonzero(as_tuple=True)
        r, c, v = r[hot], ch[hot] * C + col, vals[hot, col]  # still ascending columns per row
    else:
        r, c = (scores > threshold[:, None]).nonzero(as_tuple=True)
        if r.numel() == 0:
            return None
        v = scores[r, c]
    per_row = torch.bincount(r, minlength=n)
    m = int(per_row.max())
    pos = torch.arange(r.numel(), device=scores.device) - (torch.cumsum(per_row, 0) - per_row)[r]  # rank within its row
    cand_scores = torch.full((n, m), float("-inf"), device=scores.device)
    cand_idx = torch.zeros(n, m, dtype=torch.long, device=scores.device)
    cand_scores[r, pos] = v
    cand_idx[r, pos] = c + lo
    return cand_scores, cand_idx


# Candidate columns (see block_candidates) collected before they are merged into the running
# top-k: a merge is a top-k over [n, k + pending], so merging every few blocks instead of after
# each one keeps the merge cost small next to the scoring, and bounds the pending buffer.
MERGE_WIDTH = 256


def blockwise_topk(
    block_scores: Callable[[int, int], torch.Tensor], n: int, length: int, k: int, key_block: int
) -> torch.Tensor:
    """Indices [n, k] equal to select_topk(all scores, k), computed key block by key block.

    block_scores(lo, hi) returns the (already masked) scores [n, hi - lo] of columns [lo, hi);
    only one block's scores, the running top-k and at most MERGE_WIDTH (+ one block's) pending
    candidates are alive at a time. Once the running set holds k entries, a block contributes
    only its entries above the running k-th score as of the last merge (block_candidates): a
    superset of what can still enter, because that threshold only rises. Selection then costs
    about one comparison per score instead of a top-k over every block (which cost several
    times the scoring matmul).
    """
    run_scores = torch.empty(n, 0, dtype=torch.float32)
    run_idx = torch.empty(n, 0, dtype=torch.long)
    threshold = None  # the running k-th score once the running set is full
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    width = 0
    for lo in range(0, length, key_block):
        hi = min(length, lo + key_block)
        scores = block_scores(lo, hi)
        if threshold is None:
            cols = torch.arange(lo, hi).expand(n, hi - lo)
            run_scores, run_idx = merge_topk(run_scores, run_idx, scores, cols, k)
            if run_idx.shape[1] == k:
                threshold = run_scores.amin(dim=1)
            continue
        cand = block_candidates(scores, threshold, lo)
        if cand is None:
            continue
        pending.append(cand)
        width += cand[0].shape[1]
        if width >= MERGE_WIDTH:
            run_scores, run_idx = _merge_pending(run_scores, run_idx, pending, k)
            threshold, pending, width = run_scores.amin(dim=1), [], 0
    if pending:
        run_scores, run_idx = _merge_pending(run_scores, run_idx, pending, k)
    return run_idx


def _merge_pending(run_scores: torch.Tensor, run_idx: torch.Tensor, pending: list[tuple[torch.Tensor, torch.Tensor]],
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the pending candidates (blocks in column order, each padded with -inf) into the
    running top-k. A -inf pad is never selected: the running set's own -inf entries come first
    and there are at least as many of them as the merge needs."""
    return merge_topk(run_scores, run_idx, torch.cat([c[0] for c in pending], dim=1),
                      torch.cat([c[1] for c in pending], dim=1), k)


def indexer_topk(indexer: IndexerQuery, rows: slice, iks: KeySet, k: int, key_block: int | None = None) -> torch.Tensor:
    """The lightning indexer's top-k [n, k] (columns of iks) for the queries in rows.

    Keys are read and scored one key block at a time, so neither the keys nor the per-head
    scores [rows, heads, entries] ever exist for the whole entry list. The head-reduced scores
    of a row block are kept whole ([rows, entries], at most INDEXER_ROW_SCORES elements: the
    rows are split as the history grows) and selected with one top-k, which costs a small
    fraction of the scoring; past MIN_SCORE_ROWS rows' worth of entries (multi-million-token
    contexts) the top-k runs blockwise instead (blockwise_topk). Decode key sets are in page
    form: their keys are copied page by page, not gathered per entry.
    """
    n, L = rows.stop - rows.start, iks.length
    step = INDEXER_ROW_SCORES // max(1, L)
    if MIN_SCORE_ROWS <= step < n:
        return torch.cat([indexer_topk(indexer, slice(rows.start + a, rows.start + min(n, a + step)),
                                       iks.row_slice(a, min(n, a + step)), k, key_block) for a in range(0, n, step)])
    q, w = indexer.q[rows], indexer.weights[rows]
    if key_block is None:
        key_block = max(INDEXER_KEY_BLOCK, INDEXER_BLOCK_ELEMS // max(1, n * q.shape[1]))

    def block_scores(lo: int, hi: int) -> torch.Tensor:
        keys = iks.read_unmasked(indexer.keys, lo, hi)  # [Lb, c] shared or [n, Lb, c] per query
        scores = indexer_scores(q, w, keys, indexer.scale)
        if iks.all_visible(hi):
            return scores
        return scores.masked_fill_(~iks.column_mask(lo, hi), float("-inf"))

    if step < n:
        return blockwise_topk(block_scores, n, L, k, key_block)
    if iks.pages is not None:
        return select_topk(paged_decode_scores(q, w, indexer.keys, iks, indexer.scale, key_block), k)
    scores = torch.empty(n, L, dtype=torch.float32, device=q.device)
    for lo in range(0, L, key_block):
        hi = min(L, lo + key_block)
        scores[:, lo:hi] = block_scores(lo, hi)
    return select_topk(scores, k)


# Indexer heads the fused CPU kernel takes (8 vectors of 8 lanes on AVX2: V4-Flash has 64).
FUSED_INDEXER_MAX_HEADS = 64


def cpu_indexer_topk(indexer: IndexerQuery, rows: slice, iks: KeySet, k: int, key_block: int | None = None) -> torch.Tensor:
    """indexer_topk through the fused C++ kernel (cpu_kernels/indexer_topk.cpp) where it applies:
    CPU caches in float32, bfloat16 or an FP8 format (kv_cache_dtype; widened exactly as they are
    read, so an FP8 cache selects what its float32 widening selects), a causal key set with
    shared slots or in page form, at most FUSED_INDEXER_MAX_HEADS heads. It scores, applies ReLU
    and the head sum, and keeps a running top-k per row in one pass over the keys read in place,
    so neither [rows, heads, entries] scores nor a top-k over [rows, entries] ever exist. The
    selection rule is select_topk's; the scores differ from the torch path's only in summation
    order. Elsewhere (no compiler, HYBRIDKV_CPU_KERNELS=0, other dtypes, devices or forms)
    indexer_topk runs."""
    kernel = load_indexer_topk() if indexer.keys.device.type == "cpu" else None
    keys, n = indexer.keys, rows.stop - rows.start
    if (kernel is None or iks.visible is None or not (iks.shared or iks.pages is not None) or n == 0
            or keys.dtype not in (torch.float32, torch.bfloat16, *FP8_DTYPES)
            or keys.dim() != 2 or not keys.is_contiguous()
            or indexer.q.shape[1] > FUSED_INDEXER_MAX_HEADS or not 1 <= k <= iks.length):
        return indexer_topk(indexer, rows, iks, k, key_block)
    q = indexer.q[rows].float().contiguous()
    w = indexer.weights[rows].float().contiguous()
    empty = torch.empty(0, dtype=torch.long)
    slots = empty if iks.pages is not None else iks.slots.long().contiguous()
    pages = empty if iks.pages is None else iks.pages.long().contiguous()
    visible = iks.visible.long().contiguous()
    with torch.profiler.record_function("hybridkv::cpu_indexer_topk"):  # named in profiles (not an aten op)
        return kernel(q, w, keys, slots, pages, iks.slots_per_page, visible, iks.length, k, float(indexer.scale))


def _logits(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D], keys [L, D] or [n, L, D] -> [n, H, L]."""
    if keys.dim() == 2:
        return torch.matmul(q, keys.t()).mul_(scale)
    return torch.einsum("nhd,nld->nhl", q, keys).mul_(scale)


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
    logits = [_logits(q, k, scale).masked_fill_(~m[:, None, :], float("-inf")) for k, m in key_sets]
    sink = sinks.to(q.dtype).view(1, H, 1).expand(n, H, 1)
    probs = torch.softmax(torch.cat(logits + [sink], dim=-1), dim=-1)  # softmax subtracts the row max itself
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
            keys = dequantize_kv(cache[ks.slots[..., lo:hi]], q.dtype)
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


def _gather(cache: torch.Tensor, ks: KeySet, dtype: torch.dtype) -> torch.Tensor:
    """The key set's rows of cache in dtype (an FP8 cache's keys widened exactly)."""
    return dequantize_kv(cache[ks.slots], dtype)


def torch_joint_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, KeySet]], sinks: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The joint softmax over every (cache, key set) source plus the sink, in torch ops."""
    if sum(ks.length for _, ks in sources[1:]) <= ENTRY_KEY_BLOCK:
        # Short entry lists (every CSA block: top-k; HCA below ENTRY_KEY_BLOCK entries): one pass.
        return joint_softmax_attention(q, [(_gather(cache, ks, q.dtype), ks.mask) for cache, ks in sources], sinks, scale)
    return online_joint_attention(q, sources, sinks, scale, ENTRY_KEY_BLOCK)


# Columns (summed over the key sets) the fused kernel takes: it holds [heads, columns] logits per
# thread and a shared set's keys packed once ([columns, D] floats); longer lists (HCA at
# multi-million-token contexts) run the torch online softmax, bounded by ENTRY_KEY_BLOCK.
FUSED_ATTENTION_MAX_COLUMNS = 1 << 16


def cpu_joint_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, KeySet]], sinks: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """torch_joint_attention through the fused C++ kernel (cpu_kernels/joint_attention.cpp) where
    it applies: float32 queries on the CPU, caches all float32 or all one FP8 format
    (kv_cache_dtype; widened exactly as they are read, so the result is the float32 kernel's on
    the widened caches), at most FUSED_ATTENTION_MAX_COLUMNS columns. The keys are read in place
    through their slots, only the columns each row may read, with no [rows, heads, keys] logits,
    masks or concatenations; the result differs from the torch path's only in summation order.
    Elsewhere (no compiler, HYBRIDKV_CPU_KERNELS=0, other or mixed dtypes, other devices)
    torch_joint_attention runs."""
    kernel = load_joint_attention() if q.device.type == "cpu" else None
    cache_dtypes = {c.dtype for c, _ in sources}
    if (kernel is None or q.dtype != torch.float32 or q.shape[0] == 0
            or sum(ks.length for _, ks in sources) > FUSED_ATTENTION_MAX_COLUMNS
            or len(cache_dtypes) > 1 or not cache_dtypes <= {torch.float32, *FP8_DTYPES}
            or any(c.device.type != "cpu" or c.dim() != 2 or not c.is_contiguous() for c, _ in sources)):
        return torch_joint_attention(q, sources, sinks, scale)
    empty = torch.empty(0, dtype=torch.long)
    none = torch.empty(0, dtype=torch.bool)
    slots = [ks.slots.long().contiguous() for _, ks in sources]
    masks = [none if ks.visible is not None else ks.explicit_mask.contiguous() for _, ks in sources]
    visibles = [empty if ks.visible is None else ks.visible.long().contiguous() for _, ks in sources]
    with torch.profiler.record_function("hybridkv::cpu_joint_attention"):  # named in profiles (not an aten op)
        return kernel(q.contiguous(), sinks.float().contiguous(), float(scale), [c for c, _ in sources], slots,
                      masks, visibles)


class HybridV4Attention(HybridAttentionBackend):
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
            out[rows] = self.attend(qb, sources, sinks, scale)
        return out

    def entries(self, blk: QueryBlock, meta: HybridAttentionMetadata, entry_cache: torch.Tensor | None,
                entry_space: str | None, indexer: IndexerQuery | None,
                hisparse: HiSparseLayer | None) -> tuple[torch.Tensor, KeySet] | None:
        """(cache, key set) of the compressed entries this block reads: every causal C128 entry,
        or the indexer's top-k C4 entries -- with HiSparse, from the hot buffer for decode rows
        and from the (host) mirror for prefill rows."""
        if entry_cache is None or not blk.entries[entry_space].length:
            return None
        ks = blk.entries[entry_space]
        if indexer is None:
            return entry_cache, ks
        rows = slice(blk.start, blk.end)
        idx = self.topk(indexer, rows, blk.entries[indexer.space], min(indexer.topk, ks.length))
        if hisparse is None:
            return entry_cache, ks.take(idx)
        h = hisparse
        if blk.start < meta.num_decodes:
            return h.hot, select_from_buffer(h.step, h.layer, h.hot, entry_cache, blk.start, blk.end, ks, idx,
                                             self.swap_in)
        return read_mirror(h.step, entry_cache, ks.take(idx), h.hot)

    write = staticmethod(write_slots)  # cache rows into their slots; the Triton backend writes by kernel
    topk = staticmethod(cpu_indexer_topk)  # the Triton backend scores with its kernel
    attend = staticmethod(cpu_joint_attention)  # the joint softmax; the Triton backend attends in its kernel
    swap_in = staticmethod(swap_in)  # HiSparse's hot-buffer swap-in; the Triton backend fuses it in one kernel
