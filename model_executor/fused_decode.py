"""A Llama-family model's decode step, embedding to final norm, in one C++ call.

At decode batch sizes a layer's kernels are short and the Python between them is not: at one row
the demo model spent ~110 us a layer in the forward methods, the linears' wrappers and the views,
next to ~210 us of weight streaming (2-core Zen 4, bf16: 3.3 of a token's 12.5 ms). `FusedDecode`
hands the whole stack to cpu_kernels/decode_layers.cpp, which calls the same kernels in the same
order on the same tensors, so a step's outputs are bit-identical to the layer-by-layer path (the
tests hold it to that), and the layers' Python runs once per step instead of once per layer.
The embedding lookup, the decode groups and the final norm run in the same call: at one row each
small op dispatched from Python after the weight stream cost ~50-100 us (2-core Zen 4), about the
Python work of a whole layer.

It takes a step only where the layer-by-layer path would run exactly those kernels:
- CPU kernels built (fused ops, blocked linear, paged attention) and HYBRIDKV_FUSED_DECODE not 0;
- every layer a Llama decoder layer (with or without Qwen3's q/k norms), SiLU MLP, plain RMSNorm
  of one eps; a plain final RMSNorm and an nn.Embedding; all in the model's dtype (the KV caches
  too, or FP8: kv_cache_dtype, which write_kv quantizes into and paged_attention widens back);
- or every layer a Gemma 3 decoder layer: unit-offset RMSNorms (four a layer, q/k norms, the
  final norm) of one eps, GELU-tanh MLP, the scaled embedding, one RoPE table per layer type;
- every projection on the blocked linear (bf16: PackedLinearWeight's vdpbf16ps path on CPUs with
  AVX512-BF16; float32: BlockedLinearWeight), and at most as many rows as those take;
- attention on TorchNativeAttention with its paged decode kernel and K/V writer;
- a step of decodes only, with no host-tier load-backs to wait for.
Anything else (prefill chunks, the AMX linear, DeepSeek-V4) runs layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.attention_backends.cpu_kernels import load_paged_attention_module
from hybridkv.attention_backends.cpu_kernels.build import switch_on
from hybridkv.attention_backends.kv_cache_dtype import FP8_DTYPES
from hybridkv.attention_backends.metadata import AttentionMetadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.model_executor.cpu_kernels import blocked_linear_ops, decode_layers_ops, fused_ops
from hybridkv.model_executor.layers import BlockedLinearWeight, PackedLinearWeight, RMSNorm, packed_forward

ENV_SWITCH = "HYBRIDKV_FUSED_DECODE"
_NONE = torch.empty(0)  # decode_layers.cpp's "no bias" / "no such norm" (a list of tensors cannot hold None)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # SiluAndMulMLP's names for F.gelu(approximate="tanh")


def _is_gemma3_layer(layer) -> bool:
    """A Gemma 3 decoder layer: its sub-blocks' outputs are normed before the residual adds."""
    return hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")


def _address(dtype: torch.dtype) -> int:
    """The blocked linear kernel's address for `dtype` (the one a head must run to be bound)."""
    name = "blocked_linear_bf16" if dtype == torch.bfloat16 else "blocked_linear"
    return blocked_linear_ops().kernel_addresses()[name]


@dataclass
class _Head:
    """The logits head as decode_burst calls it: the layers' linear kernel on this weight."""
    weight: torch.Tensor
    bias: torch.Tensor
    out_features: int
    max_rows: int | None

    @classmethod
    def of(cls, head, dtype: torch.dtype, same_kernel: bool) -> _Head | None:
        if not same_kernel:
            return None
        if isinstance(head, PackedLinearWeight) and dtype == torch.bfloat16 and head.blocked is not None:
            if head.blocked_rows == 0:
                return None
            weight, rows = head.blocked_packed, head.blocked_rows  # None: every row count
        elif isinstance(head, BlockedLinearWeight) and dtype == torch.float32:
            weight, rows = head.packed, head.max_rows
        else:
            return None
        return cls(weight, _NONE if head.padded_bias is None else head.padded_bias, head.out_features, rows)


@dataclass
class _Bound:
    """What the runner binds after packing (caches, backends), gathered at first use."""
    k0: torch.Tensor  # layer 0's K cache: rebinding the caches makes a new one
    caches: list[torch.Tensor]


