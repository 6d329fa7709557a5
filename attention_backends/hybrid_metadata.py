"""Per-step metadata for hybrid (DeepSeek-V4-style) attention over its paged spaces.

Spaces (names fixed by the model's SpaceSpecs):
  swa         one slot per token, windowed: K(=V) of every layer's sliding branch
  state_c4    windowed ring of 2*csa_ratio rows per page: raw CSA rows (C, Z) (main and
              indexer compressors) a window still needs to close
  state_c128  windowed ring of hca_ratio rows per page: the same for the HCA compressors
  c4          one slot per csa_ratio tokens: CSA compressed entries
  indexer     one slot per csa_ratio tokens: lightning-indexer keys (same entry index as c4)
  c128        one slot per hca_ratio tokens: HCA compressed entries
Page i of every space covers tokens [i*P, (i+1)*P); a space with r tokens per slot holds
P/r slots per page, so entry w lives in page w // (P/r), slot w % (P/r). A state page is a
ring of N = rows-per-window slots (token t at slot t % P % N of its page): a window closing
reads at most N rows back, so only the pages' last N rows are ever read again. Rows of tokens
new this step come from the step's own projections, not the ring (a long chunk laps it), and
only the rows a later step may read are written: each sequence's and each page's last N.

Built once per step (host side, vectorised) from the step's block-table rows
(StepSequences.block_tables, NULL_PAGE = 0 where a sequence holds no page), shared by every
layer. Every padded or masked read points at slot 0 of the null page (zeros, never written),
so the pools can be allocated uninitialised:
  * slot mappings where the new tokens' SWA keys are written,
  * compression plans: which new rows each state ring keeps (and where), and for every window
    that closes inside this step (token (w+1)m-1 is new), where each row it pools comes from
    (this step's rows or the ring) and the slots its entry is written to,
  * query blocks: groups of queries with the SWA keys and the causal compressed entries
    each may read. Decode queries are batched in padded blocks (per-query key lists);
    prefill chunks are split into row blocks sharing one key list, so memory stays bounded
    for long chunks. Compressed entries carry a per-query visible count (a causal prefix),
    never a [rows, entries] mask: the backend scores them in key blocks and builds only the
    mask of the key block at hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.attention_backends.metadata import NULL_SLOT, StepSequences
from hybridkv.block_manager.space_spec import NULL_PAGE, window_start

PREFILL_BLOCK_ROWS = 256  # queries per prefill block (bounds the [rows, keys] score tensors)
DECODE_BLOCK_SEQS = 64  # decode sequences per padded block

SWA, C4, INDEXER, C128 = "swa", "c4", "indexer", "c128"
STATE_C4, STATE_C128 = "state_c4", "state_c128"


def compressor_kinds(csa_ratio: int | None, hca_ratio: int | None) -> dict[str, tuple[int, bool, str]]:
    """Plan kind -> (ratio, overlap, state space) for the compressors a model has: the one place
    the model's state spaces and the metadata agree on. A window pools 2m rows (CSA, overlapping)
    or m (HCA), which is both the state space's window and its ring."""
    out = {}
    if csa_ratio:
        out["csa"] = (csa_ratio, True, STATE_C4)
    if hca_ratio:
        out["hca"] = (hca_ratio, False, STATE_C128)
    return out


@dataclass(frozen=True)
class HybridLayout:
    page_size: int
    window: int  # sliding window (keys [pos - window + 1, pos])
    csa_ratio: int | None  # None when the model has no CSA layer
    hca_ratio: int | None  # None when the model has no HCA layer
    # State space -> its ring (SpaceSpec.ring) where it is wider than one window's rows:
    # speculative decoding keeps the rows its rejected drafts may overwrite (draft_space_specs).
    state_rings: dict[str, int] | None = None

    def compressed_spaces(self) -> dict[str, int]:
        """Compressed space -> tokens per slot."""
        out = {}
        if self.csa_ratio:
            out[C4] = self.csa_ratio
            out[INDEXER] = self.csa_ratio
        if self.hca_ratio:
            out[C128] = self.hca_ratio
        return out

    def compressors(self) -> dict[str, tuple[int, bool, str]]:
        return compressor_kinds(self.csa_ratio, self.hca_ratio)


def _is_run(slots: torch.Tensor) -> bool:
    """Whether a 1-D slot list is one run of consecutive slots (checked on its ends first)."""
    L = slots.numel()
    if L < 2 or int(slots[-1]) - int(slots[0]) != L - 1:
        return L == 1
    return bool((slots[1:] - slots[:-1] == 1).all())


