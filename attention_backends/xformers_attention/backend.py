"""XformersAttention: prefill through xformers.ops.memory_efficient_attention, decode through the
Triton paged decode kernel (hybridkv.attention_backends.triton_attention.decode_attention).

Same forward signature and cache layout as TorchNativeAttention ([Hkv, num_slots, D] per layer,
page 0 the all-zero null page). GPU only: constructing it without a CUDA device raises the
registry's error ("attention_backend='xformers' needs a CUDA device; ..."). Nothing is imported
from xformers or triton until an instance is made.

Per step and space the bias (bias.py, a pure function of the metadata) is built once and reused
by every layer. GQA goes to xformers as BMGHK: q [1, T, Hkv, group, D], K/V [1, M, Hkv, group, D]
expanded over the group (stride 0), so each KV head is read once per group of query heads.
Decode: the Triton kernel when `triton` imports; otherwise (an xformers install without
triton) the torch-native decode path (TorchNativeAttention._decode over the metadata's decode
tiles), which runs on any device.
"""
from __future__ import annotations

import logging

import torch

from hybridkv.attention_backends.backend import AttentionBackend
from hybridkv.attention_backends.metadata import AttentionMetadata
from hybridkv.attention_backends.registry import attention_backend_problem
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.attention_backends.xformers_attention.bias import XformersStep, default_layout, prefill_step

logger = logging.getLogger(__name__)

# The Triton decode kernel's launch parameters, TritonAttention's defaults (SGLang's 8 splits).
DECODE_BLOCK_N = 64  # keys per inner step
DECODE_SPLITS = 8  # key ranges each decode query is split over (merged by log-sum-exp)


def _triton_decode():
    """engineer A's decode entry point, or None when triton (or the module) is not importable."""
    try:
        from hybridkv.attention_backends.triton_attention.decode_attention import decode_attention
    except Exception as e:  # noqa: BLE001 - ImportError, or a triton that fails to initialise
        logger.info("xformers backend: Triton decode unavailable (%s); decoding with the torch-native path", e)
        return None
    return decode_attention


class XformersAttention(AttentionBackend):
    name = "xformers"
    needs_decode_tiles = False  # decodes walk the block tables in the kernel

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        problem = attention_backend_problem(self.name, self.device)
        if problem is not None:
            raise RuntimeError(problem)
        import xformers.ops

        self._fmha = xformers.ops.memory_efficient_attention
        self._decode_kernel = _triton_decode()
        self._memo: tuple[AttentionMetadata, dict[str, XformersStep]] | None = None

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_slots, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        space: str,
        scale: float,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's attention output, or `out_rows`' only (TorchNativeAttention.forward's
        contract; here every row is attended, then those are taken)."""
        if meta.kv_loads is not None:  # host-tier load-backs into this layer's pages land first
            meta.kv_loads.wait(k_cache, v_cache)
        sm = meta.spaces[space]
        k_cache.index_copy_(1, sm.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, sm.slot_mapping, v.transpose(0, 1))
        nd = meta.num_decode_tokens
        out = torch.empty_like(q)
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta, space, scale, out[:nd])
        if nd < q.shape[0]:
            step = self._prefill_step(meta, space, q.dtype, q.device)
            out[nd:] = self._attend(q[nd:], k_cache, v_cache, step, scale)
        return out if out_rows is None else out[out_rows]

    # -- prefill -------------------------------------------------------------------------------
    def _prefill_step(self, meta: AttentionMetadata, space: str, dtype: torch.dtype, device) -> XformersStep:
        if self._memo is None or self._memo[0] is not meta:
            self._memo = (meta, {})  # a new step: every layer of this step reuses its biases
        steps = self._memo[1]
        if space not in steps:
            layout = default_layout(dtype, meta.spaces[space].window)
            steps[space] = prefill_step(meta, space, layout, device)
        return steps[space]

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: XformersStep,
                scale: float) -> torch.Tensor:
        T, H, D = q.shape
        hkv = k_cache.shape[0]
        group = H // hkv
        qx = q.reshape(1, T, hkv, group, D)
        kx = step.keys(k_cache).unsqueeze(3).expand(-1, -1, hkv, group, D)
        vx = step.keys(v_cache).unsqueeze(3).expand(-1, -1, hkv, group, D)
        o = self._fmha(qx, kx, vx, attn_bias=step.attn_bias, scale=scale)
        return o.reshape(T, H, D)

    # -- decode --------------------------------------------------------------------------------
    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, space: str, scale: float, out) -> None:
        sm = meta.spaces[space]
        table = getattr(sm, "block_table", None)
        if self._decode_kernel is None or table is None or meta.context_lens is None:
            # Fallback: torch-native's split-KV decode over the metadata's decode tiles.
            out.copy_(TorchNativeAttention._decode(q, k_cache, v_cache, sm.decode_tiles, sm.decode_split, scale))
            return
        self._decode_kernel(
            q, k_cache, v_cache, table, meta.context_lens, meta.page_size, sm.window, scale, out,
            num_splits=DECODE_SPLITS, block_n=DECODE_BLOCK_N,
        )
