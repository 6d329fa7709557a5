"""HiSparse reads: CSA decode queries read their top-k C4 entries from per-request hot buffers.

The bookkeeping (which buffer slot holds which entry, LRU, what to copy) is
hisparse_buffers.py's HotBuffers; the mirror (the full C4 history, in host memory) is reached
only through host_mirror.py. This module executes one step:

  build_hisparse_step  once per step (host side): the decode sequences' buffer rows, the
                       hand-off of requests that start decoding (their most recent `size`
                       entries enter the buffer), this step's new entries of rows that already
                       have one, and the host slots of every new entry (the mirror's writes);
  write_entries        per CSA layer, the compressor's new C4 entries into the mirror;
  prepare_layer        per CSA layer, after that: the hand-offs (copied in from the mirror)
                       and the new entries (copied from the compressor's output, on the device);
  select_from_buffer   per CSA layer and decode block, after the indexer's top-k: assign
                       slots (hits stay, misses take LRU slots), copy the misses in from the
                       mirror, and give the attention a key set over the buffer;
  read_mirror          per CSA layer and prefill block: the selected entries, read from the
                       mirror (gathered on the host and moved when it is on another device).

The keys read are the same values in the same order as a read of the mirror, so attention over
the buffer is exactly attention over the full history.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridkv.attention_backends.hisparse_buffers import NO_ENTRY, HotBuffers
from hybridkv.attention_backends.host_mirror import MirrorWrites, gather_rows, keys_on
from hybridkv.attention_backends.hybrid_metadata import C4, HybridAttentionMetadata, HybridLayout, KeySet
from hybridkv.attention_backends.kv_cache_dtype import store_rows
from hybridkv.attention_backends.metadata import NULL_SLOT, StepSequences


@dataclass
class HiSparseStep:
    buffers: HotBuffers
    mirror: MirrorWrites  # this step's new C4 entries, on their way into the mirror
    rows: torch.Tensor  # [nd] buffer row of each decode sequence
    # Requests that start decoding this step: their rows and the entries / mirror slots to insert
    # (padded with NO_ENTRY / NULL_SLOT), [h] and [h, m].
    handoff_rows: torch.Tensor
    handoff_entries: torch.Tensor
    handoff_slots: torch.Tensor
    # Rows that already had a buffer and closed a C4 window this step: the new entry and its
    # index among the step's new entries (the compressor's output rows): [e], [e, 1], [e]; at
    # most one per decode sequence and step.
    new_rows: torch.Tensor
    new_entries: torch.Tensor
    new_index: torch.Tensor


def build_hisparse_step(seqs: StepSequences, meta: HybridAttentionMetadata, layout: HybridLayout,
                        buffers: HotBuffers) -> HiSparseStep:
    plan = meta.plans.get("csa")
    none = torch.empty(0, dtype=torch.long)
    mirror = MirrorWrites(plan.out_slots[C4] if plan is not None else none)
    nd = meta.num_decodes if seqs.request_ids is not None else 0
    if nd == 0:  # no decode rows: only the mirror's writes
        return HiSparseStep(buffers, mirror, none, none, none[:, None], none[:, None], none, none[:, None], none)
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
        h_rows, h_entries, h_slots = none, none[:, None], none[:, None]
    new_rows, new_entries, new_index = none, none[:, None], none
    if plan is not None and plan.num_entries:
        old = torch.ones(nd, dtype=torch.bool)
        if fresh:
            old[torch.tensor(fresh)] = False  # a hand-off already covers its new entry
        take = plan.seq < nd
        take[take.clone()] = old[plan.seq[take]]
        new_rows = rows_t[plan.seq[take]]
        new_entries = plan.entry[take][:, None]
        new_index = take.nonzero().squeeze(1)
    return HiSparseStep(buffers, mirror, rows_t, h_rows, h_entries, h_slots, new_rows, new_entries, new_index)


@dataclass
class HiSparseLayer:
    """What one CSA layer passes its backend: the step, its CSA-layer ordinal, its buffer tensor."""

    step: HiSparseStep
    layer: int
    hot: torch.Tensor  # [buffers.num_slots, D]


def swap_in(buffers: HotBuffers, layer: int, rows: torch.Tensor, entries: torch.Tensor, hot: torch.Tensor,
            source: torch.Tensor, source_slots: torch.Tensor, insert: bool = False) -> torch.Tensor:
    """Place entries [n, k] (NO_ENTRY: nothing) of buffer rows [n] in layer's hot buffers and copy
    the misses in from `source` (the mirror, or the compressor's new entries; their rows there:
    source_slots [n, k]); returns the global buffer slots [n, k] to read. The torch twin of the
    Triton backend's fused swap-in kernel."""
    a = buffers.assign(layer, rows, entries, insert=insert)
    if bool(a.missed.any()):
        store_rows(hot, a.slots[a.missed], gather_rows(source, source_slots[a.missed], hot))
    return a.slots


SwapIn = Callable[..., torch.Tensor]  # swap_in's signature: a backend may bring its own


def write_entries(step: HiSparseStep, mirror: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                  write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
    """The compressor's new C4 entries values [E, D] (slots [E] in the mirror) into the mirror:
    in place on its own device (`write`: the backend's), else staged for the step's flush."""
    step.mirror.write(mirror, slots, values, write)


def prepare_layer(step: HiSparseStep, layer: int, hot: torch.Tensor, mirror: torch.Tensor,
                  fresh: torch.Tensor | None, swap: SwapIn = swap_in) -> None:
    """Hand-offs and new entries of this CSA layer into its buffers (after the compressor wrote
    the step's entries, `fresh` [E, D] on the device, before any selection reads them). A
    hand-off reads the mirror, so the step's writes land there first; a new entry is copied
    from `fresh` (the same bits as its mirror copy, without a trip through the host)."""
    b = step.buffers
    if step.handoff_rows.numel():
        step.mirror.flush()
        swap(b, layer, step.handoff_rows, step.handoff_entries, hot, mirror, step.handoff_slots, insert=True)
    if step.new_rows.numel():
        swap(b, layer, step.new_rows, step.new_entries, hot, fresh, step.new_index[:, None], insert=True)


def select_from_buffer(step: HiSparseStep, layer: int, hot: torch.Tensor, mirror: torch.Tensor, start: int,
                       end: int, entries: KeySet, idx: torch.Tensor, swap: SwapIn = swap_in) -> KeySet:
    """Decode rows [start, end): the selected columns idx [n, k] of their causal C4 entries
    (entry w = column w), read from the hot buffer after copying the misses in. A miss is never
    an entry written this step (prepare_layer put those in the row's buffer, so selecting one is
    a hit), so the mirror is read without waiting for the step's pending writes."""
    valid = idx < entries.visible[:, None]
    slots = swap(step.buffers, layer, step.rows[start:end], torch.where(valid, idx, NO_ENTRY), hot, mirror,
                 entries.slots_of(idx))
    return KeySet(slots, explicit_mask=valid)


def read_mirror(step: HiSparseStep, mirror: torch.Tensor, keys: KeySet,
                compute: torch.Tensor) -> tuple[torch.Tensor, KeySet]:
    """Prefill rows: (cache, key set) of their selected entries `keys`, read from the mirror
    (which then holds this step's entries too) for attention on compute's device."""
    step.mirror.flush()
    return keys_on(mirror, keys, compute)
