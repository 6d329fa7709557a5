"""Per-step attention metadata over paged block spaces.

Built once per step by the model runner and shared by every layer that reads the same
space, so per-layer work is only: write the new K/V into their slots, gather the keys each
query may see, run attention.

Token order in a step: sequences with one query token (decodes, or 1-token prefill chunks)
first, then multi-token prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A released (out-of-window) page in a request's table. The block manager owns this
# convention (block_manager.shadow_index.NULL_PAGE); attention_backends sits below it in the
# import order, so it restates the value instead of importing it.
NULL_PAGE = -1


@dataclass
class StepSequences:
    """Host-side description of the sequences in one step (order = token order)."""

    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache after this step = start + query_len
    page_tables: dict[str, list[list[int]]]  # space -> per sequence page ids (NULL_PAGE = released)

    @property
    def num_decodes(self) -> int:
        n = 0
        for q in self.query_lens:
            if q != 1:
                break
            n += 1
        return n


@dataclass
class PrefillSeq:
    query_start: int  # first row of this sequence in the step's flat token batch
    query_end: int
    key_slots: torch.Tensor  # [Lk] cache slots of the keys it reads, in position order
    mask: torch.Tensor | None  # [q_len, Lk] bool (True = attend); None = plain causal from 0


@dataclass
class SpaceAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_key_slots: torch.Tensor | None  # [Bd, Lk] cache slots read by each decode query
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lk] bool, None when nothing is padded
    prefills: list[PrefillSeq] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_decode_tokens: int
    spaces: dict[str, SpaceAttentionMetadata]


def _slots(table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slot of each position, looked up in a page table (NULL pages map to slot 0)."""
    page = table[pos // page_size] if table.dim() == 1 else table.gather(1, pos // page_size)
    return torch.where(page >= 0, page * page_size + pos % page_size, 0)


def build_space_metadata(
    seqs: StepSequences, space: str, window: int | None, page_size: int
) -> SpaceAttentionMetadata:
    tables = seqs.page_tables[space]
    nd = seqs.num_decodes
    starts = [c - q for c, q in zip(seqs.context_lens, seqs.query_lens)]

    # Where each new token is written.
    slot_chunks = []
    decode_slots = None
    decode_mask = None
    if nd:
        ctx = torch.tensor(seqs.context_lens[:nd])
        max_pages = max(len(t) for t in tables[:nd])
        table_t = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables[:nd]], dtype=torch.long)
        slot_chunks.append(_slots(table_t, (ctx - 1).unsqueeze(1), page_size).squeeze(1))
        # Keys each decode query reads: [kstart, ctx), padded to the longest.
        span = ctx if window is None else ctx.clamp(max=window)
        lk = int(span.max())
        kpos = (ctx - span).unsqueeze(1) + torch.arange(lk).unsqueeze(0)
        valid = kpos < ctx.unsqueeze(1)
        decode_slots = _slots(table_t, torch.where(valid, kpos, 0), page_size)
        if not bool(valid.all()):
            decode_mask = valid[:, None, None, :]

    prefills: list[PrefillSeq] = []
    row = nd
    for i in range(nd, len(tables)):
        q, c, s = seqs.query_lens[i], seqs.context_lens[i], starts[i]
        table = torch.tensor(tables[i], dtype=torch.long)
        qpos = torch.arange(s, c)
        slot_chunks.append(_slots(table, qpos, page_size))
        kstart = 0 if window is None else max(0, s - window + 1)
        kpos = torch.arange(kstart, c)
        mask = None
        if s != 0 or window is not None:
            rel = qpos.unsqueeze(1) - kpos.unsqueeze(0)
            mask = rel >= 0
            if window is not None:
                mask &= rel < window
        prefills.append(PrefillSeq(row, row + q, _slots(table, kpos, page_size), mask))
        row += q

    slot_mapping = torch.cat(slot_chunks) if slot_chunks else torch.empty(0, dtype=torch.long)
    return SpaceAttentionMetadata(slot_mapping, decode_slots, decode_mask, prefills)


def build_attention_metadata(
    seqs: StepSequences, windows: dict[str, int | None], page_size: int
) -> AttentionMetadata:
    nd = seqs.num_decodes
    return AttentionMetadata(
        num_tokens=sum(seqs.query_lens),
        num_decode_tokens=nd,
        spaces={name: build_space_metadata(seqs, name, w, page_size) for name, w in windows.items()},
    )
