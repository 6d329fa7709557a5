"""HostTier: what the shadow index needs to keep node shadows on the host (HiCache's L2).

It holds one HostPool per block space, the write policy, the copies decided but not yet
executed (TierTransfers, drained once per step by the engine), and counters. The tier logic
itself -- which node goes to the host, which host copy is dropped, what a match may load back --
lives in the index (index_host_tier.py, a part of ShadowIndex), because it is decided together with device eviction.

Write policies (SGLang's names):
  write_through            copy a page to the host when it enters the index
  write_through_selective  copy a node's pages once it has been hit twice (hot prefixes only)
  write_back               copy a page only when the device evicts it
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.block_manager.host_pool import HostPool
from hybridkv.block_manager.kv_plan import TierTransfers

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_MIN_HITS = 2


@dataclass
class HostTierStats:
    written_pages: dict[str, int] = field(default_factory=dict)  # device -> host copies decided
    loaded_pages: dict[str, int] = field(default_factory=dict)  # host -> device copies decided
    demoted_nodes: int = 0  # device copies dropped, host copy kept
    host_evicted_nodes: int = 0  # host-only nodes deleted to make host room
    host_copies_dropped: int = 0  # host copies of device-resident nodes dropped for room
    write_failures: int = 0  # a write found no host room (the page stays device-only)


class HostTier:
    def __init__(self, pools: dict[str, HostPool], write_policy: str = "write_through") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown hicache_write_policy {write_policy!r}; choose one of {list(WRITE_POLICIES)}")
        self.pools = pools
        self.write_policy = write_policy
        self.transfers = TierTransfers()
        self.stats = HostTierStats(
            written_pages={s: 0 for s in pools}, loaded_pages={s: 0 for s in pools},
        )
        # Host pages held outside the index (swapped-out partial pages), and pages to free once
        # the copies reading them were handed over (a load-back's source must not be reused first).
        self.held: dict[str, set[int]] = {s: set() for s in pools}
        self.storage_writes = False  # a storage tier (L3) below: every new host copy is also stored
        self._free_after_take: list[tuple[str, int]] = []

    def hold(self, space: str, page: int) -> None:
        self.held[space].add(page)

    def release(self, space: str, page: int, after_copies: bool = False) -> None:
        """Give back a held page: now (its pending write is moot), or once the pending copies
        are taken (it is the source of a load-back decided this step)."""
        if after_copies:
            self._free_after_take.append((space, page))
            return
        self.held[space].discard(page)
        self.transfers.cancel_write(space, page)
        self.pools[space].free(page)

    def take_transfers(self) -> TierTransfers:
        """The copies decided since the last call; the caller must execute them before the next
        forward (kv_plan.py states the order), before deciding anything new."""
        out, self.transfers = self.transfers, TierTransfers()
        for space, page in self._free_after_take:
            self.held[space].discard(page)
            self.pools[space].free(page)
        self._free_after_take = []
        return out

    def usage(self) -> dict[str, tuple[int, int]]:
        """space -> (host pages used, host pages)."""
        return {s: (p.num_used, p.num_pages) for s, p in self.pools.items()}
