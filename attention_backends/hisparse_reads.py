"""HiSparse reads: CSA decode queries read their top-k C4 entries from per-request hot buffers.

The bookkeeping (which buffer slot holds which entry, LRU, what to copy) is
block_manager/hisparse.py's HotBuffers; this module executes it for one step:

  build_hisparse_step  once per step (host side): the decode sequences' buffer rows, the
                       hand-off of requests that start decoding (their most recent `size`
                       entries enter the buffer), and this step's new entries of rows that
                       already have one (they enter as they are written to the mirror);
  prepare_layer        per CSA layer, after its compressor wrote the new entries: run those
                       inserts and copy the entries in from the mirror (the c4 pool);
  select_from_buffer   per CSA layer and decode block, after the indexer's top-k: assign
                       slots (hits stay, misses take LRU slots), copy the misses in, and give
                       the attention a key set over the buffer.

The keys read are the same values in the same order as a read of the mirror, so attention over
the buffer is exactly attention over the full history. Prefill rows read the mirror directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridkv.attention_backends.hybrid_metadata import C4, HybridAttentionMetadata, HybridLayout, KeySet
from hybridkv.attention_backends.metadata import NULL_SLOT, StepSequences
from hybridkv.block_manager.hisparse import NO_ENTRY, HotBuffers


@dataclass
class HiSparseStep:
    buffers: HotBuffers
    rows: torch.Tensor  # [nd] buffer row of each decode sequence
    # Requests that start decoding this step: their rows and the entries / mirror slots to insert
    # (padded with NO_ENTRY / NULL_SLOT), [h] and [h, m].
    handoff_rows: torch.Tensor
    handoff_entries: torch.Tensor
    handoff_slots: torch.Tensor
    # Rows that already had a buffer and closed a C4 window this step: the new entry and its
    # mirror slot ([e], [e, 1], [e]; at most one per decode sequence and step).
    new_rows: torch.Tensor
    new_entries: torch.Tensor
    new_slots: torch.Tensor


def build_hisparse_step(seqs: StepSequences, meta: HybridAttentionMetadata, layout: HybridLayout,
                        buffers: HotBuffers) -> HiSparseStep | None:
    nd = meta.num_decodes
    if nd == 0 or seqs.request_ids is None:
        return None
    ids = seqs.request_ids[:nd]
    ratio, S = layout.csa_ratio, buffers.size
    spp = layout.page_size // ratio
    rows, fresh = [], []
    for i, rid in enumerate(ids):
        row = buffers.row_of(rid)
        if row is None:
            row = buffers.acquire(rid)
            fresh.append(i)
        rows.append(row)
    rows_t = torch.tensor(rows, dtype=torch.long)
    table = seqs.block_tables[C4][:nd]
    if fresh:
        f = torch.tensor(fresh)
        count = torch.tensor(seqs.context_lens)[f] // ratio  # entries after this step's compression
        m = max(1, min(S, int(count.max())))
        w = (count - m).clamp(min=0)[:, None] + torch.arange(m)[None, :]  # the most recent m entries
        ok = w < count[:, None]
        page = table[f[:, None], (w // spp).clamp(max=table.shape[1] - 1)]
        h_entries = torch.where(ok, w, NO_ENTRY)
        h_slots = torch.where(ok, page * spp + w % spp, NULL_SLOT)
        h_rows = rows_t[f]
    else:
        h_rows = torch.empty(0, dtype=torch.long)
        h_entries = h_slots = torch.empty(0, 1, dtype=torch.long)
    plan = meta.plans.get("csa")
    new_rows = torch.empty(0, dtype=torch.long)
    new_entries, new_slots = torch.empty(0, 1, dtype=torch.long), torch.empty(0, dtype=torch.long)
    if plan is not None and plan.num_entries:
        old = torch.ones(nd, dtype=torch.bool)
        if fresh:
            old[torch.tensor(fresh)] = False  # a hand-off already covers its new entry
        take = plan.seq < nd
        take[take.clone()] = old[plan.seq[take]]
        new_rows = rows_t[plan.seq[take]]
        new_entries = plan.entry[take][:, None]
        new_slots = plan.out_slots[C4][take]
    return HiSparseStep(buffers, rows_t, h_rows, h_entries, h_slots, new_rows, new_entries, new_slots)


@dataclass
class HiSparseLayer:
    """What one CSA layer passes its backend: the step, its CSA-layer ordinal, its buffer tensor."""

    step: HiSparseStep
    layer: int
    hot: torch.Tensor  # [buffers.num_slots, D]


def swap_in(buffers: HotBuffers, layer: int, rows: torch.Tensor, entries: torch.Tensor, hot: torch.Tensor,
            mirror: torch.Tensor, mirror_slots: torch.Tensor, insert: bool = False) -> torch.Tensor:
    """Place entries [n, k] (NO_ENTRY: nothing) of buffer rows [n] in layer's hot buffers and copy
    the misses in from the mirror (their slots there: mirror_slots [n, k]); returns the global
    buffer slots [n, k] to read. The torch twin of the Triton backend's fused swap-in kernel."""
    a = buffers.assign(layer, rows, entries, insert=insert)
    if bool(a.missed.any()):
        hot.index_copy_(0, a.slots[a.missed], mirror[mirror_slots[a.missed]].to(hot.dtype))
    return a.slots


SwapIn = Callable[..., torch.Tensor]  # swap_in's signature: a backend may bring its own


def prepare_layer(step: HiSparseStep, layer: int, hot: torch.Tensor, mirror: torch.Tensor,
                  swap: SwapIn = swap_in) -> None:
    """Hand-offs and new entries of this CSA layer into its buffers (after the compressor wrote
    the step's entries to the mirror, before any selection reads them)."""
    b = step.buffers
    if step.handoff_rows.numel():
        swap(b, layer, step.handoff_rows, step.handoff_entries, hot, mirror, step.handoff_slots, insert=True)
    if step.new_rows.numel():
        swap(b, layer, step.new_rows, step.new_entries, hot, mirror, step.new_slots[:, None], insert=True)


def select_from_buffer(step: HiSparseStep, layer: int, hot: torch.Tensor, mirror: torch.Tensor, start: int,
                       end: int, entries: KeySet, idx: torch.Tensor, swap: SwapIn = swap_in) -> KeySet:
    """Decode rows [start, end): the selected columns idx [n, k] of their causal C4 entries
    (entry w = column w), read from the hot buffer after copying the misses in."""
    valid = idx < entries.visible[:, None]
    slots = swap(step.buffers, layer, step.rows[start:end], torch.where(valid, idx, NO_ENTRY), hot, mirror,
                 entries.slots_of(idx))
    return KeySet(slots, explicit_mask=valid)
