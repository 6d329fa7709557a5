"""SpaceSpec: one physical form a token takes in the KV cache (docs/architecture.md, "Block spaces")."""
from __future__ import annotations

from dataclasses import dataclass

# Page 0 of every block space is reserved: never allocated, never written, all zeros. A request's
# block table holds it for pages it never had or already released (out of its window), so a
# padded or stale read yields zeros instead of another request's KV, and a write to it is a bug
# that the runner's debug check (HYBRIDKV_DEBUG_CHECKS=1) catches.
NULL_PAGE = 0


def window_start(pos, window: int | None, align: int = 1):
    """The window rule, in one place: the query at position `pos` reads keys [window_start, pos].

    align = 1: the last `window` positions. align = a > 1 (a compressor closing a window every a
    tokens): the current a-token block and the window - a positions before it, so the start
    moves a tokens at a time and sits up to a - 1 positions later than align 1's.
    Works on ints, integer tensors and numpy arrays. window None = the whole history is read."""
    if window is None:
        return pos * 0 if not isinstance(pos, int) else 0
    start = pos - window + 1 if align == 1 else (pos // align) * align - (window - align)
    return max(0, start) if isinstance(start, int) else start.clip(min=0)


@dataclass(frozen=True)
class SpaceSpec:
    """Declares a block space a model needs.

    name            "full" | "swa" | "c4" | "c128" | "indexer" | "state_c4" | "state_c128" (extensible)
    tokens_per_slot tokens folded into one slot (1 for raw KV, 4 for C4, ...)
    bytes_per_slot  bytes of one slot summed over every layer that uses this space
    window          None = the whole history is read again; N = only the last N tokens are
    ring            None = a page has a slot per tokens_per_slot of its P tokens; N = a page is
                    a ring of N slots: token t writes slot (t % P) % N of its page, so the page keeps
                    only the last N tokens it saw. For a windowed space whose reads go at most
                    N tokens back (a compressor's pending rows: 8 for C4, 128 for C128), this
                    keeps the page at N slots instead of P -- the page still stands for the same
                    P tokens, so block tables, window release and the shadow index are unchanged.
    align           1 = the window slides a token at a time; a = it moves in whole a-token blocks
                    (window_start): a compressor pooling every a tokens reads only back to the
                    start of the open block (minus its overlap), so it releases pages sooner and
                    a block-aligned window needs no straddle page (C128 at P=128: 1 page, not 3).
    """

    name: str
    tokens_per_slot: int = 1
    bytes_per_slot: int = 0
    window: int | None = None
    ring: int | None = None
    align: int = 1

    def __post_init__(self) -> None:
        if self.tokens_per_slot < 1:
            raise ValueError(f"space {self.name!r}: tokens_per_slot must be >= 1")
        if self.window is not None and self.window < 1:
            raise ValueError(f"space {self.name!r}: window must be None or >= 1")
        if self.ring is not None:
            # A ring overwrites a token's slot N tokens later: only a windowed raw space whose
            # reads never go further back than N may use one.
            if self.window is None or self.tokens_per_slot != 1 or not 1 <= self.window <= self.ring:
                raise ValueError(f"space {self.name!r}: a ring of {self.ring} slots needs a raw windowed space "
                                 f"with window <= ring (tokens_per_slot {self.tokens_per_slot}, window {self.window})")
        if self.align != 1 and (self.window is None or not 1 <= self.align <= self.window):
            raise ValueError(f"space {self.name!r}: align {self.align} needs a windowed space with 1 <= align <= "
                             f"window (window {self.window})")

    def entries_per_page(self, page_size: int) -> int:
        """Logical entries (tokens_per_slot tokens each) one page stands for."""
        if page_size % self.tokens_per_slot:
            raise ValueError(
                f"page size {page_size} is not a multiple of space {self.name!r}'s "
                f"tokens_per_slot {self.tokens_per_slot}; page boundaries must be compression boundaries"
            )
        return page_size // self.tokens_per_slot

    def slots_per_page(self, page_size: int) -> int:
        """Physical slots of one page (what pools, page copies and bytes are sized by)."""
        entries = self.entries_per_page(page_size)
        return entries if self.ring is None else min(self.ring, entries)

    def pages_for(self, num_tokens: int, page_size: int) -> int:
        """Pages holding the slots of the first num_tokens tokens. A slot exists once all its
        tokens_per_slot tokens do, so compressed spaces lag raw ones (C4 page i is taken when
        token i*P + 3 arrives, not token i*P)."""
        return -(-(num_tokens // self.tokens_per_slot) // self.entries_per_page(page_size))

    def bytes_per_page(self, page_size: int) -> int:
        return self.slots_per_page(page_size) * self.bytes_per_slot

    def first_kept_page(self, num_computed: int, page_size: int) -> int:
        """First page a request that computed num_computed tokens still reads in this space (the
        next query sits at position num_computed). 0 for whole-history spaces."""
        return window_start(num_computed, self.window, self.align) // page_size

    def release_at(self, num_released: int, page_size: int) -> int:
        """The smallest num_computed at which first_kept_page passes page num_released (the
        request's next windowed page to release). Whole-history spaces: never (a huge count)."""
        if self.window is None:
            return 1 << 62
        a, first = self.align, (num_released + 1) * page_size  # the window must start at or after `first`
        return -(-(first + self.window - a) // a) * a

    def pages_read_at_page_end(self, page_size: int) -> int:
        """Most pages of this space a request resuming at a page boundary reads (what a prefix hit
        needs of it). 0 for a block-aligned window that every page end closes (HCA's state at a
        page size that is a multiple of its ratio): no hit ever reads such a page."""
        if self.window is None:
            return 1 << 62
        d0 = self.window // page_size + 2  # past the start, where the count is periodic
        return max(d - self.first_kept_page(d * page_size, page_size) for d in range(d0, d0 + self.align))

    def max_live_pages(self, chunk_tokens: int, page_size: int) -> int | None:
        """Most pages of this windowed space one request holds at once while it computes chunks of
        chunk_tokens: the window before the chunk (at most window - 1 tokens) plus the chunk, and
        one more page where the window's start can fall inside a page. chunk_tokens=1 is a
        decoding request. None for whole-history spaces (no bound)."""
        if self.window is None:
            return None
        a = self.align
        page_aligned = a > 1 and a % page_size == 0 and (self.window - a) % page_size == 0
        return -(-(self.window - 1 + chunk_tokens) // page_size) + (0 if page_aligned else 1)

    @property
    def windowed(self) -> bool:
        return self.window is not None
