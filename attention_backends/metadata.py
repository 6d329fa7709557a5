"""Per-step attention metadata over paged block spaces (dense models: "full" / "swa" spaces).

Built once per step by the model runner from the block tables (tensor ops only) and shared by
every layer that reads the same space, so per-layer work is only: write the new K/V into their
slots, gather the keys of one tile, run attention on it.

Token order in a step: sequences with one query token (decodes, or 1-token prefill chunks)
first, then multi-token prefill chunks.

Bounded memory: apart from the step's block-table rows (one int per page), no tensor here or in
the backend is sized batch x longest context.
  * Decode keys are cut into *items* of at most TileSizes.kv_chunk keys (split-KV); items
    are packed into tiles of at most TileSizes.decode_tile_keys gathered keys. A sequence split
    over several items is merged by the backend with a log-sum-exp (online softmax) merge.
  * A prefill chunk is cut into query tiles of TileSizes.prefill_q_tile rows; each reads only
    its own key range, in chunks of TileSizes.kv_chunk keys, with a mask built per tile.
  * Key slots (4 bytes per key read) are the only per-key metadata; every padded or invalid
    key slot points at the reserved null page, which is all zeros, so a masked read never
    touches uninitialised pool memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.block_manager.space_spec import NULL_PAGE, window_start


@dataclass(frozen=True)
class TileSizes:
    """The chunk sizes that bound attention working memory (tests shrink them)."""

    kv_chunk: int = 1024  # keys per split-KV decode item / per prefill key chunk
    decode_tile_keys: int = 16384  # keys gathered at once for a tile of decode items
    prefill_q_tile: int = 256  # query rows per prefill tile
    # A prefill tile whose keys number at most this runs as one SDPA call with a mask for that
    # tile (the fast path after a prefix hit); a longer one walks its keys in kv_chunk chunks.
    prefill_single_shot_keys: int = 4096
    # A run of consecutive key slots at least this long is read in place (a view of the cache);
    # shorter runs are gathered together (a matmul per short run would cost more than the copy).
    min_view_keys: int = 256


DEFAULT_TILES = TileSizes()
NULL_SLOT = NULL_PAGE  # slot 0 of the null page (NULL_PAGE * slots_per_page): zeros, never written
assert NULL_SLOT == 0, "decode tiles point invalid keys at the null page by multiplying with the mask"


@dataclass
class StepSequences:
    """Host-side description of the sequences in one step (order = token order).

    block_tables: space -> [B, width] int32 (or int64) page ids, row i = sequence i's block-table
    row (the runner selects them with one index_select per space); entries a sequence does not
    hold are NULL_PAGE."""

    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache after this step = start + query_len
    block_tables: dict[str, torch.Tensor]
    request_ids: list[str] | None = None  # in the same order (models that keep per-request state)

    @classmethod
    def from_page_lists(
        cls, query_lens: list[int], context_lens: list[int], page_tables: dict[str, list[list[int]]]
    ) -> "StepSequences":
        """For tests and tools that hold Python page lists: pad them into block tables."""
        tables = {}
        for name, rows in page_tables.items():
            width = max(1, max((len(r) for r in rows), default=1))
            tables[name] = torch.tensor([r + [NULL_PAGE] * (width - len(r)) for r in rows], dtype=torch.int32)
        return cls(list(query_lens), list(context_lens), tables)

    @property
    def num_decodes(self) -> int:
        n = 0
        for q in self.query_lens:
            if q != 1:
                break
            n += 1
        return n


def token_slots(
    table: torch.Tensor, pos: torch.Tensor, page_size: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Cache slot of each token position through a block table.

    table [pages] with pos of any shape, or table [B, pages] with rows (same shape as pos, or
    broadcastable to it) naming the table row of each position. Positions past the table's
    width read its last entry; callers mask them (and point them at NULL_SLOT when they may be
    unwritten)."""
    idx = (pos // page_size).clamp(max=table.shape[-1] - 1)
    page = table[idx] if rows is None else table[rows, idx]
    return page * page_size + pos % page_size


@dataclass
class DecodeTile:
    """A group of decode items gathered and attended together."""

    seq: torch.Tensor  # [G] decode index (query row) of each item
    slots: torch.Tensor  # [G, W] int32 key slots; NULL_SLOT where masked
    mask: torch.Tensor | None  # [G, W] bool (True = attend); None = every key is valid


@dataclass
class PrefillSeq:
    query_start: int  # first row of this sequence in the step's flat token batch
    query_end: int
    start: int  # position of the first query (tokens already in the cache)
    key_start: int  # position of key_slots[0]: window_start(start, window)
    key_slots: torch.Tensor | None  # [end - key_start] cache slots in position order; None = own K/V
    # Maximal runs of consecutive slots in key_slots, as (first key index, one past the last,
    # slot of the first): a run is read in place (a view of the cache), never gathered. Pages
    # come off a FIFO free list, so a prompt's pages are mostly consecutive.
    key_runs: list[tuple[int, int, int]] = field(default_factory=list)
    _blocks: dict = field(default_factory=dict, repr=False)  # key_blocks memo: same for every layer

    def key_blocks(self, k0: int, k1: int, chunk: int, min_view: int) -> list[tuple[int, int, int | None]]:
        """Keys [k0, k1) cut into blocks of at most `chunk` keys, as (first, one past the last,
        first slot when the block is one run of at least min_view keys -- read as a view -- else
        None -- gathered). Short runs are merged into gathered blocks."""
        memo_key = (k0, k1, chunk, min_view)
        if memo_key in self._blocks:
            return self._blocks[memo_key]
        blocks: list[tuple[int, int, int | None]] = []
        pending = None  # first key of keys waiting to be gathered

        def flush(end: int) -> None:
            for c in range(pending, end, chunk):
                blocks.append((c, min(end, c + chunk), None))

        for lo, hi, slot in self.key_runs:
            a, b = max(lo, k0), min(hi, k1)
            if a >= b:
                continue
            if b - a < min_view:
                pending = a if pending is None else pending
                continue
            if pending is not None:
                flush(a)
                pending = None
            for c in range(a, b, chunk):
                blocks.append((c, min(b, c + chunk), slot + c - lo))
        if pending is not None:
            flush(k1)
        self._blocks[memo_key] = blocks
        return blocks

    @property
    def own_kv(self) -> bool:
        """Starts at position 0 and its window does not bite: it reads exactly its own new K/V,
        plain causal (the SDPA is_causal fast path)."""
        return self.key_slots is None


@dataclass
class SpaceAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    window: int | None
    decode_tiles: list[DecodeTile] = field(default_factory=list)
    # True when some decode sequence spans several items: the backend merges partial results.
    decode_split: bool = False
    prefills: list[PrefillSeq] = field(default_factory=list)
    # [B, width] page ids of the step's sequences (StepSequences.block_tables[space]): the kernel
    # backends (Triton) walk pages through it instead of reading the per-key slots above.
    block_table: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_decode_tokens: int
    spaces: dict[str, SpaceAttentionMetadata]
    tiles: TileSizes = DEFAULT_TILES
    # What kernel backends index the block tables with (one entry per sequence, token order):
    # query_start_loc [B + 1] int32 (row of each sequence's first query in the flat batch, then
    # num_tokens), context_lens [B] int32 (tokens in the cache after this step), and the page size.
    query_start_loc: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    page_size: int = 0

    def slot_mappings(self) -> dict[str, torch.Tensor]:
        """Space -> every slot this step writes (the runner's null-page debug check reads it)."""
        return {name: sm.slot_mapping for name, sm in self.spaces.items()}


def _decode_tiles(
    table: torch.Tensor, ctx: torch.Tensor, window: int | None, page_size: int, sizes: TileSizes
) -> tuple[list[DecodeTile], bool]:
    """Split-KV plan of the decode queries: page-aligned items of about sizes.kv_chunk keys,
    packed into tiles of at most sizes.decode_tile_keys keys.

    table [Bd, width], ctx [Bd] (the query sits at ctx - 1). Items are whole pages, so a
    tile's slots are page bases + offsets (no per-key division); keys of a page outside
    [window_start, query] are masked and pointed at the null page."""
    P = page_size
    ctx = ctx.to(torch.int32)  # int32 throughout: half the bytes of the per-key temporaries
    pos = ctx - 1
    kstart = window_start(pos, window)
    first_page = kstart // P
    n_pages = pos // P - first_page + 1  # pages each query reads, >= 1
    chunk_pages = max(1, sizes.kv_chunk // P)
    n_items = (n_pages + chunk_pages - 1) // chunk_pages
    split = bool((n_items > 1).any())
    seq, item_page, item_pages = torch.arange(ctx.shape[0]), first_page, n_pages
    if split:
        first_item = torch.cumsum(n_items, 0) - n_items
        seq = torch.repeat_interleave(seq, n_items)
        j = (torch.arange(seq.shape[0]) - first_item[seq]).to(torch.int32)
        item_page = first_page[seq] + j * chunk_pages
        item_pages = (n_pages[seq] - j * chunk_pages).clamp(max=chunk_pages)
    longest = int(item_pages.max())
    tile_pages = max(1, sizes.decode_tile_keys // P)
    if seq.shape[0] * longest <= tile_pages:
        groups = [(0, seq.shape[0], longest)]  # the common case: one tile, in sequence order
    else:
        # Longest items first, so each tile's width (its first item) wastes little on padding.
        order = torch.argsort(item_pages, descending=True, stable=True)
        seq, item_page, item_pages = seq[order], item_page[order], item_pages[order]
        lens = item_pages.tolist()
        groups, i = [], 0
        while i < len(lens):
            g = max(1, tile_pages // lens[i])
            groups.append((i, min(len(lens), i + g), lens[i]))
            i += g
    # Slots and masks of every item at once (padded to the longest item, at most kv_chunk keys);
    # each tile is a slice of them: a few tensor ops per step, whatever the number of tiles.
    n = seq.shape[0]
    pidx = item_page[:, None] + torch.arange(longest, dtype=torch.int32)[None, :]  # [N, longest]
    page = table[seq[:, None], pidx.clamp(max=table.shape[1] - 1)].to(torch.int32)
    # Validity from each item's own offsets: one broadcast compare per bound (positions are
    # never materialised), and none for the lower bound without a window.
    rel = torch.arange(longest * P, dtype=torch.int32)[None, :]  # key offset inside the item
    base = item_page * P  # position of each item's first key
    valid = rel <= (pos[seq] - base)[:, None]
    if window is not None:
        valid &= rel >= (kstart[seq] - base)[:, None]
    offsets = torch.arange(P, dtype=torch.int32)
    slots = ((page * P).unsqueeze(-1) + offsets).view(n, -1)  # [N, longest * P]
    slots = torch.where(valid, slots, NULL_SLOT)  # every invalid key reads the null page
    tiles = [DecodeTile(seq[a:b], slots[a:b, : w * P], valid[a:b, : w * P]) for a, b, w in groups]
    return tiles, split


def build_space_metadata(
    seqs: StepSequences, space: str, window: int | None, page_size: int, sizes: TileSizes = DEFAULT_TILES
) -> SpaceAttentionMetadata:
    table = seqs.block_tables[space]
    nd = seqs.num_decodes
    q_lens = torch.tensor(seqs.query_lens)
    ctx = torch.tensor(seqs.context_lens)
    # Where each new token is written: position of every token of the flat batch, one gather.
    num_seqs = len(seqs.query_lens)
    seq_of_token = torch.arange(num_seqs) if nd == num_seqs else torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    first_row = torch.cumsum(q_lens, 0) - q_lens
    positions = (ctx - q_lens)[seq_of_token] + torch.arange(seq_of_token.shape[0]) - first_row[seq_of_token]
    slot_mapping = token_slots(table, positions, page_size, rows=seq_of_token).long()  # index_copy_ wants int64
    sm = SpaceAttentionMetadata(slot_mapping, window, block_table=table)
    if nd:
        sm.decode_tiles, sm.decode_split = _decode_tiles(table[:nd], ctx[:nd], window, page_size, sizes)
    row = nd
    for i in range(nd, len(seqs.query_lens)):
        q, c = seqs.query_lens[i], seqs.context_lens[i]
        s = c - q
        kstart = window_start(s, window)
        if s == 0 and (window is None or c <= window):
            slots = None
        else:
            slots = token_slots(table[i], torch.arange(kstart, c), page_size)
        sm.prefills.append(PrefillSeq(row, row + q, s, kstart, slots, _slot_runs(slots)))
        row += q
    return sm


def _slot_runs(slots: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: one tensor pass, then a list as long as the runs."""
    if slots is None or slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, slots.numel()]
    firsts = slots[edges[:-1]].tolist()
    return [(a, b, f) for a, b, f in zip(edges, edges[1:], firsts)]


def build_attention_metadata(
    seqs: StepSequences, windows: dict[str, int | None], page_size: int, sizes: TileSizes = DEFAULT_TILES
) -> AttentionMetadata:
    q_lens = torch.tensor(seqs.query_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=sum(seqs.query_lens),
        num_decode_tokens=seqs.num_decodes,
        spaces={name: build_space_metadata(seqs, name, w, page_size, sizes) for name, w in windows.items()},
        tiles=sizes,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(q_lens, 0, dtype=torch.int32)]),
        context_lens=torch.tensor(seqs.context_lens, dtype=torch.int32),
        page_size=page_size,
    )
