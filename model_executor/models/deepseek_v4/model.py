"""DeepseekV4ForCausalLM over six paged block spaces (swa, c4, c128, indexer, state_c4, state_c128).

Per token the model keeps: its SWA key in every layer (windowed), the compressor raw rows
of CSA/HCA layers (windowed `state`: only the rows an unfinished window still needs), and
once a window closes its C4 entry + indexer key (CSA) or C128 entry (HCA) for good. It
overrides the base model's allocate_kv_cache / build_attention_metadata / cast_to hooks.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from hybridkv.attention_backends.hybrid_metadata import (
    C4, C128, INDEXER, STATE_C4, STATE_C128, SWA, HybridAttentionMetadata, HybridLayout, build_hybrid_metadata,
    compressor_kinds,
)
from hybridkv.attention_backends.hisparse_buffers import HotBuffers
from hybridkv.attention_backends.hisparse_reads import build_hisparse_step
from hybridkv.attention_backends.metadata import StepSequences
from hybridkv.block_manager.kv_plan import KVCacheLayout
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.model_executor.huge_pages import host_kv_pool, kv_pool_on
from hybridkv.model_executor.models.base import CausalLM
from hybridkv.model_executor.models.deepseek_v4.attention import (
    CompressorCache, V4Attention, V4LayerCache, hybrid_backend,
)
from hybridkv.model_executor.models.deepseek_v4.config import CSA, V4Config
from hybridkv.model_executor.models.deepseek_v4.decoder_layer import V4DecoderLayer
from hybridkv.model_executor.models.deepseek_v4.mhc import HyperHead
from hybridkv.model_executor.models.deepseek_v4.mtp import V4MTPLayer
from hybridkv.model_executor.models.deepseek_v4.norms import V4RMSNorm
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope, inv_freq_from_params
from hybridkv.model_executor.models.deepseek_v4.sharding import V4Shard
from hybridkv.model_executor.models.deepseek_v4.weights import load_v4_weights
from hybridkv.model_executor.parallel.layers import VocabParallelEmbedding
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.quantization import quantization_config_of, quantized_weight_numel
from hybridkv.model_executor.step_cost import AttentionCost, StepCost

STATE_DTYPE = torch.float32  # compressor raw rows: kept in float32 whatever the model dtype
# Tensors transformers keeps in float32 in every dtype (its _keep_in_fp32_modules_strict).
_FP32_SUFFIXES = ("attn_sink", ".ape", "norm.weight", "hc_attn.fn", "hc_attn.base", "hc_attn.scale",
                  "hc_ffn.fn", "hc_ffn.base", "hc_ffn.scale", "hc_fn", "hc_base", "hc_scale")


class DeepseekV4ForCausalLM(CausalLM):
    # Page boundaries must be compression boundaries: 128 is a multiple of every V4 ratio.
    default_block_size = 128
    # Tensor parallelism (sharding.py), with or without expert parallelism for the routed experts.
    supports_tensor_parallel = True
    supports_expert_parallel = True
    supports_quantized_shards = True
    # A compressor pools a closing window's rows before it writes the step's rows to its ring, so
    # a verified token and its drafts run as one chunk (their rows come from the step itself).
    verify_rows_as_decodes = False
    # Speculative decoding with the checkpoint's MTP layer (mtp.py): built with mtp=True.
    supports_mtp = True

    @classmethod
    def fp8_kv_cache_refusal(cls) -> str | None:
        # swa, c4, c128 and indexer pools in FP8 (every V4 write quantizes, every read widens);
        # the compressor state stays float32 (STATE_DTYPE): its rows are pooled by a softmax
        # whose logits FP8 would shift.
        return None

    @classmethod
    def cpu_kernel_loaders(cls, dtype: torch.dtype) -> list:
        """The lightning indexer and the joint attention (hybrid_v4.py), the fused ops (RMSNorm,
        mHC's Sinkhorn) and the linears."""
        from hybridkv.attention_backends.cpu_kernels import load_indexer_topk, load_joint_attention
        from hybridkv.model_executor.cpu_kernels import blocked_linear_ops, fused_ops

        return [load_joint_attention, load_indexer_topk, blocked_linear_ops, fused_ops]

    def __init__(self, config, max_positions: int, parallel: TensorParallel | None = None, mtp: bool = False) -> None:
        """parallel: build this rank's shard (sharding.py); None: the whole model. mtp: with the
        checkpoint's MTP layer (speculative decoding's drafter; without it mtp.* is not loaded)."""
        super().__init__()
        cfg = V4Config.from_hf(config)
        self.config, self.cfg, self.parallel = config, cfg, parallel
        # The quantization config only matters to which slices a rank reads (block-aligned ones).
        quantization = quantization_config_of(config) if parallel is not None else None
        self.sharding = V4Shard.of(cfg, parallel, quantization)
        if parallel is not None and parallel.is_driver:
            V4Shard.check_every_rank(cfg, parallel, quantization)
        main_rope = InterleavedRope(inv_freq_from_params(cfg.main_rope, cfg.rope_dim, max_positions))
        compress_rope = InterleavedRope(inv_freq_from_params(cfg.compress_rope, cfg.rope_dim, max_positions))
        if parallel is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(self.sharding.vocab, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, main_rope, compress_rope, self.sharding, parallel)
                                    for i in range(cfg.num_layers))
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.hot_buffers: HotBuffers | None = None  # HiSparse, allocated by allocate_kv_cache when enabled
        self.state_rings: dict[str, int] | None = None  # set by allocate_kv_cache (HybridLayout.state_rings)
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size if parallel is None else self.sharding.vocab.padded,
                              bias=False)
        if mtp and parallel is not None:
            raise ValueError("speculative decoding with DeepSeek-V4's MTP layer is not supported with "
                             "tensor_parallel_size > 1")
        self.mtp = V4MTPLayer(cfg, main_rope, compress_rope) if mtp else None
        # With the MTP layer: every row's final streams of the last forward (before hc_head), the
        # MTP's input (model_executor/mtp_drafter.py reads them after the step).
        self.final_streams: torch.Tensor | None = None

    # -- block spaces ------------------------------------------------------------------------
    def space_specs(self, dtype: torch.dtype) -> list[SpaceSpec]:
        cfg = self.cfg
        elt = torch.tensor([], dtype=dtype).element_size()
        f32 = torch.tensor([], dtype=STATE_DTYPE).element_size()
        D, cI = cfg.head_dim, cfg.index_head_dim
        n_csa, n_hca = cfg.num_csa_layers, cfg.num_hca_layers
        specs = [SpaceSpec(SWA, 1, self.num_swa_layers * D * elt, window=cfg.sliding_window)]
        if n_csa:
            specs.append(SpaceSpec(C4, cfg.csa_ratio, n_csa * D * elt))
        if n_hca:
            specs.append(SpaceSpec(C128, cfg.hca_ratio, n_hca * D * elt))
        if n_csa:
            specs.append(SpaceSpec(INDEXER, cfg.csa_ratio, n_csa * cI * elt))
        # Raw compressor rows (C, Z) per token: CSA 2·2D (+ indexer 2·2cI), HCA 2·D. A closing
        # window reads back 2m rows (CSA, overlapping) or m (HCA): that is each state space's
        # window, and its ring, so a page holds 8 (CSA) or 128 (HCA) rows, not P. The window moves
        # a ratio-token block at a time (align): HCA reads only the open block's rows.
        row_bytes = {STATE_C4: f32 * n_csa * (4 * D + 4 * cI), STATE_C128: f32 * n_hca * 2 * D}
        for ratio, overlap, space in compressor_kinds(cfg.csa_ratio if n_csa else None,
                                                      cfg.hca_ratio if n_hca else None).values():
            rows = (2 if overlap else 1) * ratio
            specs.append(SpaceSpec(space, 1, row_bytes[space], window=rows, ring=rows, align=ratio))
        return specs

    @property
    def num_swa_layers(self) -> int:
        """Layers with a key in the swa space: every main layer, and the MTP layer when built (its
        sliding window is the same, and its keys are cached and tiered with the page)."""
        return self.cfg.num_layers + (self.mtp is not None)

    def step_cost(self) -> StepCost:
        """Hybrid attention: every layer reads the SWA window; a CSA layer also reads index_topk
        C4 entries (a constant per token) after its indexer scored all of them (one per csa_ratio
        tokens); an HCA layer reads every C128 entry. Only the routed experts a token picks count."""
        cfg = self.cfg
        blocks = list(self.layers) + ([self.mtp] if self.mtp is not None else [])  # the MTP runs every row too
        routed = sum(p.numel() for layer in blocks for name, p in layer.named_parameters()
                     if ".experts." in f".{name}")
        routed += sum(quantized_weight_numel(layer.ffn.experts) for layer in blocks)
        active = self.token_params() - routed + routed * cfg.num_experts_per_tok / max(1, cfg.n_routed_experts)
        per_key = 4.0 * cfg.num_heads * cfg.head_dim
        n_csa, n_hca = cfg.num_csa_layers, cfg.num_hca_layers
        attention = [AttentionCost(cfg.num_layers * per_key, window=cfg.sliding_window)]
        if n_csa:
            attention.append(AttentionCost(n_csa * 2.0 * cfg.index_n_heads * cfg.index_head_dim, stride=cfg.csa_ratio))
        if n_hca:
            attention.append(AttentionCost(n_hca * per_key, stride=cfg.hca_ratio))
        return StepCost(2.0 * active + n_csa * per_key * cfg.index_topk, tuple(attention), 2.0 * self.logits_params())

    def hisparse_layers(self) -> tuple[int, int] | None:
        """(CSA layers, index_topk): what HiSparse hot buffers are sized by; None without CSA layers."""
        return (self.cfg.num_csa_layers, self.cfg.index_topk) if self.cfg.num_csa_layers else None

    def layout(self, page_size: int) -> HybridLayout:
        cfg = self.cfg
        return HybridLayout(
            page_size, cfg.sliding_window,
            cfg.csa_ratio if cfg.num_csa_layers else None,
            cfg.hca_ratio if cfg.num_hca_layers else None,
            self.state_rings,
        )

    def allocate_kv_cache(
        self, layout: KVCacheLayout, backend, dtype: torch.dtype, device: torch.device, prefault: bool = False
    ) -> dict[str, list[torch.Tensor]]:
        """Allocate every space's tensors and bind each layer's views. V4's layers use their own
        hybrid backend (HybridV4Attention, or its Triton kernels when `backend` is the Triton
        one: hybrid_backend), not `backend` itself (None is fine). Zeroed (huge_pages.kv_pool_on:
        taken as pages are written, or with `prefault` on huge pages and touched here), so the null
        page every masked or padded read of the hybrid metadata points at (its slot 0) is zero.
        Returns every tensor of each space (swa; c4/c128 and indexer per layer; state_c4 / state_c128 x2 per
        compressor), slots on dim -2: a page copy to the host tier must cover all of them.

        HiSparse (layout.hot_buffers): the c4 space is in layout.host_spaces, so its pool -- the
        mirror of every request's C4 history -- is allocated in host memory (pinned for a CUDA
        device), and each CSA layer gets a hot buffer on `device`, with the HotBuffers bookkeeping
        there too (auxiliary_kv_tensors). Every other space is on `device`."""
        device = torch.device(device)
        shape = layout.hot_buffers
        # the rings as the block manager sized them (wider than a window with speculative decoding)
        self.state_rings = {name: spec.ring for name, spec in layout.specs.items() if spec.ring is not None}
        if layout.host_spaces - {C4} or (C4 in layout.host_spaces and shape is None):
            raise ValueError(f"DeepSeek-V4 reads only its c4 space from host memory, through HiSparse's hot buffers "
                             f"(host spaces {sorted(layout.host_spaces)}, hot buffers {shape})")
        slots = {name: layout.slots(name) for name in layout.specs}
        caches: dict[str, list[torch.Tensor]] = {name: [] for name in layout.specs}
        pinned = device.type == "cuda" and torch.cuda.is_available()

        def pool(space: str, *shape: int, dtype: torch.dtype) -> torch.Tensor:
            if space in layout.host_spaces:
                t = host_kv_pool(*shape, dtype=dtype, pinned=pinned, prefault=prefault)
            else:
                t = kv_pool_on(device, *shape, dtype=dtype, prefault=prefault)
            caches[space].append(t)
            return t

        D, cI = self.cfg.head_dim, self.cfg.index_head_dim
        swa = pool(SWA, self.num_swa_layers, slots[SWA], D, dtype=dtype)
        self.hot_buffers = HotBuffers.from_shape(shape, device) if shape is not None else None
        csa_ordinal = 0
        for i, layer in enumerate(self.layers):
            attn = layer.attn
            cache = V4LayerCache(swa=swa[i])
            if attn.layer_type == CSA and self.hot_buffers is not None:
                cache.hot = torch.zeros(self.hot_buffers.num_slots, D, dtype=dtype, device=device)
                cache.hot_layer = csa_ordinal
                csa_ordinal += 1
            if attn.compressor is not None:
                width = attn.compressor.row_width
                space = C4 if attn.layer_type == CSA else C128
                state = STATE_C4 if attn.layer_type == CSA else STATE_C128
                cache.compressor = CompressorCache(
                    pool(state, slots[state], width, dtype=STATE_DTYPE),
                    pool(state, slots[state], width, dtype=STATE_DTYPE),
                    pool(space, slots[space], D, dtype=dtype),
                )
            if attn.indexer is not None:
                width = attn.indexer.compressor.row_width
                cache.indexer = CompressorCache(
                    pool(STATE_C4, slots[STATE_C4], width, dtype=STATE_DTYPE),
                    pool(STATE_C4, slots[STATE_C4], width, dtype=STATE_DTYPE),
                    pool(INDEXER, slots[INDEXER], cI, dtype=dtype),
                )
            attn.cache = cache
            attn.backend = hybrid_backend(getattr(backend, "name", None))
        if self.mtp is not None:  # the last layer of the swa pool
            self.mtp.attn.cache = V4LayerCache(swa=swa[self.cfg.num_layers])
            self.mtp.attn.backend = hybrid_backend(getattr(backend, "name", None))
        return {name: ts for name, ts in caches.items() if ts}

    def auxiliary_kv_tensors(self) -> dict[str, list[torch.Tensor]]:
        """HiSparse's device state beyond the spaces' pools: every CSA layer's hot buffer and the
        HotBuffers bookkeeping, under "hot_buffer" ({} with HiSparse off)."""
        if self.hot_buffers is None:
            return {}
        hot = [layer.attn.cache.hot for layer in self.layers if layer.attn.cache.hot is not None]
        return {"hot_buffer": hot + self.hot_buffers.tables()}

    def build_attention_metadata(
        self, seqs: StepSequences, windows: dict[str, int | None], page_size: int
    ) -> HybridAttentionMetadata:
        """Per-step slot mappings, compression plans and query blocks (the windows are the
        model's own: HybridLayout carries them)."""
        layout = self.layout(page_size)
        meta = build_hybrid_metadata(seqs, layout)
        if self.hot_buffers is not None:
            meta.hisparse = build_hisparse_step(seqs, meta, layout, self.hot_buffers)
        return meta

    def cast_to(self, dtype: torch.dtype) -> None:
        """Cast to the model dtype except the tensors V4 keeps in float32."""
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype)

    # -- the model contract ------------------------------------------------------------------
    def attention_layers(self) -> list[V4Attention]:
        return [layer.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: HybridAttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every row through every layer (the last layer's compression state and indexer keys
        need all of them); `output_rows` selects the rows returned, before the head's mixing."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, meta, input_ids)
        if meta.hisparse is not None:  # the step's new C4 entries land in the host mirror
            meta.hisparse.mirror.flush()
        if self.mtp is not None:
            self.final_streams = streams
        if output_rows is not None:
            streams = streams[output_rows]
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of `hidden`'s rows; under tensor parallelism every rank computes its
        vocabulary columns and rank 0 gets them all (the other ranks get None)."""
        logits = self.head(hidden)
        if self.parallel is not None:
            return self.parallel.gather_vocab(logits, self.cfg.vocab_size)
        return logits

    def shard(self) -> V4Shard:
        """This rank's slices of the checkpoint (the shard loader reads only those)."""
        return self.sharding

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_v4_weights(self, weights, self.sharding.local_name if self.parallel is not None else None,
                        mtp=self.mtp is not None)
