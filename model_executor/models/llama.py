"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral): one implementation, config-driven.

Differences between the family members are flags read from config.json:
  q/k/v bias       Qwen2 (always), Llama (attention_bias)
  per-head q/k norm Qwen3
  sliding window   Mistral (every layer), Qwen2/Qwen3 (layer_types == "sliding_attention")
Full-attention layers read the "full" block space, sliding layers the "swa" space.

The forward passes call their submodules' `.forward` directly, not through nn.Module.__call__:
its hook and tracing checks cost a few microseconds per call, ~10 calls per layer, and nothing
here registers hooks. Single-stream decode of the demo model (Zen 3, AVX2, float32, one process,
alternating rounds): 27.1 -> 29.9-30.7 tok/s, +10-13%, outputs identical.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from hybridkv.attention_backends.metadata import AttentionMetadata
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.model_executor.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluAndMulMLP,
    apply_rotary,
    fast_linear,
    pack_linear_weights,
    packed_forward,
)
from hybridkv.model_executor.fused_decode import FusedDecode
from hybridkv.model_executor.huge_pages import HugePageArena
from hybridkv.model_executor.models.base import CausalLM, load_stacked_weights
from hybridkv.model_executor.parallel.layers import VocabParallelEmbedding
from hybridkv.model_executor.parallel.layout import DenseDecoderShard, HeadShard, VocabShard, split_evenly
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.quantization import QuantizedLinear


def reduce_partial(parallel: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's output summed over the ranks (x itself without tensor parallelism)."""
    return x if parallel is None else parallel.all_reduce(x)


def head_shard(config, parallel: TensorParallel | None) -> HeadShard:
    """The attention heads this rank holds (all of them without tensor parallelism)."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if parallel is None:
        return HeadShard(num_heads, num_kv_heads, 0, 0)
    return HeadShard.of(num_heads, num_kv_heads, parallel.rank, parallel.size)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, window: int | None, flags: dict,
                 parallel: TensorParallel | None = None) -> None:
        """parallel: this rank's share of the heads (q/k/v column-parallel, o_proj row-parallel)."""
        super().__init__()
        heads = head_shard(config, parallel)
        self.parallel = parallel
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.window = window
        self.space = "swa" if window is not None else "full"
        bias = flags["qkv_bias"]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=flags["o_bias"])
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags["qk_norm"] else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags["qk_norm"] else None
        # Bound by the model runner: this layer's K and V cache ([num_slots, Hkv, D] each).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output for every row of x, or for `output_rows` only: every row's
        K and V are written to the cache either way; the attention and the output projection
        run on those rows alone (the Q projection still runs on every row, fused with K and V's)."""
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Rotate q and k in one pass: fewer ops per layer matters at decode batch sizes.
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = apply_rotary(self.q_norm.forward(q.view(T, self.num_heads, self.head_dim)), *rope)
            k = apply_rotary(self.k_norm.forward(k.view(T, self.num_kv_heads, self.head_dim)), *rope)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.space, self.scale, output_rows)
        return reduce_partial(self.parallel, self.o_proj.forward(o.reshape(-1, self.q_size)))


