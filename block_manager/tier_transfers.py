"""TierTransfers: the page copies between the device and host tiers that the KV cache manager
decided, for the model runner to execute ("the index decides, the KV manager executes": the
block manager owns no tensors, so it hands over a copy list).

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