class FusedDecode:
    """The model's forward for a step `takes(input_ids, meta)` accepts: final hidden states =
    fused(input_ids, ropes, meta), ropes the (cos, sin) of each of `rope_keys` (the layers'
    `layer_type`s in first-use order; [None] for models with one table). Build it with
    `for_model` after the weights are packed."""

    def __init__(self, model, dtype: torch.dtype, linear_kernel: str, max_rows: int | None) -> None:
        attn0 = model.layers[0].self_attn
        self.layers = list(model.layers)
        self.dtype, self.max_rows = dtype, max_rows
        self.gemma3 = _is_gemma3_layer(self.layers[0])
        self.embed_scale = float(getattr(model, "embed_scale", 1.0)) if self.gemma3 else 1.0
        self.heads, self.kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.scale, self.eps = float(attn0.scale), float(model.layers[0].input_layernorm.eps)
        self.embedding = model.embed_tokens.weight.detach()
        self.final_norm, self.final_eps = model.norm.weight.detach(), float(model.norm.eps)
        self.op = decode_layers_ops().decode_layers
        self.kernels = dict(fused_ops().kernel_addresses())
        self.kernels.update(load_paged_attention_module().kernel_addresses())
        self.kernels["linear"] = blocked_linear_ops().kernel_addresses()[linear_kernel]
        self.weights: list[torch.Tensor] = []
        self.out_features: list[int] = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            self.weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            for proj in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
                linear = packed_forward(proj)
                packed = linear.blocked_packed if isinstance(linear, PackedLinearWeight) else linear.packed
                bias = linear.padded_bias
                self.weights += [packed, _NONE if bias is None else bias]
                self.out_features.append(linear.out_features)
            self.weights += [_NONE, _NONE] if a.q_norm is None else [a.q_norm.weight.detach(), a.k_norm.weight.detach()]
            self.weights += ([layer.pre_feedforward_layernorm.weight.detach(),
                              layer.post_feedforward_layernorm.weight.detach()] if self.gemma3 else [_NONE, _NONE])
        # Block spaces in first-use order, and each layer's index into them: a step hands the
        # kernel one block table, slot mapping and window per space, not per layer.
        self.spaces = list(dict.fromkeys(layer.self_attn.space for layer in self.layers))
        self.layer_space = [self.spaces.index(layer.self_attn.space) for layer in self.layers]
        # RoPE tables likewise (Gemma 3: the sliding layers' local base, the full layers' global one).
        types = [layer.layer_type if self.gemma3 else None for layer in self.layers]
        self.rope_keys = list(dict.fromkeys(types))
        self.layer_rope = [self.rope_keys.index(t) for t in types]
        self._bound: _Bound | None = None
        self.burst_op = decode_layers_ops().decode_burst
        self.kernels["argmax_rows"] = fused_ops().kernel_addresses()["argmax_rows"]
        self.head: _Head | None = None
        self.softcap = 0.0

    def bind_head(self, head, softcap: float | None = None) -> None:
        """The logits head for `burst` (the model's packed logits linear, then Gemma's final
        softcap, tanh(logits / cap) * cap, when given): taken when it runs the layers' kernel (so a
        burst's logits are compute_logits' bits), else bursts stay off."""
        self.head = _Head.of(head, self.dtype, self.kernels["linear"] == _address(self.dtype))
        self.softcap = float(softcap or 0.0)

    @classmethod
    def for_model(cls, model) -> FusedDecode | None:
        """The fused decode for `model` (a LlamaForCausalLM with packed weights), or None where
        some layer would not run exactly the kernels decode_layers.cpp calls."""
        if not switch_on(ENV_SWITCH) or not hasattr(model, "layers") or len(model.layers) == 0:
            return None
        if None in (fused_ops(), blocked_linear_ops(), decode_layers_ops(), load_paged_attention_module()):
            return None
        embed, final = getattr(model, "embed_tokens", None), getattr(model, "norm", None)
        gemma3 = _is_gemma3_layer(model.layers[0])
        if (not isinstance(embed, torch.nn.Embedding) or not isinstance(final, RMSNorm) or final.unit_offset != gemma3
                or final.weight.dtype != embed.weight.dtype):
            return None
        kinds, limits, dtype, shape = set(), [], embed.weight.dtype, None
        for layer in model.layers:
            a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
            if _is_gemma3_layer(layer) != gemma3:
                return None
            if gemma3:
                norms = (*norms, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
            if a is None or m is None or None in norms or not all(isinstance(n, RMSNorm) for n in norms):
                return None
            qk_norms = (getattr(a, "q_norm", None), getattr(a, "k_norm", None))
            if qk_norms != (None, None):  # Qwen3's: plain RMSNorms over the head size, both there
                if not all(isinstance(n, RMSNorm) for n in qk_norms):
                    return None
                norms = (*norms, *qk_norms)
            if shape is None:  # what every layer must share with the first
                shape = (a.num_heads, a.num_kv_heads, a.head_dim, a.scale, norms[0].eps)
            activation_ok = (getattr(m, "activation", None) in _GELU_TANH) if gemma3 else getattr(m, "is_silu", False)
            if (dtype not in (torch.bfloat16, torch.float32) or not activation_ok
                    or any(n.unit_offset != gemma3 or n.eps != shape[4] or n.weight.dtype != dtype for n in norms)
                    or (a.num_heads, a.num_kv_heads, a.head_dim, a.scale, shape[4]) != shape):
                return None
            for proj in (getattr(a, "qkv_proj", None), getattr(a, "o_proj", None), getattr(m, "gate_up_proj", None),
                         getattr(m, "down_proj", None)):
                linear = None if proj is None else packed_forward(proj)
                if (isinstance(linear, PackedLinearWeight) and dtype == torch.bfloat16 and linear.blocked is not None
                        and linear.blocked_rows != 0):
                    kinds.add("blocked_linear_bf16")
                    if linear.blocked_rows is not None:
                        limits.append(linear.blocked_rows)
                elif isinstance(linear, BlockedLinearWeight) and dtype == torch.float32:
                    kinds.add("blocked_linear")
                    if linear.max_rows is not None:
                        limits.append(linear.max_rows)
                else:
                    return None
        if len(kinds) != 1:
            return None
        return cls(model, dtype, kinds.pop(), min(limits) if limits else None)

    def takes(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the fused call runs exactly as the layers would."""
        rows = input_ids.shape[0]
        if (meta.num_decode_tokens != rows or meta.kv_loads is not None or input_ids.dtype != torch.int64
                or not input_ids.is_cpu or (self.max_rows is not None and rows > self.max_rows)):
            return False
        ctx = meta.context_lens
        if ctx is None or ctx.dtype != torch.int32 or not ctx.is_contiguous():
            return False
        for sm in meta.spaces.values():
            if sm.slot_mapping.dtype != torch.int64 or not sm.slot_mapping.is_contiguous():
                return False
        return self._bind() is not None

    def _bind(self) -> _Bound | None:
        """The layers' caches, once the runner has bound them to TorchNativeAttention with its
        paged decode kernel; None (layer by layer) otherwise."""
        attn0 = self.layers[0].self_attn
        if self._bound is not None and attn0.k_cache is self._bound.k0:
            return self._bound
        caches = []
        for layer in self.layers:
            a = layer.self_attn
            if (not isinstance(a.backend, TorchNativeAttention) or not a.backend.paged_decode_in_use
                    or a.k_cache is None or a.k_cache.dtype not in (self.dtype, *FP8_DTYPES)
                    or a.k_cache.stride(-1) != 1
                    or a.v_cache.stride(-1) != 1):
                self._bound = None
                return None
            caches += [a.k_cache, a.v_cache]
        self._bound = _Bound(attn0.k_cache, caches)
        return self._bound

    def __call__(self, input_ids: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states for a step `takes` accepted (it bound the caches); ropes in
        self.dtype, one (cos, sin) per rope_keys entry."""
        tables, windows = [], []
        for space in self.spaces:
            sm = meta.spaces[space]
            tables += [sm.block_table if sm.block_table.dtype == torch.int32 else sm.block_table.to(torch.int32),
                       sm.slot_mapping]
            windows.append(-1 if sm.window is None else sm.window)
        return self.op(input_ids, self.embedding, self.kernels, self.weights, self.out_features, self._bound.caches,
                       tables, windows, self.layer_space, meta.context_lens, [t for rope in ropes for t in rope],
                       self.layer_rope, self.heads, self.kv_heads, self.head_dim, meta.page_size, self.scale,
                       self.eps, self.final_norm, self.final_eps, self.gemma3, self.embed_scale)

    def burst_rows(self) -> int:
        """Most decodes a burst takes: the head's and the layers' row limits (0: no head is bound,
        so no burst runs)."""
        if self.head is None:
            return 0
        limits = [n for n in (self.head.max_rows, self.max_rows) if n is not None]
        return min(limits) if limits else 1 << 30

    def burst_takes(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether `burst` runs these decodes: the step itself is one `takes` accepts, and the
        logits head runs the same kernel for this many rows."""
        return input_ids.shape[0] <= self.burst_rows() and self.takes(input_ids, meta)

    def burst(self, input_ids: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
              metas: list[AttentionMetadata]) -> torch.Tensor:
        """len(metas) greedy decode steps from input_ids in one call: the tokens [steps, T] that
        the step-by-step path (forward, compute_logits, the sampler's greedy argmax) would pick,
        bit for bit. metas[j] is step j's metadata (its pages allocated), ropes the (cos, sin)
        of every step's positions, step-major ([steps * T, 1, D]), one per rope_keys entry.
        Call after burst_takes(input_ids, metas[0])."""
        last = metas[-1]
        tables, slots, windows = [], [], []
        for space in self.spaces:
            bt = last.spaces[space].block_table  # the widest: it covers every step's pages
            tables.append(bt if bt.dtype == torch.int32 else bt.to(torch.int32))
            slots.append(torch.stack([m.spaces[space].slot_mapping for m in metas]))
            w = last.spaces[space].window
            windows.append(-1 if w is None else w)
        head = self.head
        return self.burst_op(len(metas), input_ids, self.embedding, self.kernels, self.weights, self.out_features,
                             self._bound.caches, tables, slots, windows, self.layer_space, metas[0].context_lens,
                             [t for rope in ropes for t in rope], self.layer_rope, self.heads, self.kv_heads,
                             self.head_dim, metas[0].page_size, self.scale, self.eps, self.final_norm, self.final_eps,
                             self.gemma3, self.embed_scale, head.weight, head.bias, head.out_features, self.softcap)