def mlp_size(config, parallel: TensorParallel | None) -> int:
    """This rank's part of the MLP's intermediate size (gate/up column-, down row-parallel)."""
    if parallel is None:
        return config.intermediate_size
    start, stop = split_evenly(config.intermediate_size, parallel.rank, parallel.size, "intermediate_size")
    return stop - start


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, window: int | None, flags: dict,
                 parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.parallel = parallel
        self.self_attn = LlamaAttention(config, layer_idx, window, flags, parallel)
        self.mlp = SiluAndMulMLP(
            config.hidden_size, mlp_size(config, parallel), bias=flags["mlp_bias"], act=config.hidden_act
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, meta, output_rows: torch.Tensor | None = None):
        """-> (this layer's MLP output, the residual stream before it). `hidden` is the previous
        layer's MLP output, not yet added to `residual` (for the first layer: the embeddings, and
        residual None), so that every residual add runs fused with the norm that reads its sum.
        With `output_rows`, both come back for those rows only (see LlamaForCausalLM.forward)."""
        if residual is None:
            residual, x = hidden, self.input_layernorm.forward(hidden)
        else:
            residual, x = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn.forward(rope, x, meta, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        residual, x = self.post_attention_layernorm.add_forward(attn, residual)
        return reduce_partial(self.parallel, self.mlp.forward(x)), residual


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over paged block spaces."""

    supports_tensor_parallel = True

    # HF weight name suffix -> (our fused parameter, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_positions: int, parallel: TensorParallel | None = None) -> None:
        """parallel: build this rank's shard (model_executor/parallel/layout.py); None: the whole model."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        flags = self.family_flags(config)
        windows = self.layer_windows(config)
        self.embed_tokens = self.make_embedding(config, parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, windows[i], flags, parallel) for i in range(config.num_hidden_layers)
        )
        attn = self.layers[0].self_attn
        self.rotary_emb = RotaryEmbedding(config, attn.head_dim, max_positions)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else self.make_head(config, parallel)
        self._packed_logits = None  # layers.fast_linear of the logits matrix, set by pack_weights
        self._fused_decode: FusedDecode | None = None  # decode-only steps in one C++ call, set by pack_weights

    # -- tensor parallelism ----------------------------------------------------------------------
    @staticmethod
    def make_embedding(config, parallel: TensorParallel | None) -> nn.Embedding:
        """The token embedding: whole, or this rank's vocabulary rows (vocab-parallel)."""
        if parallel is None:
            return nn.Embedding(config.vocab_size, config.hidden_size)
        shard = VocabShard.of(config.vocab_size, parallel.rank, parallel.size)
        return VocabParallelEmbedding(shard, config.hidden_size, parallel)

    @staticmethod
    def make_head(config, parallel: TensorParallel | None) -> nn.Linear:
        """An untied LM head: whole, or this rank's vocabulary rows (its logits gathered on rank 0)."""
        rows = config.vocab_size if parallel is None else VocabShard.of(config.vocab_size, parallel.rank,
                                                                         parallel.size).padded
        return nn.Linear(config.hidden_size, rows, bias=False)

    def shard(self) -> DenseDecoderShard:
        """This rank's slices of the checkpoint (the shard loader reads only those)."""
        p, config, attn = self.parallel, self.config, self.layers[0].self_attn
        return DenseDecoderShard(
            p.rank, head_shard(config, p), attn.head_dim,
            split_evenly(config.intermediate_size, p.rank, p.size, "intermediate_size"),
            VocabShard.of(config.vocab_size, p.rank, p.size),
        )

    # -- family differences -------------------------------------------------------------------
    @staticmethod
    def family_flags(config) -> dict:
        mt = config.model_type
        attention_bias = bool(getattr(config, "attention_bias", False))
        return {
            "qkv_bias": mt == "qwen2" or attention_bias,
            "o_bias": attention_bias and mt != "qwen3",
            "qk_norm": mt == "qwen3",
            "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        }

    @staticmethod
    def layer_windows(config) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        n = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None)
        if window is None:
            return [None] * n
        if layer_types is None:  # Mistral: every layer slides
            return [window] * n
        return [window if t == "sliding_attention" else None for t in layer_types]

    # -- the model contract ------------------------------------------------------------------
    @classmethod
    def fp8_kv_cache_refusal(cls) -> str | None:
        return None  # every layer reads its cache through an AttentionBackend, which takes FP8 pools

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.layers]

    def space_specs(self, dtype: torch.dtype) -> list[SpaceSpec]:
        """One space per attention kind (full, sliding); a slot is a K and a V row of every layer
        of the space, in `dtype` (the KV pools' dtype: one byte an element for an FP8 cache)."""
        per_space: dict[str, list[LlamaAttention]] = {}
        for attn in self.attention_layers():
            per_space.setdefault(attn.space, []).append(attn)
        elt = torch.tensor([], dtype=dtype).element_size()
        return [
            SpaceSpec(
                name=name,
                tokens_per_slot=1,
                bytes_per_slot=sum(2 * a.num_kv_heads * a.head_dim * elt for a in layers),
                window=layers[0].window,
            )
            for name, layers in per_space.items()
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of `output_rows` only (the rows whose logits
        the step reads). Other rows and later steps read a layer only through its K/V, and in the
        last layer nothing after the attention feeds one, so that layer runs its attention,
        output projection, MLP and the final norm on the selected rows alone (only its Q/K/V
        projection and K/V write take every row): in a prompt chunk, 84% of a Llama layer's
        linear FLOPs and all its attention skipped for every row but the last (llama.cpp does
        the same). Each selected row gets the kernels a batch of that many rows gets, and the
        attention kernel's bits for it are the ones the whole chunk would give it."""
        fused = self._fused_decode
        if fused is not None and fused.takes(input_ids, meta):
            # Embedding, layers and final norm in one C++ call: the path below's bits.
            hidden = fused(input_ids, self.fused_ropes(positions, fused), meta)
            return hidden if output_rows is None else hidden[output_rows]
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.lookup(positions, hidden.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer.forward(rope, hidden, residual, meta, output_rows if i == last else None)
        return self.norm.add_forward(hidden, residual)[1]

    def decode_burst(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     metas: list[AttentionMetadata]) -> torch.Tensor | None:
        """Several greedy decode steps in one C++ call (FusedDecode.burst), where the fused decode
        takes the step and the logits head runs its linear kernel; else None."""
        fused = self._fused_decode
        if fused is None or not fused.burst_takes(input_ids, metas[0]):
            return None
        return fused.burst(input_ids, self.fused_ropes(positions, fused), metas)

    def decode_burst_rows(self) -> int:
        fused = self._fused_decode
        return 0 if fused is None else fused.burst_rows()

    def fused_ropes(self, positions: torch.Tensor, fused: FusedDecode) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (cos, sin) of `positions` for each of the fused decode's RoPE tables."""
        return [self.rotary_emb.lookup(positions, fused.dtype)]

    def logits_softcap(self) -> float | None:
        """The cap compute_logits applies after the head (Gemma's), or None."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of `hidden`'s rows; under tensor parallelism every rank computes its
        vocabulary columns and rank 0 gets them all (the other ranks get None)."""
        logits = self._head_logits(hidden)
        if self.parallel is not None:
            return self.parallel.gather_vocab(logits, self.config.vocab_size)
        return logits

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed_logits is not None:
            return self._packed_logits(hidden)
        if isinstance(self.lm_head, QuantizedLinear):  # an FP8 checkpoint that quantized the head too
            return self.lm_head(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.t()

    def linears_read_only_by_forward(self) -> list[nn.Linear]:
        """The decoder layers' projections (the fused decode reads the packed copies; an untied
        lm_head's parameter is read by the fused decode's logits, so it stays)."""
        return [m for m in self.layers.modules() if isinstance(m, nn.Linear)]

    def pack_weights(self, release: frozenset[int] = frozenset()) -> None:
        """Prepack every projection and the logits matrix for the CPU's fastest linear
        (layers.fast_linear), side by side in one arena in the order a step reads them."""
        arena = HugePageArena()
        pack_linear_weights(self, arena, release)
        # The fused decode runs every layer in one C++ call, with no all-reduce between them: a
        # sharded model runs layer by layer (and so takes no decode bursts either).
        self._fused_decode = FusedDecode.for_model(self) if self.parallel is None else None
        if isinstance(self.lm_head, QuantizedLinear):
            return
        # An untied head is an nn.Linear, which pack_linear_weights has packed already: that copy
        # serves the logits too (a second one would double the head's memory, vocab x hidden).
        packed_head = None if self.lm_head is None else packed_forward(self.lm_head)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self._packed_logits = packed_head if packed_head is not None else fast_linear(weight, arena=arena)
        if self._fused_decode is not None:
            self._fused_decode.bind_head(self._packed_logits, self.logits_softcap())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb" in name:
                return None
            if name.startswith("model."):
                name = name[len("model.") :]
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            return name

        load_stacked_weights(self, weights, rename, self.stacked_params)
