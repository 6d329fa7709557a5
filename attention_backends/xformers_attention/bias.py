"""xformers attention biases for a step's sequences: a pure function of lengths and block tables.

build_xformers_step(q_lens, context_lens, block_table, page_size, window, layout) returns the
xformers `attn_bias` object plus the key/value layout it expects (XformersStep), with no kernel
call, so it is checked on the CPU: tests materialize() the bias and run plain
softmax(QK^T * scale + bias) V over XformersStep.keys(cache) (tests/attention_backends/
test_xformers_bias.py). The backend (backend.py) hands the same objects to
xformers.ops.memory_efficient_attention.

Sequence i has q_lens[i] new tokens at positions [context_lens[i] - q_lens[i], context_lens[i]);
query i reads keys [window_start(pos, window), pos] (causal, sliding window when window is set).
Layouts (the hybridkv cache is head-major, [Hkv, num_slots, D]):

  "paged"   K/V are the whole pool, [1, num_slots, Hkv, D] (a transposed view, no gather), and
            the bias is PagedBlockDiagonalCausalWithOffsetPaddedKeysMask over the block-table rows.
            Full attention, float16/bfloat16 only: released pages of a windowed space are
            NULL_PAGE entries the mask would still let a query read, and cutlass (the one op for
            float32) has no paged masks. xformers' flash ops view the pool as [pages, page_size,
            Hkv, D] with head-major strides; until that is checked on a GPU (benchmarks/
            gpu_check.py runs it) the backend uses it only when asked: HYBRIDKV_XFORMERS_LAYOUT=paged.
  "padded"  each sequence's keys [window_start(first query), context) gathered into a row of
            `padding` = the longest such range: K/V [1, B * padding, Hkv, D];
            BlockDiagonalCausalWithOffsetPaddedKeysMask, or BlockDiagonalCausalLocalAttention-
            PaddedKeysMask with a window. Padding slots read the null page (zeros) and are masked.
  "packed"  the same keys concatenated without padding; BlockDiagonalCausalFromBottomRightMask or
            BlockDiagonalCausalLocalAttentionFromBottomRightMask. Used for float32 with a window
            (the only xformers op that takes float32, cutlass, has no padded-keys local mask).

Importing xformers: load_attn_bias() imports xformers.ops.fmha.attn_bias normally. On a CPU
machine whose xformers wheel was built for another torch / Python, `import xformers.ops` still
works (xformers warns that its C++/CUDA extensions are unavailable; the masks are pure Python
and torch). Should importing the package as a whole fail, attn_bias.py -- which imports only
math, dataclasses, typing and torch -- is loaded straight from the installed file with
importlib.util.spec_from_file_location, under a private module name.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.attention_backends.metadata import NULL_SLOT, AttentionMetadata, token_slots
from hybridkv.block_manager.space_spec import window_start

LAYOUTS = ("paged", "padded", "packed")
_PRIVATE_NAME = "_hybridkv_xformers_attn_bias"


def load_attn_bias():
    """The xformers.ops.fmha.attn_bias module; ImportError when xformers is not installed."""
    try:
        from xformers.ops.fmha import attn_bias

        return attn_bias
    except ImportError:
        if importlib.util.find_spec("xformers") is None:
            raise
    if _PRIVATE_NAME in sys.modules:
        return sys.modules[_PRIVATE_NAME]
    # The package is installed but does not import as a whole: load the mask module by file.
    root = importlib.util.find_spec("xformers").submodule_search_locations[0]
    path = os.path.join(root, "ops", "fmha", "attn_bias.py")
    spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"xformers is installed but {path} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE_NAME] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@dataclass
class XformersStep:
    """One memory_efficient_attention call: the bias and the key layout it indexes."""

    attn_bias: Any  # an xformers AttentionBias
    layout: str  # one of LAYOUTS
    num_queries: int  # query rows covered (the selected sequences' tokens, in order)
    key_slots: torch.Tensor | None  # gathered layouts: [num_keys] cache slot of each key (NULL_SLOT on padding)

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """cache [Hkv, num_slots, D] -> the K (or V) tensor the bias expects, [1, num_keys, Hkv, D]."""
        if self.layout == "paged":
            return cache.transpose(0, 1).unsqueeze(0)  # a view of the whole pool
        return cache.index_select(1, self.key_slots).transpose(0, 1).unsqueeze(0)

    def num_keys(self, cache: torch.Tensor) -> int:
        return cache.shape[1] if self.layout == "paged" else self.key_slots.numel()

    def materialize(self, num_keys: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """The bias as a dense [num_queries, num_keys] tensor (0 or -inf) through xformers'
        own materialize() (slow; for tests and debugging)."""
        b = self.attn_bias
        if self.layout == "paged":
            logical = len(b.k_seqinfo.seqlen_py) * b.block_tables.shape[1] * b.page_size
            m = b.materialize((self.num_queries, logical), dtype=dtype, device=device)
            out = torch.full((self.num_queries, num_keys), float("-inf"), dtype=dtype, device=device)
            out[:, : m.shape[-1]] = m  # materialize stops at the highest page the tables name
            return out
        return b.materialize((self.num_queries, num_keys), dtype=dtype, device=device)


def supported_layouts(dtype: torch.dtype, window: int | None) -> list[str]:
    """The layouts some xformers op takes for this dtype and window: paged needs float16/bfloat16
    (flash) and no window; cutlass, the only float32 op, has no padded-keys local mask."""
    half = dtype in (torch.float16, torch.bfloat16)
    return (["paged"] if half and window is None else []) + (["padded"] if half or window is None else []) + ["packed"]


def default_layout(dtype: torch.dtype, window: int | None) -> str:
    """The layout the backend uses: HYBRIDKV_XFORMERS_LAYOUT when set and supported for this
    dtype and window (debugging / gpu_check), else "padded" where supported, else "packed"."""
    ok = supported_layouts(dtype, window)
    forced = os.environ.get("HYBRIDKV_XFORMERS_LAYOUT", "").strip()
    if forced and forced not in LAYOUTS:
        raise ValueError(f"HYBRIDKV_XFORMERS_LAYOUT={forced!r}; choose one of {LAYOUTS}")
    if forced in ok:
        return forced
    return "padded" if "padded" in ok else "packed"


def build_xformers_step(
    q_lens: list[int],
    context_lens: list[int],
    block_table: torch.Tensor,  # [B, width] page ids, row i = sequence i
    page_size: int,
    window: int | None,
    layout: str = "padded",
    device: torch.device | str | None = None,
) -> XformersStep:
    """The bias and key layout for sequences with these lengths (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown xformers layout {layout!r}; choose one of {LAYOUTS}")
    if layout == "paged" and window is not None:
        raise ValueError("the paged xformers layout cannot express a sliding window; use 'padded' or 'packed'")
    if len(q_lens) != len(context_lens) or block_table.shape[0] != len(q_lens):
        raise ValueError("q_lens, context_lens and block_table rows must describe the same sequences")
    ab = load_attn_bias()
    device = torch.device(device) if device is not None else block_table.device
    q_lens, context_lens = [int(x) for x in q_lens], [int(x) for x in context_lens]
    num_queries = sum(q_lens)
    if layout == "paged":
        bias = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=q_lens, kv_seqlen=context_lens, block_tables=block_table.to(device, torch.int32),
            page_size=page_size, device=device,
        )
        return XformersStep(bias, layout, num_queries, None)

    key_start = [window_start(c - q, window) for q, c in zip(q_lens, context_lens)]
    kv_lens = [c - s for c, s in zip(context_lens, key_start)]
    table = block_table.to(device)
    B = len(q_lens)
    starts = torch.tensor(key_start, device=device)
    lens = torch.tensor(kv_lens, device=device)
    if layout == "padded":
        padding = max(kv_lens)
        j = torch.arange(padding, device=device)[None, :].expand(B, padding)
        rows = torch.arange(B, device=device)[:, None].expand(B, padding)
        slots = token_slots(table, starts[:, None] + j, page_size, rows=rows)
        slots = torch.where(j < lens[:, None], slots, NULL_SLOT).reshape(-1)
        bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=q_lens, kv_padding=padding, kv_seqlen=kv_lens, device=device
        )
        if window is not None:
            bias = ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask(
                q_seqinfo=bias.q_seqinfo, k_seqinfo=bias.k_seqinfo, _window_size=window
            )
    else:  # packed
        seq = torch.repeat_interleave(torch.arange(B, device=device), lens)
        first = torch.cumsum(lens, 0) - lens
        pos = starts[seq] + torch.arange(seq.shape[0], device=device) - first[seq]
        slots = token_slots(table, pos, page_size, rows=seq)
        bias = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, kv_lens, device=device)
        if window is not None:
            bias = bias.make_local_attention_from_bottomright(window)
    return XformersStep(bias, layout, num_queries, slots.long())


def prefill_step(meta: AttentionMetadata, space: str, layout: str, device=None) -> XformersStep:
    """The bias of the step's multi-token prefill chunks (the sequences after the decodes) in
    space `space`, from the metadata alone (the backend's per-step call; host ints come from
    the PrefillSeq entries, the table rows from SpaceAttentionMetadata.block_table)."""
    sm = meta.spaces[space]
    if getattr(sm, "block_table", None) is None:
        raise ValueError("the xformers backend needs SpaceAttentionMetadata.block_table (metadata.py)")
    nd = meta.num_decode_tokens
    q_lens = [p.query_end - p.query_start for p in sm.prefills]
    ctx = [p.start + q for p, q in zip(sm.prefills, q_lens)]
    table = sm.block_table[nd : nd + len(q_lens)]
    return build_xformers_step(q_lens, ctx, table, meta.page_size, sm.window, layout, device)
