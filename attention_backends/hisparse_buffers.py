"""HiSparse's hot buffers: which C4 entry each device buffer slot holds, per request, with LRU.

During decode a CSA layer reads only the lightning indexer's top-k C4 entries, and adjacent
steps pick mostly the same ones. So with HiSparse the request's full C4 history stays in the
mirror (the c4 space's pool, in host memory) and each decoding request keeps, per CSA layer, a
device buffer of `size` entry slots. Per step and layer, after the top-k:

    hits    selected entries already in the buffer: read where they are;
    misses  each gets the least-recently-used slot that the current selection does not need
            (empty slots first), and is copied in from the mirror by the caller.

New entries (one per csa_ratio decoded tokens) and, when a request starts decoding, its most
recent `size` entries go through the same assignment (`insert`), so a history that fits the
buffer is never copied again: every selection is a hit.

The executor owns this state (the model allocates it from the layout's HotBufferShape, on the
engine's device) because the forward drives it: the top-k is computed inside each CSA layer.
The engine only tells it which requests left (`release`) and reads its counters.

This module only decides (which slot holds which entry, what to copy); the model's layers
execute the copies and read the buffer (attention_backends/hisparse_reads.py). Everything is
batched tensor work over the rows of a step (no per-request Python loop inside a layer): a sort
plus a searchsorted per row for the hits, one argsort over the LRU clock for the victims --
O(size log size) per row and layer, never O(context).

Buffer slot 0 is a null slot (zeros, never assigned): every padded or invalid selection reads
it, as the paged spaces' null page.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.block_manager.kv_plan import HotBufferShape

NO_ENTRY = -1
# Device bytes of the slot tables per buffer slot (entry and last use, int64 each) and per row
# (the row's lookup and hit counters, int64 each).
TABLE_BYTES_PER_SLOT = 16
COUNTER_BYTES_PER_ROW = 16


def hot_buffer_bytes(shape: HotBufferShape, entry_bytes: int) -> int:
    """Every device byte HiSparse's hot buffers take: per CSA layer a buffer tensor of the null
    slot plus rows x size entries of entry_bytes (one layer's C4 entry), and the slot tables.
    What the device KV budget pays for them (engine/hisparse_plan.py)."""
    slots = shape.rows * shape.size
    return (shape.num_layers * ((1 + slots) * entry_bytes + slots * TABLE_BYTES_PER_SLOT)
            + shape.rows * COUNTER_BYTES_PER_ROW)


@dataclass
class HiSparseStats:
    lookups: int = 0  # selected entries looked up in a buffer
    hits: int = 0  # of them, found there
    loaded: int = 0  # misses copied in from the mirror
    inserted: int = 0  # new and hand-off entries written into buffers
    handoffs: int = 0  # requests that started decoding with a hot buffer

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0


@dataclass
class Assignment:
    """Where each requested entry is in the buffer after an assign/insert."""

    slots: torch.Tensor  # [n, k] global buffer slots (0 = the null slot where the entry was -1)
    missed: torch.Tensor  # [n, k] bool: the caller copies these entries in from the mirror


class HotBuffers:
    """Which C4 entry each buffer slot holds, per CSA layer and buffer row, with an LRU clock."""

    def __init__(self, num_layers: int, max_requests: int, size: int, topk: int,
                 device: torch.device | str = "cpu") -> None:
        if size < topk:
            raise ValueError(f"hisparse hot_buffer_size {size} is smaller than the model's index_topk {topk}: "
                             "one step's selection must fit in the buffer")
        self.num_layers, self.max_requests, self.size, self.topk = num_layers, max_requests, size, topk
        # On the device of the hot buffers, where a fused swap-in kernel reads and updates them.
        self.entry = torch.full((num_layers, max_requests, size), NO_ENTRY, dtype=torch.long, device=device)
        self.last_use = torch.zeros((num_layers, max_requests, size), dtype=torch.long, device=device)
        self.clock = 0
        self.stats = HiSparseStats()
        self._rows: dict[str, int] = {}
        self._free = list(range(max_requests - 1, -1, -1))
        # Per-row [lookups, hits] of the current holder (tensor adds inside a layer, no Python
        # loop over requests), folded into per-request totals when the row is released; those
        # are kept across preemptions and dropped by forget() when the request is done.
        self._row_counts = torch.zeros(max_requests, 2, dtype=torch.long, device=device)
        self._per_request: dict[str, list[int]] = {}

    @classmethod
    def from_shape(cls, shape: HotBufferShape, device: torch.device | str) -> "HotBuffers":
        return cls(shape.num_layers, shape.rows, shape.size, shape.topk, device=device)

    def tables(self) -> list[torch.Tensor]:
        """The device tensors of the bookkeeping (slot map, LRU stamps, row counters)."""
        return [self.entry, self.last_use, self._row_counts]

    @property
    def num_slots(self) -> int:
        """Slots of one layer's buffer tensor: the null slot plus size per buffer row."""
        return 1 + self.max_requests * self.size

    @property
    def num_active(self) -> int:
        return len(self._rows)

    # -- rows ---------------------------------------------------------------------------------
    def row_of(self, request_id: str) -> int | None:
        return self._rows.get(request_id)

    def acquire(self, request_id: str) -> int:
        """A buffer row for a request that starts decoding (every slot empty)."""
        if not self._free:
            raise RuntimeError(f"no free hot-buffer row for {request_id!r}: more decoding requests than "
                               f"max_num_seqs={self.max_requests}")
        row = self._free.pop()
        self._rows[request_id] = row
        self._per_request.setdefault(request_id, [0, 0])
        self.stats.handoffs += 1
        return row

    def release(self, request_id: str) -> None:
        """The request left the device (finished, preempted, aborted): its row is emptied. Its
        counts are folded into its totals unless forget() already dropped them."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        self.entry[:, row].fill_(NO_ENTRY)
        self.last_use[:, row].zero_()
        total = self._per_request.get(request_id)
        if total is not None:
            lookups, hits = self._row_counts[row].tolist()
            total[0] += lookups
            total[1] += hits
        self._row_counts[row].zero_()
        self._free.append(row)

    def request_counts(self, request_id: str) -> tuple[int, int]:
        """(lookups, hits) of the request's selections so far."""
        lookups, hits = self._per_request.get(request_id, (0, 0))
        row = self._rows.get(request_id)
        if row is not None:
            now = self._row_counts[row].tolist()
            lookups, hits = lookups + now[0], hits + now[1]
        return lookups, hits

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._per_request)

    # -- assignment ---------------------------------------------------------------------------
    def assign(self, layer: int, rows: torch.Tensor, entries: torch.Tensor, insert: bool = False) -> Assignment:
        """Place entries [n, k] (NO_ENTRY = nothing) of buffer rows [n] (distinct) in layer's
        buffers: hits keep their slot, misses take LRU slots no entry of this call needs.
        Every placed slot becomes the most recently used. insert=True counts the misses as
        inserted (new / hand-off entries) instead of loaded (selection misses)."""
        n, k = entries.shape
        S = self.size
        if k > S:
            raise ValueError(f"{k} entries at once do not fit a hot buffer of {S}")
        if n == 0 or k == 0:
            return Assignment(torch.zeros(n, k, dtype=torch.long, device=entries.device),
                              torch.zeros(n, k, dtype=torch.bool, device=entries.device))
        rows = rows.to(self.entry.device)
        held = self.entry[layer, rows]  # [n, S]
        used = self.last_use[layer, rows]
        valid = entries != NO_ENTRY
        ordered, order = held.sort(dim=1)
        pos = torch.searchsorted(ordered, entries).clamp(max=S - 1)
        found = valid & (ordered.gather(1, pos) == entries)
        hit_slot = order.gather(1, pos)
        # Victims: empty slots first, then least recently used; slots holding a hit never.
        protected = torch.zeros(n, S + 1, dtype=torch.bool, device=held.device)
        protected.scatter_(1, torch.where(found, hit_slot, S), True)
        key = torch.where(held == NO_ENTRY, -1, used)
        key = key.masked_fill(protected[:, :S], torch.iinfo(torch.long).max)
        victims = key.argsort(dim=1, stable=True)
        missed = valid & ~found
        rank = (torch.cumsum(missed, dim=1) - 1).clamp(min=0)
        slot = torch.where(found, hit_slot, victims.gather(1, rank))
        clock = self.tick()
        write = torch.where(valid, slot, S)  # column S: a scratch column for the invalid ones
        held = torch.cat([held, held.new_full((n, 1), NO_ENTRY)], dim=1).scatter_(1, write, entries)
        used = torch.cat([used, used.new_zeros(n, 1)], dim=1).scatter_(1, write, clock)
        self.entry[layer, rows] = held[:, :S]
        self.last_use[layer, rows] = used[:, :S]
        self.account(rows, valid, found, insert)
        glob = torch.where(valid, 1 + rows[:, None] * S + slot, 0)
        return Assignment(glob, missed)

    def tick(self) -> int:
        """The LRU clock value of the next assignment (every slot it places is stamped with it).
        An executor that places entries itself (a fused swap-in kernel) takes it from here."""
        self.clock += 1
        return self.clock

    def account(self, rows: torch.Tensor, valid: torch.Tensor, found: torch.Tensor, insert: bool) -> None:
        """Count one assignment's lookups and hits (valid / found [n, k] for buffer rows [n])."""
        n_valid, n_found = int(valid.sum()), int(found.sum())
        if insert:
            self.stats.inserted += n_valid - n_found
        else:
            self.stats.lookups += n_valid
            self.stats.hits += n_found
            self.stats.loaded += n_valid - n_found
            self._row_counts.index_add_(0, rows, torch.stack([valid.sum(dim=1), found.sum(dim=1)], dim=1))

    def check_invariants(self) -> None:
        """No entry twice in one buffer row; free rows are empty."""
        for layer in range(self.num_layers):
            for row in self._free:
                assert bool((self.entry[layer, row] == NO_ENTRY).all()), f"free hot-buffer row {row} holds entries"
            for rid, row in self._rows.items():
                held = self.entry[layer, row]
                held = held[held != NO_ENTRY]
                assert held.unique().numel() == held.numel(), f"{rid}: an entry sits twice in layer {layer}'s buffer"
