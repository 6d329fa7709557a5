"""Torch-native paged attention: the CPU reference backend.

The KV cache of a layer is head-major, [Hkv, num_slots, D], so gathering any set of slots
gives one contiguous [slots, D] block per KV head. Page 0 (slots [0, page_size)) is the null
page: zeros, never written; every padded or masked key slot points there.

Working memory per call is bounded by the step's tokens and the tile sizes of metadata.py,
never by batch x longest context:
  * Decode on the CPU: the C++ paged kernel (cpu_kernels/) reads each decode's keys and values
    in place through its block-table row, one pass per (sequence, KV head) for all the query
    heads of that KV head, online softmax over 256-key blocks; the metadata then builds no decode
    tiles (StepSequences.decode_tiles, set by the runner from needs_decode_tiles). Measured on a
    2-core Zen 3 (AVX2), demo model, float32: a batch-32 decode step 158 -> 116 ms, workload b
    +14-17%, outputs token-identical. The torch path below is the fallback (no compiler,
    HYBRIDKV_CPU_KERNELS=0, cpu_kernels=False, another device) and the kernel's reference.
  * Decode in torch: each tile gathers at most TileSizes.decode_tile_keys keys (items of one or more
    sequences) and runs two batched matmuls with the query heads grouped under their KV head,
    softmax in float32. A sequence longer than TileSizes.kv_chunk is split over several items
    (split-KV); the partial results are merged with a log-sum-exp merge into per-sequence accumulators. A short
    decode batch is one tile and one plain softmax (the fast path). (On CPU this beats
    scaled_dot_product_attention for one query token, which in bfloat16 takes a slow path.)
  * Prefill in bfloat16 on a CPU with bf16 dot products: the bf16 kernel
    (cpu_kernels/prefill_attention_bf16.cpp, both products on AMX tiles or on AVX512-BF16
    vectors, the softmax in AVX-512) takes every prefill chunk of the step in one call, like the
    float32 kernel below.
  * Prefill on the CPU (float32; bfloat16 where the CPU lacks bf16 dot products): the C++
    prefill kernel (cpu_kernels/prefill_attention.cpp) takes every prefill chunk of the step in
    one call, reading K/V in place through the block table, blocked like a GEMM (query tiles x
    64-key blocks, online softmax). Intel AMX VM, float32, a 1,024-token causal prompt with the
    demo model's heads: 213 GFLOP/s against SDPA's 130; workload c 1.23 -> 1.06 s. Elsewhere
    (no compiler, other dtypes or head sizes, another device) the torch path:
  * Prefill in torch: a chunk that starts at position 0 and whose window does not bite runs as one SDPA
    is_causal call on its own K/V. On the CPU, a chunk after cached context in a space without a
    window runs as one causal flash call over [context, chunk] (a short context, the queries
    behind rows of zeros) or as its own causal call plus the context in unmasked key blocks,
    merged by log-sum-exp (_prefill_after_context). Otherwise it is cut into query tiles of
    TileSizes.prefill_q_tile queries; each tile reads its keys in blocks (at most _key_chunk
    keys gathered at once) through the CPU flash-attention kernel, which returns each block's
    log-sum-exp, and the blocks are merged by it. A KV head's query heads are folded into its
    query rows, so one call reads each KV head once (no K/V repeat for GQA). Keys whose slots
    are consecutive (a request's pages are allocated in runs: block_manager/block_space.py) are
    read in place, as a view of the cache, not gathered; only the key columns a query may not
    see are masked (the chunk's own tail and the window's edge, at most a tile's width each),
    never the whole prefix.

FP8 KV caches (kv_cache_dtype, attention_backends/kv_cache_dtype.py): every write quantizes
(saturating, scale 1.0: the C++ writer, or clamp + cast), and every read dequantizes: the C++
kernels load the FP8 bytes and widen them to float32 in their inner loops, the torch paths widen
each gathered block to the query's dtype, and a chunk's own K/V are attended as the cache holds
them (quantized and widened back), so a prefix read from the cache and the same prefix computed
in the chunk are the same numbers.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hybridkv.attention_backends.backend import AttentionBackend
from hybridkv.attention_backends.cpu_kernels import (load_paged_attention, load_prefill_attention,
                                                     load_prefill_attention_bf16, load_write_kv)
from hybridkv.attention_backends.kv_cache_dtype import as_stored, dequantize_kv, is_fp8, store_rows
from hybridkv.attention_backends.metadata import (AttentionMetadata, DecodeTile, PrefillSeq, TileSizes,
                                                  prefill_row_groups)
from hybridkv.block_manager.space_spec import window_start
from hybridkv.cpu_features import cpu_features

_SMALL_DECODE_ELEMENTS = 1 << 16  # gathered key elements below which decode runs in float32
# Stand-in for -inf as the running max of an online softmax: a fully masked tile then gives
# exp(-inf - _NEG_BIG) = 0 instead of exp(-inf + inf) = NaN.
_NEG_BIG = -1e30


class TorchNativeAttention(AttentionBackend):
    name = "torch_native"

    def __init__(self, device: torch.device | str = "cpu", cpu_kernels: bool = True) -> None:
        """On the CPU, decodes read K/V in place through the block table with the C++ paged
        kernel (cpu_kernels/) when it builds here; cpu_kernels=False, another device, or no
        compiler: the torch path over the metadata's decode tiles."""
        on_cpu = torch.device(device).type == "cpu"
        self._kernels_here = cpu_kernels and on_cpu
        self._paged = load_paged_attention() if self._kernels_here else None
        self._prefill_kernel = load_prefill_attention() if self._kernels_here else None
        self._write_kv = load_write_kv() if self._kernels_here else None
        self._prefill_bf16_kernel: Callable[..., torch.Tensor] | None = None
        self._prefill_bf16_resolved = False

    @property
    def _prefill_bf16(self) -> Callable[..., torch.Tensor] | None:
        """The bf16 prefill kernel, looked up on the first bfloat16 prefill: a float32 model
        never builds it."""
        if not self._prefill_bf16_resolved:
            self._prefill_bf16_kernel = load_prefill_attention_bf16() if self._kernels_here else None
            self._prefill_bf16_resolved = True
        return self._prefill_bf16_kernel

    @_prefill_bf16.setter
    def _prefill_bf16(self, kernel: Callable[..., torch.Tensor] | None) -> None:
        self._prefill_bf16_kernel, self._prefill_bf16_resolved = kernel, True

    @property
    def needs_decode_tiles(self) -> bool:
        """Whether decodes read the metadata's decode tiles (the runner skips building them
        when not)."""
        return self._paged is None

    @property
    def paged_decode_in_use(self) -> bool:
        """Whether decodes on CPU tensors go through the C++ paged kernel and K/V writer
        (model_executor/fused_decode.py calls the same two kernels)."""
        return self._paged is not None and self._write_kv is not None

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_slots, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        space: str,
        scale: float,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output [T, H, D] of every row of the step, or of `out_rows` only (rows
        in ascending order, [len(out_rows), H, D]; every row's K/V is written either way). A
        model's last layer asks for the rows it samples: the C++ prefill kernel then attends
        those rows alone, and their bits are the ones the whole chunk would give them (each row's
        arithmetic is its own there: tests/attention_backends/test_torch_native.py)."""
        if meta.kv_loads is not None:  # host-tier load-backs into this layer's pages land first
            meta.kv_loads.wait(k_cache, v_cache)
        sm = meta.spaces[space]
        self._write(k, v, k_cache, v_cache, sm.slot_mapping)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            out = self._decodes(q, k_cache, v_cache, meta, sm, scale)
            return out if out_rows is None else out[out_rows]
        kernel = self._prefill_kernel_for(q, k_cache)
        if kernel is not None:
            window = -1 if sm.window is None else sm.window
            table = sm.block_table if sm.block_table.dtype == torch.int32 else sm.block_table.to(torch.int32)
            if out_rows is None:
                starts, rows, positions = meta.prefill_groups
                # The kernels read q through its strides (a view into the QKV output) and return a
                # contiguous result, so a step of prefills only takes it as it is: no copy of either.
                prefills = kernel(q[nd:], k_cache, v_cache, table, starts, rows, positions, meta.page_size, window,
                                  scale)
                self._regenerate(prefills, nd, q, k_cache, v_cache, table, meta, window, scale)
            else:
                cut = int(torch.searchsorted(out_rows, nd))  # out_rows[:cut] are decodes
                chosen = out_rows[cut:]
                if chosen.numel():
                    starts, rows, positions = prefill_row_groups(meta, chosen)
                    prefills = kernel(q[chosen], k_cache, v_cache, table, starts, rows, positions, meta.page_size,
                                      window, scale)
                    self._regenerate(prefills, nd, q, k_cache, v_cache, table, meta, window, scale, chosen)
                else:  # prompt chunks that sample nothing: their K/V above is all this layer owes them
                    prefills = q.new_empty((0, *q.shape[1:]))
            if not nd:
                return prefills
            decodes = self._decodes(q[:nd], k_cache, v_cache, meta, sm, scale)  # every one samples, as a rule
            if out_rows is not None and cut < nd:
                decodes = decodes[out_rows[:cut]]
            return torch.cat([decodes, prefills])
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decodes(q[:nd], k_cache, v_cache, meta, sm, scale)
        k, v = as_stored(k, k_cache.dtype), as_stored(v, v_cache.dtype)  # the chunks' own keys, as read back
        for p in sm.prefills:
            out[p.query_start : p.query_end] = self._prefill(q, k, v, k_cache, v_cache, p, sm.window, scale, meta.tiles)
        return out if out_rows is None else out[out_rows]

    def _regenerate(self, prefills: torch.Tensor, nd: int, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, table: torch.Tensor, meta: AttentionMetadata, window: int, scale: float,
                    rows: torch.Tensor | None = None) -> None:
        """Rows at generated positions (a request recomputed after a preemption) again as the
        decodes that first computed them, one-row groups of the paged kernel, over the prefill
        kernel's result (`prefills` holds the rows from nd on, or `rows` of the batch): the two
        kernels round differently, and a preemption must not change a request's bits."""
        if meta.regenerated is None or self._paged is None:
            return
        rows_again, seq_rows, pos = meta.regenerated
        if rows is None:
            at = rows_again - nd
        else:
            at = torch.searchsorted(rows, rows_again)  # where each regenerated row sits in `rows`, if it does
            kept = (at < rows.numel()) & (rows[at.clamp(max=rows.numel() - 1)] == rows_again)
            if not bool(kept.any()):
                return
            rows_again, seq_rows, pos, at = rows_again[kept], seq_rows[kept], pos[kept], at[kept]
        groups = torch.arange(rows_again.numel() + 1, dtype=torch.int32)
        prefills[at] = self._paged(q[rows_again], k_cache, v_cache, table, groups, seq_rows, pos, meta.page_size,
                                   window, scale)

    def _prefill_kernel_for(self, q: torch.Tensor, k_cache: torch.Tensor):
        """The C++ kernel that takes the step's prefills, or None for the SDPA / tile path below.
        CPU tensors of one dtype with contiguous cache rows, and then:
        - bfloat16 on a CPU with bf16 dot products, head size a multiple of 64 up to 256: the bf16
          kernel (cpu_kernels/prefill_attention_bf16.cpp), on AMX tiles where the CPU has them
          (the Intel AMX VM, a 1,024-token causal prompt with the demo model's heads: ~1.6 ms a
          layer against SDPA's bf16 flash attention's ~3.0), else on AVX512-BF16 vectors (a Zen 4
          EPYC, the same prompt: see cpu_kernels/bf16_products_avx512.h);
        - float32, or bfloat16 where the CPU has no bf16 dot products, head size a multiple of 16
          (whole vectors on either ISA): the float32-FMA kernel (prefill_attention.cpp);
        - bfloat16 with bf16 dot products and another head size: None, SDPA's bf16 flash attention;
        - an FP8 cache: the float32-FMA kernel (float32 or bfloat16 queries), which widens the
          cache's bytes as it reads them.
          (Which of SDPA and the float32-FMA kernel wins there depends on the CPU, measured at D
          64 only: SDPA on the Intel AMX VM, workload c 0.34 vs 0.44 s; the kernel on the Zen 4
          EPYC, 0.82 vs 0.98 s. Other head sizes are not measured.)"""
        if not (q.is_cpu and k_cache.is_cpu and k_cache.stride(-1) == 1):
            return None
        head = q.shape[-1]
        if is_fp8(k_cache.dtype):  # widened to float32 as it is read, whatever q's dtype: the FMA kernel
            takes = q.dtype in (torch.float32, torch.bfloat16) and head % 16 == 0
            return self._prefill_kernel if takes else None
        if q.dtype != k_cache.dtype:
            return None
        if q.dtype == torch.bfloat16 and _native_bf16_matmuls():
            takes = self._prefill_bf16 is not None and head % 64 == 0 and head <= 256
            return self._prefill_bf16 if takes else None
        if q.dtype in (torch.float32, torch.bfloat16) and head % 16 == 0:
            return self._prefill_kernel
        return None

    def _write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor) -> None:
        """The step's K/V rows into their slots: the C++ copy when it applies (CPU tensors, rows
        contiguous per head; into an FP8 cache it quantizes, as quantize_kv), else index_copy_ (its
        reference; FP8 bytes copied as uint8, which torch's index_copy_ takes)."""
        if (self._write_kv is not None and k.is_cpu and k_cache.is_cpu and slots.dtype == torch.int64
                and slots.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
                and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
            self._write_kv(k_cache, v_cache, slots, k, v)
            return
        store_rows(k_cache, slots, k.transpose(0, 1), dim=1)
        store_rows(v_cache, slots, v.transpose(0, 1), dim=1)

    # -- decode --------------------------------------------------------------------------------
    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 sm, scale: float) -> torch.Tensor:
        """The step's decode rows: in place through the block table (the CPU kernel), or over
        the decode tiles (torch)."""
        if self._paged is None or q.device.type != "cpu":  # (a CUDA tensor given to the CPU reference)
            if not sm.decode_tiles:
                raise RuntimeError("decode tiles were not built (StepSequences.decode_tiles=False) and the CPU "
                                   "paged kernel is not in use: build the metadata with decode_tiles=True")
            return self._decode(q, k_cache, v_cache, sm.decode_tiles, sm.decode_split, scale)
        starts, rows, positions = meta.decode_groups
        window = -1 if sm.window is None else sm.window
        table = sm.block_table if sm.block_table.dtype == torch.int32 else sm.block_table.to(torch.int32)
        return self._paged(q, k_cache, v_cache, table, starts, rows, positions, meta.page_size, window, scale)

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,  # [Hkv, num_slots, D]
        v_cache: torch.Tensor,
        tiles: list[DecodeTile],
        split: bool,
        scale: float,
    ) -> torch.Tensor:
        B, H, D = q.shape
        hkv = k_cache.shape[0]
        if len(tiles) == 1 and not split:
            return _decode_tile(q, k_cache, v_cache, tiles[0], scale, normalize=True)[0].reshape(B, H, D)
        if not split:  # every sequence is one item: tiles write disjoint rows
            out = torch.empty_like(q)
            for t in tiles:
                out[t.seq] = _decode_tile(q[t.seq], k_cache, v_cache, t, scale, normalize=True)[0].reshape(-1, H, D)
            return out
        # Split-KV: merge every item's partial (max, sum, weighted values) into its sequence.
        acc_m = torch.full((B, hkv, H // hkv, 1), _NEG_BIG, device=q.device)
        acc_l = torch.zeros(B, hkv, H // hkv, 1, device=q.device)
        acc_o = torch.zeros(B, hkv, H // hkv, D, device=q.device)
        for t in tiles:
            o, m, l = _decode_tile(q[t.seq], k_cache, v_cache, t, scale, normalize=False)
            idx = t.seq.view(-1, 1, 1, 1).expand_as(m)
            new_m = acc_m.scatter_reduce(0, idx, m, "amax")
            alpha = torch.exp(acc_m - new_m)
            beta = torch.exp(m - new_m[t.seq])
            acc_l.mul_(alpha).index_add_(0, t.seq, l * beta)
            acc_o.mul_(alpha).index_add_(0, t.seq, o * beta)
            acc_m = new_m
        return (acc_o / acc_l).to(q.dtype).reshape(B, H, D)

    # -- prefill -------------------------------------------------------------------------------
    @staticmethod
    def _prefill(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        p: PrefillSeq, window: int | None, scale: float, sizes: TileSizes,
    ) -> torch.Tensor:
        qs, qe = p.query_start, p.query_end
        gqa = q.shape[1] != k.shape[1]
        if p.own_kv:  # its keys are exactly this chunk's: plain causal, no mask tensor at all
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
                k[qs:qe].transpose(0, 1).unsqueeze(0),
                v[qs:qe].transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=scale, enable_gqa=gqa,
            )
            return o[0].transpose(0, 1)
        if window is None and q.device.type == "cpu":
            return _prefill_after_context(q[qs:qe], k[qs:qe], v[qs:qe], k_cache, v_cache, p, scale, sizes)
        out = torch.empty_like(q[qs:qe])
        for a in range(0, qe - qs, sizes.prefill_q_tile):
            b = min(qe - qs, a + sizes.prefill_q_tile)
            k0 = window_start(p.start + a, window) - p.key_start  # first key this tile reads
            k1 = p.start + b - p.key_start  # one past the last (the tile's last query)
            out[a:b] = _prefill_tile(
                q[qs + a : qs + b], p.start + a, k_cache, v_cache, p, k0, k1, window, scale,
                _key_chunk(b - a, sizes), sizes.min_view_keys,
            )
        return out


def _native_bf16_matmuls() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16 or AMX-BF16): the one answer the
    engine uses everywhere (hybridkv.cpu_features; tests patch this seam)."""
    return cpu_features().native_bf16


def _key_chunk(queries: int, sizes: TileSizes) -> int:
    """Keys per block of a prefill tile: kv_chunk for a full tile, more for a short one (up to
    a decode tile's keys, so a gathered block's K/V stay within a decode tile's). A short chunk
    late in a long context, as chunked prefill beside running streams produces, then reads its
    keys in one or two calls instead of one per kv_chunk keys."""
    scaled = sizes.kv_chunk * sizes.prefill_q_tile // max(1, queries)
    return max(sizes.kv_chunk, min(scaled, sizes.decode_tile_keys))


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, num_slots, D] at slots (any shape) -> [Hkv, *slots.shape, D], contiguous.

    index_select over the flattened slots: on CPU about 5x faster than advanced indexing
    (cache[:, slots]) for the same copy."""
    out = cache.index_select(1, slots.reshape(-1))
    return out.view(cache.shape[0], *slots.shape, cache.shape[-1])


def _tile_mask(q_first: int, q_end: int, k_first: int, k_end: int, window: int | None,
               device: torch.device) -> torch.Tensor | None:
    """[q, k] bool for queries at positions [q_first, q_end) over keys at [k_first, k_end)
    (True = attend): causal, and inside each query's window. None when every pair is allowed."""
    if k_end - 1 <= q_first and k_first >= window_start(q_end - 1, window):
        return None
    qpos = torch.arange(q_first, q_end, device=device)[:, None]
    kpos = torch.arange(k_first, k_end, device=device)[None, :]
    return (kpos <= qpos) & (kpos >= window_start(qpos, window))


def _edge_mask(p: PrefillSeq, q_first: int, n: int, c0: int, c1: int, window: int | None, grp: int,
               qt: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(additive mask [grp * n, c1 - c0] in qt's dtype, rows that see none of the keys [grp * n]
    or None) for a query tile over keys p.key_slots[c0:c1]; (None, None) when every pair is
    allowed. The same for every layer of the step, so it is built once and kept in
    p.layer_memo instead of per layer (about ten small ops each time). Measured under cProfile
    in closed_loop.py --stagger 0.3 (~100-token chunks beside decodes, Zen 3): a layer's
    prefill attention 1.35 -> 1.18 ms."""
    key = ("edge", q_first, n, c0, c1, window, grp, qt.dtype, qt.device)
    if key not in p.layer_memo:
        allowed = _tile_mask(q_first, q_first + n, p.key_start + c0, p.key_start + c1, window, qt.device)
        if allowed is None:
            p.layer_memo[key] = (None, None)
        else:
            mask = torch.zeros(allowed.shape, dtype=qt.dtype, device=qt.device)
            mask = mask.masked_fill_(~allowed, float("-inf")).repeat(grp, 1)  # rows (group, query)
            blind = ~allowed.any(dim=-1)  # queries that see none of these keys
            p.layer_memo[key] = (mask, blind.repeat(grp) if bool(blind.any()) else None)
    return p.layer_memo[key]


def _grouped_scores(qg: torch.Tensor, kd: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.matmul(qg, kd.transpose(-1, -2)).float() * scale


def _decode_tile(
    q: torch.Tensor,  # [G, H, D] the query of each item
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tile: DecodeTile,
    scale: float,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """normalize=True: (attention output [G, Hkv, grp, D] in q's dtype, None, None).
    normalize=False: float32 partials (sum_j p_j v_j, max, sum_j p_j) with p_j = exp(s_j - max),
    each [G, Hkv, grp, *], for the split-KV merge."""
    G, H, D = q.shape
    hkv = k_cache.shape[0]
    kd = dequantize_kv(gather_slots(k_cache, tile.slots), q.dtype)  # [Hkv, G, W, D], contiguous
    vd = dequantize_kv(gather_slots(v_cache, tile.slots), q.dtype)
    qg = q.view(G, hkv, H // hkv, D).transpose(0, 1)  # [Hkv, G, grp, D]
    if q.dtype != torch.float32 and kd.numel() <= _SMALL_DECODE_ELEMENTS:
        # Small reduced-precision matmuls pay a fixed oneDNN cost larger than the work
        # (about 20 us each in bfloat16 vs 7 us in float32 for one short sequence).
        qg, kd, vd = qg.float(), kd.float(), vd.float()
    scores = _grouped_scores(qg, kd, scale)  # [Hkv, G, grp, W]
    if tile.masked is not None:
        scores.masked_fill_(tile.masked[None, :, None, :], float("-inf"))
    if normalize:
        probs = torch.softmax(scores, dim=-1).to(vd.dtype)
        return torch.matmul(probs, vd).to(q.dtype).transpose(0, 1), None, None
    m = scores.amax(dim=-1, keepdim=True)  # every item holds at least one valid key
    probs = torch.exp(scores - m)
    l = probs.sum(dim=-1, keepdim=True)
    o = torch.matmul(probs.to(vd.dtype), vd).float()
    return o.transpose(0, 1), m.transpose(0, 1), l.transpose(0, 1)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash-attention kernel behind SDPA, called directly for its log-sum-exp: q
    [1, H, rows, D] over k, v [1, Hkv, L, D] (H a multiple of Hkv: GQA without repeating K/V) ->
    (out [1, H, rows, D], log-sum-exp of the scaled scores [1, H, rows], float32). causal: query
    i sees keys [0, i] (top-left aligned)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [1, Hkv, rows, D] over one key block k, v [1, Hkv, L, D] (mask: additive,
    [rows, L], q's dtype): (out [1, Hkv, rows, D], log-sum-exp of the scaled scores [1, Hkv, rows]).

    On CPU it is the flash-attention kernel behind SDPA, called directly for its log-sum-exp
    (blocked, vectorised, parallel over heads and query blocks: 1.27-2.7x the matmul-softmax-
    matmul it replaces for 1-64 queries over 7,888 keys, per layer, on a 2-core AMD Zen 3). Elsewhere (a CUDA
    tensor given to the reference backend) the same result in plain ops (fused=False forces
    them: the test that checks the two agree runs on the CPU)."""
    if (fused if fused is not None else q.device.type == "cpu"):
        return _flash(q, k, v, False, scale, mask)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a fully masked row: all zeros
    return torch.matmul(p.to(v.dtype), v), lse


def _prefill_after_context(
    qc: torch.Tensor,  # [n, H, D]: the chunk's queries
    kc: torch.Tensor,  # [n, Hkv, D]: the chunk's own keys and values
    vc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillSeq,
    scale: float,
    sizes: TileSizes,
) -> torch.Tensor:
    """A chunk after cached context, no window (keys [0, p.end)): its own keys causally in one
    flash call (is_causal: the kernel skips the masked blocks, no mask tensor), then every query
    over the context [0, p.start) unmasked, in key blocks of at most kv_chunk keys, merged by
    their log-sum-exp. Every query sees all the context, so nothing there needs a mask, nor the
    query tiles of _prefill_tile, whose causal tails each get an additive mask. Measured in
    bfloat16 on the Intel AMX VM (where bf16 prefills take SDPA, not the C++ kernel): 8 prompts
    of 1,020 tokens in steps of 2,048, so every other prompt continues after a few cached
    tokens, attention 290-303 -> 264 ms a step; workload d with the prefix cache (32 suffixes
    after a shared 1,000-token prefix) 2.94-3.21 -> 2.66-2.87 s."""
    n, context = qc.shape[0], p.start - p.key_start
    if context * 4 <= n:
        # A short context (a prompt continued after the few tokens the last step's budget left
        # it): one causal call over [context, chunk] keys, the queries behind `context` rows of
        # zeros, so query i sits at row context + i and sees keys [0, context + i]. The padding
        # costs at most 1/16 of the call; it saves the second call and the merge.
        slots = p.key_slots[:context]
        k_all = torch.cat((dequantize_kv(gather_slots(k_cache, slots), kc.dtype), kc.transpose(0, 1)), dim=1)[None]
        v_all = torch.cat((dequantize_kv(gather_slots(v_cache, slots), vc.dtype), vc.transpose(0, 1)), dim=1)[None]
        q_all = qc.new_zeros(1, qc.shape[1], context + n, qc.shape[2])
        q_all[0, :, context:] = qc.transpose(0, 1)
        return _flash(q_all, k_all, v_all, True, scale)[0][0, :, context:].transpose(0, 1)
    qh = qc.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]; GQA: the kernel maps query heads to KV heads
    acc, m = _flash(qh, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0), True, scale)
    acc, l = acc.float(), torch.ones_like(m)
    for c0, c1, slot in p.key_blocks(0, p.start - p.key_start, sizes.kv_chunk, sizes.min_view_keys):
        kd, vd = _key_block(k_cache, v_cache, p, c0, c1, slot, qc.dtype)
        o, lse = _flash(qh, kd.unsqueeze(0), vd.unsqueeze(0), False, scale)
        m, l = _merge_block(acc, m, l, o, lse)
    return acc.div_(l.unsqueeze(-1)).to(qc.dtype)[0].transpose(0, 1)


def _key_block(k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillSeq, c0: int, c1: int,
               slot: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [Hkv, c1 - c0, D] of keys p.key_slots[c0:c1], one of p.key_blocks, in `dtype`: a
    view of the cache when its slots are consecutive (slot: the first), else gathered (an FP8
    cache's block widened to `dtype` either way)."""
    if slot is None:
        slots = p.key_slots[c0:c1]
        kd, vd = gather_slots(k_cache, slots), gather_slots(v_cache, slots)
    else:
        kd, vd = k_cache[:, slot : slot + c1 - c0], v_cache[:, slot : slot + c1 - c0]
    return dequantize_kv(kd, dtype), dequantize_kv(vd, dtype)


def _merge_block(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Folds one key block's (o, lse) into the float32 running (acc, m, l) of the same queries:
    acc in place (it is the caller's own float32 buffer); returns the new (m, l)."""
    m_new = torch.maximum(m, lse)
    alpha, beta = torch.exp(m - m_new), torch.exp(lse - m_new)
    acc.mul_(alpha.unsqueeze(-1)).add_(o * beta.unsqueeze(-1))
    return m_new, l * alpha + beta


def _prefill_tile(
    qt: torch.Tensor,  # [n, H, D]
    q_first: int,  # position of qt[0]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillSeq,
    k0: int,
    k1: int,
    window: int | None,
    scale: float,
    chunk: int,
    min_view: int,
) -> torch.Tensor:
    """One query tile over keys p.key_slots[k0:k1], as fused flash-attention calls over key
    blocks of at most `chunk` keys merged by their log-sum-exp; runs of at least min_view
    consecutive slots are read in place.

    The query heads of one KV head are folded into its query rows ([Hkv, grp * n, D]), so one
    call reads each KV head's keys once for all its query heads (no repeat of K/V for GQA).
    Only the key columns some query may not see -- the window's edge and the chunk's own causal
    tail, at most n columns each -- get a mask; the open range between them, which is nearly
    every key of a short chunk late in a long context, runs unmasked."""
    n, H, D = qt.shape
    hkv = k_cache.shape[0]
    grp = H // hkv
    qg = qt.view(n, hkv, grp, D).permute(1, 2, 0, 3).reshape(1, hkv, grp * n, D)  # rows (group, query)
    # Keys every query of the tile may read: positions [window start of the last query, first query].
    open_lo = max(k0, window_start(q_first + n - 1, window) - p.key_start)
    open_hi = min(k1, q_first + 1 - p.key_start)
    if open_lo < open_hi:
        ranges = ((k0, open_lo, True), (open_lo, open_hi, False), (open_hi, k1, True))
    else:  # more queries than the window: every column is an edge column of some query
        ranges = ((k0, k1, True),)
    acc = m = l = None
    for r0, r1, edge in ranges:
        if r0 >= r1:
            continue
        for c0, c1, slot in p.key_blocks(r0, r1, chunk, min_view):
            kd, vd = _key_block(k_cache, v_cache, p, c0, c1, slot, qt.dtype)
            mask, blind = _edge_mask(p, q_first, n, c0, c1, window, grp, qt) if edge else (None, None)
            o, lse = _attend_block(qg, kd.unsqueeze(0), vd.unsqueeze(0), mask, scale)
            if blind is not None:
                # A fully masked row comes back as zeros with log-sum-exp 0; give it no weight.
                lse = lse.masked_fill(blind, _NEG_BIG)
            if acc is None:
                acc, m, l = o, lse, None
                continue
            if l is None:  # a second block: switch to the float32 running merge
                acc, l = acc.float(), torch.ones_like(m)
            m, l = _merge_block(acc, m, l, o, lse)
    if l is not None:
        acc = (acc / l.unsqueeze(-1)).to(qt.dtype)
    return acc.view(hkv, grp, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
