"""IndexEvents: the shadow index's part that records KV cache events (kv_events.py).

Each node remembers on which tiers it was last published (ShadowNode.published, a bitmask);
`_note(node)` compares that with where the node's data is now and records a BlockStored or
BlockRemoved for each tier that changed. The index calls it wherever a node's device or host
presence can change (insert, heal, load-back, demotion, host write or free, deletion), so the
cost is one comparison per node the operation touches; with events off (`kv_events` None) it
returns at once.
"""
from __future__ import annotations

from hybridkv.block_manager.kv_events import HOST_MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, block_hash
from hybridkv.block_manager.shadow_node import ShadowNode

ON_DEVICE = 1
ON_HOST = 2


class IndexEvents:
    # Attributes the index itself defines (shadow_index.py).
    whole: list[str]
    page_size: int

    def _init_events(self, enabled: bool) -> None:
        """enabled: record events (the index then needs content keys: chain_seed is set)."""
        self.kv_events: list[KVCacheEvent] | None = [] if enabled else None

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def _held(self, node: ShadowNode, deleted: bool = False) -> int:
        if deleted or not self.whole:
            return 0
        ref = self.whole[0]
        return (ON_DEVICE if node.shadows[ref] is not None else 0) | (ON_HOST if node.host.get(ref) is not None else 0)

    def _note(self, node: ShadowNode, deleted: bool = False) -> None:
        """Record what changed in where node is held (deleted: it leaves the index)."""
        if self.kv_events is None:
            return
        now, before = self._held(node, deleted), node.published
        if now == before:
            return
        node.published = now
        h = block_hash(node.chain)
        for bit, medium in ((ON_DEVICE, None), (ON_HOST, HOST_MEDIUM)):
            if now & bit and not before & bit:
                parent = node.parent
                self.kv_events.append(BlockStored([h], None if parent.is_root else block_hash(parent.chain),
                                                  list(node.key), self.page_size, None, medium))
            elif before & bit and not now & bit:
                self.kv_events.append(BlockRemoved([h], medium))

    def _note_cleared(self) -> None:
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
