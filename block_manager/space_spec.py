"""SpaceSpec: one physical form a token takes in the KV cache (DESIGN.md §3)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpaceSpec:
    """Declares a block space a model needs.

    name            "full" | "swa" | "c4" | "c128" | "indexer" | "state" (extensible)
    tokens_per_slot tokens folded into one slot (1 for raw KV, 4 for C4, ...)
    bytes_per_slot  bytes of one slot summed over every layer that uses this space
    window          None = the whole history is read again; N = only the last N tokens are
    """

    name: str
    tokens_per_slot: int = 1
    bytes_per_slot: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_slot < 1:
            raise ValueError(f"space {self.name!r}: tokens_per_slot must be >= 1")
        if self.window is not None and self.window < 1:
            raise ValueError(f"space {self.name!r}: window must be None or >= 1")

    def slots_per_page(self, page_size: int) -> int:
        if page_size % self.tokens_per_slot:
            raise ValueError(
                f"page size {page_size} is not a multiple of space {self.name!r}'s "
                f"tokens_per_slot {self.tokens_per_slot}; page boundaries must be compression boundaries"
            )
        return page_size // self.tokens_per_slot

    def pages_for(self, num_tokens: int, page_size: int) -> int:
        """Pages holding the slots of the first num_tokens tokens. A slot exists once all its
        tokens_per_slot tokens do, so compressed spaces lag raw ones (C4 page i is taken when
        token i*P + 3 arrives, not token i*P)."""
        return -(-(num_tokens // self.tokens_per_slot) // self.slots_per_page(page_size))

    def bytes_per_page(self, page_size: int) -> int:
        return self.slots_per_page(page_size) * self.bytes_per_slot

    @property
    def windowed(self) -> bool:
        return self.window is not None
