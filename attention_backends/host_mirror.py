"""Reads and writes of a KV pool that lives in host memory while the forward runs on a device.

HiSparse keeps the full C4 history (the c4 space's pool: the "mirror") in host memory, pinned
when the device is CUDA, and only hot buffers on the device. Every access to the mirror from the
forward goes through this module, so none of them indexes a host tensor with device indices or
copies across devices implicitly:

  gather_rows   rows of the mirror for the device: the indices go to the host, the rows are
                gathered there, and one transfer (`.to(device, non_blocking=True)`) moves them;
  keys_on       a prefill block's selected C4 keys: the distinct slots it reads, gathered the
                same way, with the key set re-pointed at the gathered copy;
  MirrorWrites  the step's new C4 entries, copied to the host once per CSA layer
                (non_blocking, into pinned memory) and scattered into the mirror once per step,
                or earlier when something reads the mirror in the same step.

On the CPU the mirror and the forward share one device: every function here is then the plain
in-place read or write (no copy), so outputs are bit-identical to a device-resident pool.
`crosses` is the one place that decides which path runs.
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridkv.attention_backends.hybrid_metadata import KeySet
from hybridkv.attention_backends.kv_cache_dtype import quantize_kv, store_rows


def crosses(pool: torch.Tensor, compute: torch.Tensor) -> bool:
    """Whether the pool lives on another device than the tensor the forward computes with."""
    return pool.device != compute.device


def gather_rows(pool: torch.Tensor, slots: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """pool[slots] on like's device and in like's dtype (as an FP8 like stores them: rows of a
    model-dtype pool are quantized as the KV writes quantize)."""
    if not crosses(pool, like):
        return quantize_kv(pool[slots], like.dtype)
    return quantize_kv(pool[slots.to(pool.device)], like.dtype).to(like.device, non_blocking=True)


def keys_on(pool: torch.Tensor, keys: KeySet, compute: torch.Tensor) -> tuple[torch.Tensor, KeySet]:
    """(cache, key set) for attention on compute's device over the columns of `keys` [n, k]
    (a per-query key set with an explicit mask, as KeySet.take gives): the pool itself when it is
    on that device, else a device copy of the distinct slots read (at most n x k rows, never the
    whole history) and the key set re-pointed at it. Same values in the same columns either way."""
    if not crosses(pool, compute):
        return pool, keys
    slots = keys.slots
    distinct, where = torch.unique(slots.to(pool.device), return_inverse=True)
    rows = pool[distinct].to(compute.device, non_blocking=True)
    return rows, KeySet(where.view(slots.shape).to(compute.device, non_blocking=True),
                        explicit_mask=keys.explicit_mask.to(compute.device, non_blocking=True))


class MirrorWrites:
    """One step's writes of new entries into a host-resident pool.

    A plain class, not a dataclass: the runner moves a step's dataclass metadata to the device,
    and the slots kept here must stay on the host, where the scatter runs. `slots` is the step's
    host tensor of the new entries' slots (CompressionPlan.out_slots of the mirrored space,
    before the metadata moved)."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied: torch.cuda.Event | None = None

    def write(self, pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
              write_in_place: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        """Store values [E, D] at slots [E] (the same slots as self.slots, on values' device) of
        the pool. On the pool's own device: write_in_place(pool, slots, values) at once (the
        backend's write). Across devices: the values start their copy to the host now, and the
        scatter (at self.slots) waits for flush()."""
        if not values.numel():
            return
        if not crosses(pool, values):
            write_in_place(pool, slots, values)
            return
        self._pending.append((pool, values.to(pool.device, non_blocking=True)))
        if values.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def flush(self) -> None:
        """Scatter every pending write into its pool (after their copies landed). Called before
        anything reads the pool in the same step and once at the end of the forward."""
        if not self._pending:
            return
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        for pool, values in self._pending:
            store_rows(pool, self.slots, values)
        self._pending.clear()
