"""The host tier's pages of a whole tensor-parallel group, as the storage tier sees them.

The storage tier (block_manager/storage_tier.py) runs on the driver and reads and fills host
pages through the HostPages protocol. Under tensor parallelism each rank holds its own shard of
every page in its own host buffers, so one stored value holds the page of every rank, rank after
rank: reading a page gathers each rank's bytes to the driver, filling one scatters them back.
One value per page for the group (rather than one per rank) keeps a storage hit all-or-nothing:
a page is there for every rank or for none, so the ranks never disagree on what a prefix hit
covers. The KV fingerprint carries the group's size, so a group of another size never reads it.

Both calls run on the engine thread between steps (the storage tier's store() after a step's
copies, its prefetch records at poll/admission), where the workers wait for the driver's next
message: the request and its gather or scatter pair up with the workers' side in
engine/tp_worker.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from hybridkv.engine.tp_worker import ReadHostPages, WriteHostPages
from hybridkv.model_executor.host_kv_cache import HostKVCache

if TYPE_CHECKING:
    from hybridkv.engine.tp_executor import WorkerGroup


class GroupHostPages:
    """HostPages over every rank's host buffers (rank 0's are the driver's own)."""

    def __init__(self, workers: "WorkerGroup", driver_pages: HostKVCache) -> None:
        self.workers = workers
        self.driver_pages = driver_pages
        self.size = workers.size
        # Every rank's shard of a page has the same bytes (heads split evenly, or replicated).
        self.rank_bytes = dict(driver_pages.bytes_per_page)
        self.bytes_per_page = {name: n * self.size for name, n in self.rank_bytes.items()}

    def read_pages(self, space: str, pages: list[int]) -> list[bytes]:
        if not pages:
            return []
        self.workers.broadcast(ReadHostPages(space, pages))
        gathered: list = [None] * self.size
        with self.workers.watch():
            dist.gather_object(self.driver_pages.read_pages(space, pages), gathered, dst=0)
        expected = self.rank_bytes[space]
        for rank, payloads in enumerate(gathered):
            if len(payloads) != len(pages) or any(len(p) != expected for p in payloads):
                raise RuntimeError(f"tensor-parallel rank {rank} returned host pages of another size than "
                                   f"rank 0's ({expected} bytes per page of space {space!r})")
        return [b"".join(parts) for parts in zip(*gathered)]

    def write_pages(self, space: str, pages: list[int], payloads: list[bytes]) -> None:
        if not pages:
            return
        n = self.rank_bytes[space]
        for p in payloads:
            if len(p) != n * self.size:
                raise ValueError(f"a stored page of space {space!r} has {len(p)} bytes, a {self.size}-rank "
                                 f"group's page has {n * self.size}")
        per_rank = [[p[r * n:(r + 1) * n] for p in payloads] for r in range(self.size)]
        self.workers.broadcast(WriteHostPages(space, pages))
        mine: list = [None]
        with self.workers.watch():
            dist.scatter_object_list(mine, per_rank, src=0)
        self.driver_pages.write_pages(space, pages, mine[0])