class KeySet:
    """Keys a block of n queries may read: slots [L] (shared) or [n, L] (per query).

    Which of them each query may read is either an explicit mask [n, L] (the sliding window) or,
    for compressed entries, a causal prefix: query i reads columns [0, visible[i]). The prefix
    form is what keeps a long prefill's metadata O(rows) per block instead of O(rows x entries)
    (a 4096-token chunk at 128k context would otherwise hold ~256 MB of entry masks); masks are
    built only for the column range a consumer is working on (`column_mask`).

    Decode entry lists come in page form instead: `pages` [n, pages] are the block-table rows
    and column w lives in slot pages[w // spp] * spp + w % spp. Building the per-column slot list
    costs O(entries) per step (32k entries per CSA layer at 128k context); the page form costs
    O(pages), and consumers that need slots ask for the few columns they read (`slots_of`), or
    read keys page by page (`read_unmasked`). `slots` is still available (built on first use).
    """

    def __init__(self, slots: torch.Tensor | None = None, explicit_mask: torch.Tensor | None = None,
                 visible: torch.Tensor | None = None, *, pages: torch.Tensor | None = None,
                 slots_per_page: int = 0, length: int = 0) -> None:
        if (explicit_mask is None) == (visible is None):
            raise ValueError("a KeySet takes exactly one of explicit_mask and visible")
        if (slots is None) == (pages is None):
            raise ValueError("a KeySet takes exactly one of slots and pages")
        if pages is not None and (visible is None or pages.dim() != 2 or slots_per_page < 1):
            raise ValueError("page form needs per-query page rows [n, pages], slots_per_page and visible counts")
        self._slots = slots
        self.explicit_mask = explicit_mask
        self.visible = visible
        self.pages = pages
        self.slots_per_page = slots_per_page
        self._length = slots.shape[-1] if slots is not None else length

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeySet":
        """The same key set with every tensor on `device` (metadata is built on the host)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        if self.pages is not None:
            return KeySet(None, move(self.explicit_mask), move(self.visible), pages=move(self.pages),
                          slots_per_page=self.slots_per_page, length=self._length)
        return KeySet(move(self._slots), move(self.explicit_mask), move(self.visible))

    @property
    def slots(self) -> torch.Tensor:
        """[L] or [n, L] slot of every column; columns a query may not read are the null slot."""
        if self._slots is None:
            columns = torch.arange(self._length, device=self.pages.device)
            self._slots = self.slots_of(columns.expand(self.pages.shape[0], self._length))
        return self._slots

    def slots_of(self, idx: torch.Tensor) -> torch.Tensor:
        """Slots [n, k] of the columns idx [n, k]; columns a query may not read give the null slot."""
        if self.pages is None:
            return self._slots[idx] if self.shared else self._slots.gather(1, idx)
        spp = self.slots_per_page
        page = self.pages.gather(1, (idx // spp).clamp(max=self.pages.shape[1] - 1))
        return torch.where(idx < self.visible[:, None], page * spp + idx % spp, NULL_SLOT)

    def read_unmasked(self, cache: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Keys [Lb, D] (shared) or [n, Lb, D] of columns [lo, hi). In page form whole pages are
        copied (one index_select of page-sized rows, not one gather per entry), so a column a
        query may not read can hold any bytes, NaN included: the caller masks what it computes
        from them (the indexer's scores) and must not use them as values."""
        if self.pages is None:
            slots = self._slots[..., lo:hi]
            if self.shared and _is_run(slots):
                # Consecutive slots (the block pool hands out pages in order): a view, not a copy.
                return cache[int(slots[0]) : int(slots[0]) + slots.numel()]
            return cache[slots]
        spp = self.slots_per_page
        p0, p1 = lo // spp, -(-hi // spp)
        n = self.pages.shape[0]
        paged = cache.view(-1, spp, cache.shape[-1])
        block = paged.index_select(0, self.pages[:, p0:p1].reshape(-1)).view(n, (p1 - p0) * spp, -1)
        return block[:, lo - p0 * spp : hi - p0 * spp]

    def row_slice(self, a: int, b: int) -> "KeySet":
        """The key set of queries [a, b) of this one."""
        mask = None if self.explicit_mask is None else self.explicit_mask[a:b]
        visible = None if self.visible is None else self.visible[a:b]
        if self.pages is not None:
            return KeySet(pages=self.pages[a:b], slots_per_page=self.slots_per_page, length=self._length,
                          visible=visible)
        return KeySet(self._slots if self.shared else self._slots[a:b], explicit_mask=mask, visible=visible)

    @property
    def shared(self) -> bool:
        return self.pages is None and self._slots.dim() == 1

    @property
    def length(self) -> int:
        return self._length

    @property
    def num_queries(self) -> int:
        return (self.explicit_mask if self.visible is None else self.visible).shape[0]

    def all_visible(self, hi: int) -> bool:
        """Whether every query may read every column below hi (so that range needs no mask)."""
        if self.visible is None:
            return bool(self.explicit_mask[:, :hi].all())
        return self.visible.numel() == 0 or int(self.visible.min()) >= hi

    def column_mask(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """[n, hi - lo] bool: which of columns [lo, hi) each query may read."""
        hi = self.length if hi is None else hi
        if self.visible is None:
            return self.explicit_mask[:, lo:hi]
        return torch.arange(lo, hi)[None, :] < self.visible[:, None]

    @property
    def mask(self) -> torch.Tensor:
        """The full [n, L] mask (materialised on demand; prefer column_mask for long key sets)."""
        return self.column_mask()

    def take(self, idx: torch.Tensor) -> "KeySet":
        """The columns idx [n, k] of this key set, as a per-query key set with an explicit mask."""
        slots = self.slots_of(idx)
        if self.visible is None:
            return KeySet(slots, explicit_mask=self.explicit_mask.gather(1, idx))
        return KeySet(slots, explicit_mask=idx < self.visible[:, None])


@dataclass
class QueryBlock:
    start: int  # rows [start, end) of the step's flat token batch
    end: int
    swa: KeySet
    entries: dict[str, KeySet] = field(default_factory=dict)  # compressed space -> causal entries


@dataclass
class CompressionPlan:
    """One compressor kind's work this step: the raw rows its state ring keeps, and the windows
    that close."""

    ratio: int
    overlap: bool
    state_space: str
    write_rows: torch.Tensor  # [n] step rows the ring keeps (each sequence's and each page's last 2m / m)
    write_slots: torch.Tensor  # [n] their ring slots
    row_new: torch.Tensor  # [E, rows_per_entry] step row of each pooled row new this step (else 0)
    row_slots: torch.Tensor  # [E, rows_per_entry] ring slot of each pooled row from before the step (else null)
    row_valid: torch.Tensor  # [E, rows_per_entry] False for rows before position 0
    positions: torch.Tensor  # [E] first token of each window (its RoPE position)
    out_slots: dict[str, torch.Tensor]  # space -> [E] slot of the new entry
    seq: torch.Tensor | None = None  # [E] the step's sequence index of each entry
    entry: torch.Tensor | None = None  # [E] the entry's index in its sequence (w)
    cached: tuple[torch.Tensor, ...] = ()  # index of the pooled rows read from the ring

    @property
    def num_entries(self) -> int:
        return self.positions.numel()

    def gather_rows(self, ring: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """[E, rows_per_entry, width]: every closing window's rows in window order, from this
        step's rows `fresh` [T, width] and the ring [slots, width] (rows before the step: at
        most 2m - 1 per sequence). Rows before position 0 hold any value: pool masks them."""
        rows = fresh[self.row_new]
        if self.cached:
            rows[self.cached] = ring[self.row_slots[self.cached]]
        return rows


@dataclass
class HybridAttentionMetadata:
    num_tokens: int
    swa_slot_mapping: torch.Tensor  # [T]
    plans: dict[str, CompressionPlan]  # "csa" / "hca"
    blocks: list[QueryBlock]
    num_decodes: int = 0  # blocks' rows below this are one-query sequences
    # HiSparse (attention_backends/hisparse_reads.py: HiSparseStep) when the engine enables it.
    hisparse: object | None = None
    # This step's host-tier load-backs (model_executor/kv_loads.py), or None: a layer waits for
    # its caches' pages before it reads them.
    kv_loads: object | None = None

    def slot_mappings(self) -> dict[str, torch.Tensor]:
        """Space -> every slot this step writes (the runner's null-page debug check reads it)."""
        out = {SWA: self.swa_slot_mapping}
        for plan in self.plans.values():
            out[plan.state_space] = plan.write_slots
            for space, slots in plan.out_slots.items():
                out[space] = torch.cat([out[space], slots]) if space in out else slots
        return out


def _token_slots(table: torch.Tensor, pos: torch.Tensor, page_size: int, check: bool = False) -> torch.Tensor:
    """Slot of each token position through a block table ([pages] or [B, pages], int32 or int64)."""
    idx = (pos // page_size).clamp(max=table.shape[-1] - 1)
    page = table[idx] if table.dim() == 1 else table.gather(1, idx)
    if check and bool((page == NULL_PAGE).any()):
        raise AssertionError("a read or write reached a page the sequence does not hold (released or never had)")
    return page * page_size + pos % page_size


def _entry_slots(table: torch.Tensor, w: torch.Tensor, slots_per_page: int) -> torch.Tensor:
    idx = (w // slots_per_page).clamp(max=table.shape[-1] - 1)
    page = table[idx] if table.dim() == 1 else table.gather(1, idx)
    return page * slots_per_page + w % slots_per_page


def _masked(slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Invalid reads go to slot 0 of the null page: zeros, so a masked read is finite."""
    return torch.where(valid, slots, NULL_SLOT)


@dataclass
class _StepTokens:
    """The step's flat token batch: each row's sequence and position, each sequence's first row."""

    seq: torch.Tensor  # [T]
    pos: torch.Tensor  # [T]
    first_row: torch.Tensor  # [B]
    start: torch.Tensor  # [B] first new position (tokens already computed)
    ctx: torch.Tensor  # [B] positions after the step


def _plan(seqs: StepSequences, layout: HybridLayout, kind: str, out_spaces: list[str], tok: _StepTokens) -> CompressionPlan:
    """Every window that closes this step, for every sequence at once (no per-sequence loop)."""
    P = layout.page_size
    ratio, overlap, space = layout.compressors()[kind]
    rows = (2 if overlap else 1) * ratio
    ring = (layout.state_rings or {}).get(space, rows)
    spp = min(ring, P)  # the ring (SpaceSpec.slots_per_page of the state space)
    state = seqs.block_tables[space]
    # The ring keeps the rows a later window may still read: each sequence's last `rows`, and
    # each page's last `rows` (a page end is where a prefix hit resumes, from a cached page
    # whose ring must be its own). Per page that is at most `rows` consecutive positions.
    keep = (tok.pos >= tok.ctx[tok.seq] - rows) | (tok.pos % P >= P - rows)
    write_rows = keep.nonzero().squeeze(1)
    wpos, wseq = tok.pos[write_rows], tok.seq[write_rows]
    wpage = state[wseq, (wpos // P).clamp(max=state.shape[1] - 1)]
    if bool((wpage == NULL_PAGE).any()):
        raise AssertionError(f"a write reached a {space!r} page the sequence does not hold")
    write_slots = wpage * spp + wpos % P % spp
    lo = tok.start // ratio
    count = tok.ctx // ratio - lo  # windows whose last token is new this step, per sequence
    total = int(count.sum())
    if total == 0:
        empty = torch.empty(0, dtype=torch.long)
        none = torch.empty(0, rows, dtype=torch.long)
        return CompressionPlan(ratio, overlap, space, write_rows, write_slots, none, none,
                               torch.empty(0, rows, dtype=torch.bool), empty, {s: empty for s in out_spaces},
                               empty, empty)
    seq = torch.repeat_interleave(torch.arange(tok.ctx.shape[0]), count)
    w = lo[seq] + torch.arange(total) - (torch.cumsum(count, 0) - count)[seq]
    pos = (w * ratio - (ratio if overlap else 0))[:, None] + torch.arange(rows)[None, :]
    valid = pos >= 0
    start = tok.start[seq][:, None]
    new = pos >= start
    row_new = torch.where(new, tok.first_row[seq][:, None] + pos - start, 0)
    cached = valid & ~new
    clamped = pos.clamp(min=0)
    page = state[seq[:, None], (clamped // P).clamp(max=state.shape[1] - 1)]
    if bool(((page == NULL_PAGE) & cached).any()):
        raise AssertionError("compression needs state rows from a released page; the state window is too small")
    row_slots = _masked(page * spp + clamped % P % spp, cached)
    out = {}
    for space_name in out_spaces:
        table = seqs.block_tables[space_name]
        e = P // ratio
        out[space_name] = table[seq, (w // e).clamp(max=table.shape[1] - 1)] * e + w % e
    return CompressionPlan(ratio, overlap, space, write_rows, write_slots, row_new, row_slots, valid, w * ratio,
                           out, seq, w, cached.nonzero(as_tuple=True) if bool(cached.any()) else ())


def _decode_blocks(seqs: StepSequences, layout: HybridLayout, nd: int) -> list[QueryBlock]:
    """The nd one-query sequences, in blocks of DECODE_BLOCK_SEQS: the SWA slots and masks are
    built for all of them with one set of tensor ops, then sliced per block; compressed entries
    are the block's page-table rows (page form), trimmed to its own longest history, so a long
    request pads only its own block and nothing per step costs O(entries)."""
    P, W = layout.page_size, layout.window
    pos = torch.tensor(seqs.context_lens[:nd]) - 1  # [nd] the single query of each sequence
    kpos = window_start(pos, W)[:, None] + torch.arange(W)[None, :]  # at most W keys per query
    valid = kpos <= pos[:, None]
    swa = _masked(_token_slots(seqs.block_tables[SWA][:nd], kpos, P), valid), valid
    counts = {ratio: (pos + 1) // ratio for ratio in set(layout.compressed_spaces().values())}
    blocks = []
    for lo in range(0, nd, DECODE_BLOCK_SEQS):
        hi = min(nd, lo + DECODE_BLOCK_SEQS)
        blk = QueryBlock(lo, hi, KeySet(swa[0][lo:hi], explicit_mask=swa[1][lo:hi]))
        for space, ratio in layout.compressed_spaces().items():
            count = counts[ratio][lo:hi]
            width, spp = int(count.max()), P // ratio
            table = seqs.block_tables[space][lo:hi, : max(1, -(-width // spp))]
            # Page form: O(pages) per step; the slots of the columns read are built by the consumer.
            blk.entries[space] = KeySet(pages=table.long(), slots_per_page=spp, length=width, visible=count)
        blocks.append(blk)
    return blocks


def _prefill_blocks(seqs: StepSequences, layout: HybridLayout, i: int, row0: int) -> list[QueryBlock]:
    P, W = layout.page_size, layout.window
    q, c = seqs.query_lens[i], seqs.context_lens[i]
    s = c - q
    swa_table = seqs.block_tables[SWA][i]
    tables = {space: seqs.block_tables[space][i] for space in layout.compressed_spaces()}
    blocks = []
    for a in range(s, c, PREFILL_BLOCK_ROWS):
        b = min(c, a + PREFILL_BLOCK_ROWS)
        qpos = torch.arange(a, b)
        # Every key in [window_start(a), b) is written (cached or new this step), so the shared
        # slot list needs no null-page redirection; the mask is causal + window per query.
        kpos = torch.arange(window_start(a, W), b)
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= window_start(qpos, W)[:, None])
        swa = KeySet(_token_slots(swa_table, kpos, P, check=True), explicit_mask=mask)
        entries = {}
        for space, ratio in layout.compressed_spaces().items():
            w = torch.arange(b // ratio)  # entries the last query of the block may see
            # Causal prefix per query (no [rows, entries] mask): query t reads entries [0, (t+1)//ratio).
            entries[space] = KeySet(_entry_slots(tables[space], w, P // ratio), visible=(qpos + 1) // ratio)
        blocks.append(QueryBlock(row0 + a - s, row0 + b - s, swa, entries))
    return blocks


def build_hybrid_metadata(seqs: StepSequences, layout: HybridLayout) -> HybridAttentionMetadata:
    """Token order: the one-query sequences first (decodes), then prefill chunks (as the runner orders them)."""
    P = layout.page_size
    # Each new token's sequence and position: one pass over the flat batch.
    q_lens = torch.tensor(seqs.query_lens)
    ctx = torch.tensor(seqs.context_lens)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs.query_lens)), q_lens)
    first_row = torch.cumsum(q_lens, 0) - q_lens
    positions = (ctx - q_lens)[seq_of_token] + torch.arange(seq_of_token.shape[0]) - first_row[seq_of_token]
    tok = _StepTokens(seq_of_token, positions, first_row, ctx - q_lens, ctx)

    table = seqs.block_tables[SWA]
    page = table[seq_of_token, (positions // P).clamp(max=table.shape[1] - 1)]
    if bool((page == NULL_PAGE).any()):
        raise AssertionError(f"a write reached a {SWA!r} page the sequence does not hold")
    out_spaces = {"csa": [C4, INDEXER], "hca": [C128]}
    plans = {kind: _plan(seqs, layout, kind, out_spaces[kind], tok) for kind in layout.compressors()}
    nd = seqs.num_decodes
    blocks = _decode_blocks(seqs, layout, nd) if nd else []
    row = nd
    for i in range(nd, len(seqs.query_lens)):
        blocks.extend(_prefill_blocks(seqs, layout, i, row))
        row += seqs.query_lens[i]
    return HybridAttentionMetadata(
        num_tokens=sum(seqs.query_lens),
        swa_slot_mapping=page * P + positions % P,
        plans=plans,
        blocks=blocks,
        num_decodes=nd,
    )
