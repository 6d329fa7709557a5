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

import array
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from hybridkv.block_manager.space_spec import NULL_PAGE, window_start


@dataclass(frozen=True)
class TileSizes:
    """The chunk sizes that bound attention working memory (tests shrink them)."""

    kv_chunk: int = 1024  # keys per split-KV decode item / per prefill key chunk
    decode_tile_keys: int = 16384  # keys gathered at once for a tile of decode items
    prefill_q_tile: int = 256  # query rows per prefill tile
    # A run of consecutive key slots at least this long is read in place (a view of the cache);
    # shorter runs are gathered together (a matmul per short run would cost more than the copy).
    min_view_keys: int = 256


DEFAULT_TILES = TileSizes()
NULL_SLOT = NULL_PAGE  # slot 0 of the null page (NULL_PAGE * slots_per_page): zeros, never written
assert NULL_SLOT == 0, "decode tiles point invalid keys at the null page (page 0: slots below the page size)"


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
    # Build the torch path's decode tiles (per-key slots and masks). False when the backend reads
    # the block tables in place (the CPU paged kernel, Triton, xformers): the runner sets it from
    # the backend's needs_decode_tiles, so a step never pays for a plan nobody reads.
    decode_tiles: bool = True
    # How many leading sequences form the decode group; None: every leading one-query sequence.
    # The runner leaves a prompt's one-token chunk out of it (model_runner.decodes_first).
    decodes: int | None = None
    # Each sequence's prompt length (the runner's), or None: not known. A prefill chunk that reaches
    # past its prompt is recomputing generated tokens after a preemption (AttentionMetadata.regenerated).
    prompt_lens: list[int] | None = None

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

    @cached_property
    def num_decodes(self) -> int:
        """Leading sequences of the step's decode group: `decodes`, or else every leading
        one-query sequence."""
        if self.decodes is not None:
            if self.query_lens[: self.decodes].count(1) != self.decodes:
                raise ValueError(f"decodes={self.decodes}: the decode group's sequences must have one query each")
            return self.decodes
        q = self.query_lens
        n = q.count(1)  # C-speed passes: this runs every step over hundreds of sequences
        if q[:n].count(1) == n:
            return n
        n = 0
        for k in q:
            if k != 1:
                break
            n += 1
        return n

    # Per-step arrays every space's metadata reads, built once (int64; tensors share the memory).
    @cached_property
    def query_lens_array(self) -> np.ndarray:
        return int_array(self.query_lens)

    @cached_property
    def context_lens_array(self) -> np.ndarray:
        return int_array(self.context_lens)

    @cached_property
    def query_lens_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.query_lens_array)

    @cached_property
    def context_lens_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.context_lens_array)

    @cached_property
    def token_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(sequence index, position) of every token of the flat batch, in token order."""
        q, ctx = self.query_lens_array, self.context_lens_array
        if self.num_decodes == q.shape[0]:  # all decodes: one token per sequence
            return np.arange(q.shape[0]), ctx - 1
        seq = np.repeat(np.arange(q.shape[0]), q)
        first_row = np.cumsum(q) - q
        return seq, (ctx - q)[seq] + np.arange(seq.shape[0]) - first_row[seq]


def int_array(values: list[int]) -> np.ndarray:
    """int64 array of a list of Python ints, through a C array: several times cheaper than
    torch.tensor(list) for the hundreds of per-sequence values a step carries."""
    return np.frombuffer(array.array("q", values), dtype=np.int64) if values else np.zeros(0, dtype=np.int64)


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
    # [G, W] bool, True = do NOT attend (the form masked_fill_ takes, so no layer negates it);
    # None = every key is valid.
    masked: torch.Tensor | None


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
    # What is derived from this sequence alone and is the same in every layer of the step, built
    # by the first layer: key_blocks' cuts, and a backend's own (torch_native: its edge masks).
    # Keys are tuples tagged by their user.
    layer_memo: dict = field(default_factory=dict, repr=False)

    def key_blocks(self, k0: int, k1: int, chunk: int, min_view: int) -> list[tuple[int, int, int | None]]:
        """Keys [k0, k1) cut into blocks of at most `chunk` keys, as (first, one past the last,
        first slot when the block is one run of at least min_view keys -- read as a view -- else
        None -- gathered). Short runs are merged into gathered blocks."""
        memo_key = ("blocks", k0, k1, chunk, min_view)
        if memo_key in self.layer_memo:
            return self.layer_memo[memo_key]
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
        self.layer_memo[memo_key] = blocks
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
    # This step's host-tier load-backs (model_executor/kv_loads.py: PendingKVLoads), or None:
    # a backend calls kv_loads.wait(k_cache, v_cache) before it reads the cache.
    kv_loads: object | None = None
    # Prefill rows at generated positions (a request recomputed after a preemption), or None:
    # (row in the flat batch [n] int64, block-table row [n] int32, position [n] int32). The CPU
    # backend attends them as the decodes that first computed them did, so that a preemption
    # leaves a request's bits as they were (regenerated_rows).
    regenerated: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @cached_property
    def decode_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decodes as query groups of one row for the CPU paged kernel (cpu_kernels):
        group_start [nd + 1], block-table row [nd], position [nd], int32. Built once per step,
        on first use by any layer."""
        nd = self.num_decode_tokens
        rows = torch.arange(nd + 1, dtype=torch.int32)
        return rows, rows[:nd], (self.context_lens[:nd] - 1).to(torch.int32)

    @cached_property
    def prefill_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill chunks as query groups for the CPU prefill kernel (cpu_kernels), rows
        counted from the first prefill row (num_decode_tokens): group_start [P + 1], block-table
        row [P], position of every prefill row [num_tokens - num_decode_tokens], int32. Built once
        per step, on first use by any layer."""
        nd = self.num_decode_tokens
        starts = self.query_start_loc[nd:] - nd
        lens = starts[1:] - starts[:-1]
        first = self.context_lens[nd:] - lens  # position of each chunk's first query
        offsets = torch.arange(self.num_tokens - nd, dtype=torch.int32) - torch.repeat_interleave(starts[:-1], lens)
        positions = (torch.repeat_interleave(first, lens) + offsets).to(torch.int32)
        return starts.contiguous(), torch.arange(nd, nd + lens.numel(), dtype=torch.int32), positions

    def slot_mappings(self) -> dict[str, torch.Tensor]:
        """Space -> every slot this step writes (the runner's null-page debug check reads it)."""
        return {name: sm.slot_mapping for name, sm in self.spaces.items()}


def _decode_tiles(
    table: torch.Tensor, ctx: torch.Tensor, window: int | None, page_size: int, sizes: TileSizes
) -> tuple[list[DecodeTile], bool]:
    """Split-KV plan of the decode queries: page-aligned items of about sizes.kv_chunk keys,
    packed into tiles of at most sizes.decode_tile_keys keys.

    table [Bd, width], ctx [Bd] (the query sits at ctx - 1), both on the CPU. Items are whole
    pages, so a tile's slots are page bases + offsets (no per-key division); keys of a page
    outside [window_start, query] are masked and pointed at the null page.

    The plan works on arrays of one value per sequence or per page; it runs in numpy, whose
    calls cost about a microsecond against several for a torch op on tensors this small (this
    runs every step). Tensors share the arrays' memory (torch.from_numpy)."""
    P = page_size
    tab = table.numpy()
    pos = ctx.numpy().astype(np.int64) - 1
    kstart = window_start(pos, window)
    first_page = kstart // P
    n_pages = pos // P - first_page + 1  # pages each query reads, >= 1
    chunk_pages = max(1, sizes.kv_chunk // P)
    n_items = -(-n_pages // chunk_pages)
    split = bool((n_items > 1).any())
    seq, item_page, item_pages = np.arange(pos.shape[0]), first_page, n_pages
    if split:
        first_item = np.cumsum(n_items) - n_items
        seq = np.repeat(seq, n_items)
        j = np.arange(seq.shape[0]) - first_item[seq]
        item_page = first_page[seq] + j * chunk_pages
        item_pages = np.minimum(n_pages[seq] - j * chunk_pages, chunk_pages)
    longest = int(item_pages.max())
    tile_pages = max(1, sizes.decode_tile_keys // P)
    if seq.shape[0] * longest <= tile_pages:
        groups = [(0, seq.shape[0], longest)]  # the common case: one tile, in sequence order
    else:
        # Longest items first, so each tile's width (its first item) wastes little on padding.
        order = np.argsort(-item_pages, kind="stable")
        seq, item_page, item_pages = seq[order], item_page[order], item_pages[order]
        lens = item_pages.tolist()
        groups, i = [], 0
        while i < len(lens):
            g = max(1, tile_pages // lens[i])
            groups.append((i, min(len(lens), i + g), lens[i]))
            i += g
    # Slots and masks of every item at once (padded to the longest item, at most kv_chunk keys);
    # each tile is a slice of them: a few ops per step, whatever the number of tiles. Validity
    # is decided per page ([N, longest]: pages past the item read NULL_PAGE); only the two pages
    # of an item that a query can read in part (the one holding the query, the one holding the
    # window's start) are patched per key ([N, P]).
    n = seq.shape[0]
    col = np.arange(longest)
    if not split and window is None:  # every item is a whole sequence from its first page: its row
        page = tab.take(seq, axis=0)[:, :longest].astype(np.int32)
    else:
        # Flat indices: numpy's take is several times faster than a broadcast 2-D fancy index.
        flat = seq[:, None] * tab.shape[1] + np.minimum(item_page[:, None] + col, tab.shape[1] - 1)
        page = np.ascontiguousarray(tab).ravel().take(flat).astype(np.int32, copy=False)
    page[col >= item_pages[:, None]] = NULL_PAGE
    # The one per-key add runs in torch (numpy's broadcast over a short last axis is slower).
    slots_t = (torch.from_numpy(page) * P).unsqueeze(-1) + torch.arange(P, dtype=torch.int32)
    slots = slots_t.numpy()  # [N, longest, P], same memory
    offsets = np.arange(P)
    rows, spos = np.arange(n), pos[seq]
    # Keys after the query in its own page (only in the item that holds the query).
    holds_query = item_page + item_pages - 1 == spos // P
    _patch(slots, rows, item_pages - 1, (offsets > (spos % P)[:, None]) & holds_query[:, None])
    if window is not None:  # keys before the window's start in its first page
        sstart = kstart[seq]
        holds_start = item_page == sstart // P
        _patch(slots, rows, np.zeros_like(rows), (offsets < (sstart % P)[:, None]) & holds_start[:, None])
    slots = slots.reshape(n, -1)
    # Exactly the masked keys read the null page (a real page's slots are all >= P), so the
    # mask is one compare (numpy's is several times faster than torch's bool-output compare).
    masked = slots < P  # True = do not attend
    tiles = [
        DecodeTile(torch.from_numpy(seq[a:b]), torch.from_numpy(slots[a:b, : w * P]), torch.from_numpy(masked[a:b, : w * P]))
        for a, b, w in groups
    ]
    return tiles, split


def _patch(slots: np.ndarray, rows: np.ndarray, cols: np.ndarray, bad: np.ndarray) -> None:
    """Point the keys `bad` [N, P] of page column cols[i] of item i at the null slot."""
    pages = slots.reshape(-1, slots.shape[-1])  # [N * longest, P] view
    idx = rows * slots.shape[1] + cols
    block = pages[idx]  # [N, P] copy
    block[bad] = NULL_SLOT
    pages[idx] = block


def build_space_metadata(
    seqs: StepSequences, space: str, window: int | None, page_size: int, sizes: TileSizes = DEFAULT_TILES
) -> SpaceAttentionMetadata:
    table = seqs.block_tables[space]
    nd = seqs.num_decodes
    ctx = seqs.context_lens_tensor
    # Where each new token is written: one gather through the table (numpy: small arrays).
    seq_of_token, positions = seqs.token_rows
    tab = table.numpy()
    pages = tab[seq_of_token, np.minimum(positions // page_size, tab.shape[1] - 1)].astype(np.int64)
    slot_mapping = torch.from_numpy(pages * page_size + positions % page_size)  # index_copy_ wants int64
    sm = SpaceAttentionMetadata(slot_mapping, window, block_table=table)
    if nd and seqs.decode_tiles:
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


def regenerated_rows(seqs: StepSequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """AttentionMetadata.regenerated of a step: its prefill rows at positions at or past their
    prompt's length, or None when it has none (or the prompt lengths are not known). Only a
    request recomputed after a preemption has them, so this is a loop over the step's prefill
    chunks that almost always finds nothing."""
    if seqs.prompt_lens is None:
        return None
    rows: list[int] = []
    seq: list[int] = []
    pos: list[int] = []
    nd = seqs.num_decodes
    row = nd
    for i in range(nd, len(seqs.query_lens)):
        q, end = seqs.query_lens[i], seqs.context_lens[i]
        start = end - q
        first = max(start, seqs.prompt_lens[i])
        if end > first:
            rows.extend(range(row + first - start, row + q))
            seq.extend([i] * (end - first))
            pos.extend(range(first, end))
        row += q
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long), torch.tensor(seq, dtype=torch.int32),
            torch.tensor(pos, dtype=torch.int32))


def prefill_row_groups(meta: AttentionMetadata,
                       rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AttentionMetadata.prefill_groups for some of the prefill rows only: `rows` (rows of the
    batch, ascending, none of them a decode) as query groups of the CPU prefill kernel, for a
    q holding those rows alone. Rows that follow each other in one chunk stay one group; a
    sampled chunk's last row is a group of one. -> group_start [G + 1], block-table row [G],
    position of every row [len(rows)], int32."""
    starts, table_rows, positions = meta.prefill_groups
    r = rows.to(torch.long) - meta.num_decode_tokens
    chunk = torch.searchsorted(starts[1:].to(torch.long), r, right=True)  # the chunk each row lies in
    new_group = torch.ones(r.numel(), dtype=torch.bool)
    new_group[1:] = (r[1:] != r[:-1] + 1) | (chunk[1:] != chunk[:-1])
    first = new_group.nonzero().flatten()
    group_start = torch.cat([first, torch.tensor([r.numel()])]).to(torch.int32)
    return group_start, table_rows[chunk[first]], positions[r]


def build_attention_metadata(
    seqs: StepSequences, windows: dict[str, int | None], page_size: int, sizes: TileSizes = DEFAULT_TILES
) -> AttentionMetadata:
    q_start = np.zeros(len(seqs.query_lens) + 1, dtype=np.int32)
    np.cumsum(seqs.query_lens_array, out=q_start[1:])
    return AttentionMetadata(
        num_tokens=sum(seqs.query_lens),
        num_decode_tokens=seqs.num_decodes,
        spaces={name: build_space_metadata(seqs, name, w, page_size, sizes) for name, w in windows.items()},
        tiles=sizes,
        query_start_loc=torch.from_numpy(q_start),
        context_lens=torch.from_numpy(seqs.context_lens_array.astype(np.int32)),
        page_size=page_size,
        regenerated=regenerated_rows(seqs),
    )
