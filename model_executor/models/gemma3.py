"""Gemma-3 text decoder (`Gemma3ForCausalLM`, model_type `gemma3_text`) over paged block spaces.

Built from the Llama-family pieces; what Gemma-3 does differently:
  norms            RMSNorm storing weight - 1 (unit_offset), four per layer: around attention
                   (input, post_attention) and around the MLP (pre_feedforward, post_feedforward),
                   each sub-block's output normed before the residual add
  q/k norm         per head, also unit-offset
  attention scale  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
  MLP              gelu_pytorch_tanh gate (hidden_activation)
  embedding        scaled by sqrt(hidden_size), the scale rounded to the model dtype first
  RoPE             one table per layer type: sliding layers use the local base, full layers the
                   global base with its scaling (config.rope_parameters[layer_type])
  spaces           sliding layers read the "swa" space, full layers the "full" space
  logits           tanh softcap when final_logit_softcapping is set; lm_head tied by default
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.attention_backends.metadata import AttentionMetadata
from hybridkv.model_executor.layers import RMSNorm, RotaryEmbedding, SiluAndMulMLP
from hybridkv.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, mlp_size, reduce_partial
from hybridkv.model_executor.parallel.state import TensorParallel

FULL, SLIDING = "full_attention", "sliding_attention"


class Gemma3Attention(LlamaAttention):
    """LlamaAttention with unit-offset q/k norms and Gemma's query_pre_attn_scalar scaling."""

    def __init__(self, config, layer_idx: int, window: int | None, flags: dict,
                 parallel: TensorParallel | None = None) -> None:
        super().__init__(config, layer_idx, window, flags, parallel)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, window: int | None, flags: dict,
                 parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.parallel = parallel
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = Gemma3Attention(config, layer_idx, window, flags, parallel)
        self.mlp = SiluAndMulMLP(config.hidden_size, mlp_size(config, parallel), act=config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        # .forward, not __call__, as in llama.py (no hooks; the per-call checks show in decode)
        attn = self.self_attn.forward(rope, self.input_layernorm.forward(hidden), meta, output_rows)
        if output_rows is not None:
            hidden = hidden[output_rows]
        hidden = hidden + self.post_attention_layernorm.forward(attn)
        mlp = reduce_partial(self.parallel, self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden)))
        return hidden + self.post_feedforward_layernorm.forward(mlp)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma-3 text-only causal LM. Inherits the space layout, logits packing and the fused
    qkv/gate_up weight loading of LlamaForCausalLM; replaces the layers, the RoPE tables and
    the embedding scale."""

    def __init__(self, config, max_positions: int, parallel: TensorParallel | None = None) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: the layers and RoPE differ
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # The paged backends run scaled_dot_product_attention, which has no softcap hook;
            # Gemma-3 checkpoints leave it unset (it was a Gemma-2 feature).
            raise ValueError("attn_logit_softcapping is not supported (Gemma-3 checkpoints do not set it)")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (embedding variants) is not supported: the engine is causal")
        self.config = config
        self.parallel = parallel
        flags = {
            "qkv_bias": bool(getattr(config, "attention_bias", False)),
            "o_bias": bool(getattr(config, "attention_bias", False)),
            "qk_norm": True,
            "mlp_bias": False,
        }
        windows = self.layer_windows(config)
        self.embed_tokens = self.make_embedding(config, parallel)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, windows[i], flags, parallel) for i in range(config.num_hidden_layers)
        )
        head_dim = self.layers[0].self_attn.head_dim
        # One table per layer type present: the local base differs from the global one, and only
        # the global one carries the rope scaling. Kept in a ModuleDict so the buffers follow the
        # model (the runner casts parameters only; tables stay float32 as in transformers).
        self.rotary_emb = nn.ModuleDict(
            {t: RotaryEmbedding(config, head_dim, max_positions, layer_type=t) for t in sorted(set(config.layer_types))}
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else self.make_head(config, parallel)
        self._packed_logits = None
        self._fused_decode = None

    @staticmethod
    def layer_windows(config) -> list[int | None]:
        # Gemma-3 always names each layer's type; sliding layers share config.sliding_window.
        return [config.sliding_window if t == SLIDING else None for t in config.layer_types]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward: the last layer runs past its attention on output_rows only,
        and a step the fused decode takes runs in one C++ call (the path below's bits)."""
        fused = self._fused_decode
        if fused is not None and fused.takes(input_ids, meta):
            hidden = fused(input_ids, self.fused_ropes(positions, fused), meta)
            return hidden if output_rows is None else hidden[output_rows]
        hidden = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weight dtype before multiplying (matters in bf16).
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        ropes = {t: emb.lookup(positions, hidden.dtype) for t, emb in self.rotary_emb.items()}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(ropes[layer.layer_type], hidden, meta, output_rows if i == last else None)
        return self.norm.forward(hidden)

    def fused_ropes(self, positions: torch.Tensor, fused) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.rotary_emb[t].lookup(positions, fused.dtype) for t in fused.rope_keys]

    def logits_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is None:  # a tensor-parallel rank other than 0
            return None
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
