"""The block manager's hand-over to the executor: the KV cache's shape at start (KVCacheLayout)
and one plan per step (KVPlan). The model side reads these and nothing else of the block manager
(with space_spec.py): the index, the tiers and the manager decide; the runner executes.

A step's plan holds the block tables the step's sequences read, their row in them, and the page
copies between the device and host tiers (TierTransfers) decided since the last plan. Under
tensor parallelism it is what every rank receives and executes on its own KV shard.

TierTransfers: "the index decides, the KV manager executes": the block manager owns no tensors,
so it hands over a copy list.

Execution order is part of the contract: every device->host copy first, then every host->device
copy, and both before any layer of the next forward runs. That order is what makes page reuse
within one scheduling pass safe: a device page whose content was queued for the host and then
evicted and reused (by a load-back or by the forward's new K/V) is read before it is written;
a host page queued for a load-back is never the target of a device->host copy in the same batch
(only nodes without a device copy are host-evicted, and a node being loaded has one).

Keys are the destination pages, so a destination reused twice before a flush keeps only the
last copy (the earlier one's owner is gone), and every index of a batched scatter is unique.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.block_manager.space_spec import SpaceSpec


@dataclass
class TierTransfers:
    to_host: dict[str, dict[int, int]] = field(default_factory=dict)  # space -> {host page: device page}
    to_device: dict[str, dict[int, int]] = field(default_factory=dict)  # space -> {device page: host page}
    # Host pages to write to the storage tier once their device->host copy ran: space ->
    # {host page: store key}. Run after the copies (the bytes are read from the host page then).
    to_storage: dict[str, dict[int, str]] = field(default_factory=dict)

    def write(self, space: str, device_page: int, host_page: int) -> None:
        self.to_host.setdefault(space, {})[host_page] = device_page

    def load(self, space: str, host_page: int, device_page: int) -> None:
        self.to_device.setdefault(space, {})[device_page] = host_page

    def store(self, space: str, host_page: int, key: str) -> None:
        self.to_storage.setdefault(space, {})[host_page] = key

    def cancel_write(self, space: str, host_page: int) -> None:
        """The host page was freed before the flush: its pending copies are moot."""
        self.to_host.get(space, {}).pop(host_page, None)
        self.to_storage.get(space, {}).pop(host_page, None)

    @property
    def empty(self) -> bool:
        return not any(self.to_host.values()) and not any(self.to_device.values())

    def num_pages(self) -> tuple[int, int]:
        """(pages to the host, pages to the device)."""
        return sum(map(len, self.to_host.values())), sum(map(len, self.to_device.values()))


@dataclass(frozen=True)
class HotBufferShape:
    """HiSparse's hot buffers, as the executor allocates them on the device: per CSA layer
    (num_layers), `rows` buffer rows (one per running request) of `size` C4 entry slots, for
    selections of at most `topk` entries."""

    num_layers: int
    rows: int
    size: int
    topk: int


@dataclass(frozen=True)
class KVCacheLayout:
    """What the executor allocates the KV tensors from: the page size, every space's spec and
    physical page count (the null page included), the spaces whose pool lives in host memory
    (HiSparse's c4 mirror: charged to the host budget, read on the device through hot buffers),
    and the hot buffers' shape (None: HiSparse off)."""

    page_size: int
    specs: dict[str, SpaceSpec]
    num_physical_pages: dict[str, int]
    host_spaces: frozenset[str] = frozenset()
    hot_buffers: HotBufferShape | None = None

    def slots(self, space: str) -> int:
        """Slots of the space's physical pool (slot dimension of its tensors)."""
        return self.num_physical_pages[space] * self.specs[space].slots_per_page(self.page_size)

    @property
    def windows(self) -> dict[str, int | None]:
        return {name: spec.window for name, spec in self.specs.items()}


@dataclass
class KVPlan:
    """One step's KV cache plan: what the forward reads and what must move before it.

    block_tables: space -> [rows, width] int32, every running request's page ids (row r of the
    tensor is the request at row r); rows: the row of each of the step's sequences; copies: the
    device <-> host page copies to execute before the forward (TierTransfers' order)."""

    block_tables: dict[str, torch.Tensor]
    rows: dict[str, int]
    copies: TierTransfers = field(default_factory=TierTransfers)

    def step_tables(self, request_ids: list[str], num_pages: int) -> dict[str, torch.Tensor]:
        """Each space's table restricted to the rows of request_ids (in that order), at most
        num_pages wide: one numpy take per space."""
        rows = self.rows
        idx = np.fromiter([rows[r] for r in request_ids], np.int64, len(request_ids))
        return {name: torch.from_numpy(t.numpy()[:, : max(1, min(num_pages, t.shape[1]))].take(idx, axis=0))
                for name, t in self.block_tables.items()}
