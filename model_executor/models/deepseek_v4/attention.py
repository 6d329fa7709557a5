"""DeepSeek-V4 attention block (sliding, CSA and HCA layers share it).

  c_q = q_norm(wq_a x);  q = RoPE(unweightedRMS(wq_b c_q per head))
  k = v = RoPE(norm(wkv x))          one shared head
  compressors (CSA/HCA) turn closed token windows into entries; the CSA indexer picks top-k
  o = joint softmax over [SWA window | entries | sink] (hybrid backend)
  o = RoPE⁻¹(o) at the query position (values carried RoPE), then grouped output projection.
Sliding layers rotate with the main θ, CSA/HCA layers with the compress θ (+YaRN) for
everything: q, k, entries and indexer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.attention_backends.hisparse_reads import HiSparseLayer, HiSparseStep, prepare_layer, write_entries
from hybridkv.attention_backends.hybrid_metadata import C4, C128, INDEXER, HybridAttentionMetadata
from hybridkv.attention_backends.hybrid_v4 import HybridV4Attention, IndexerQuery
from hybridkv.model_executor.models.deepseek_v4.compressor import Compressor
from hybridkv.model_executor.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from hybridkv.model_executor.models.deepseek_v4.indexer import Indexer
from hybridkv.model_executor.models.deepseek_v4.norms import V4RMSNorm, rms_normalize
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope
from hybridkv.model_executor.models.deepseek_v4.sharding import V4Shard
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.quantization import QuantizedLinear


@dataclass
class CompressorCache:
    """Paged tensors of one compressor: raw rows in its state ring, entries in their space."""

    state_kv: torch.Tensor  # [state slots, κD] float32
    state_gate: torch.Tensor  # [state slots, κD] float32
    entries: torch.Tensor  # [entry slots, D]


@dataclass
class V4LayerCache:
    """This layer's views of the block spaces (bound by the model's allocate_kv_cache)."""

    swa: torch.Tensor  # [swa slots, D]
    compressor: CompressorCache | None = None  # c4 (CSA) or c128 (HCA) entries
    indexer: CompressorCache | None = None  # indexer keys (CSA)
    # HiSparse: this CSA layer's hot buffers, on the device (compressor.entries is then the c4
    # mirror, in host memory), and its ordinal among the CSA layers (HotBuffers' layer index).
    hot: torch.Tensor | None = None
    hot_layer: int = 0

    def paged_tensors(self) -> list[torch.Tensor]:
        """Every block-space tensor this layer reads (what host-tier load-backs may write)."""
        out = [self.swa]
        for c in (self.compressor, self.indexer):
            if c is not None:
                out += [c.state_kv, c.state_gate, c.entries]
        return out


def hybrid_backend(attention_backend: str | None) -> HybridV4Attention:
    """The V4 layers' backend for the runner's choice: the Triton kernels when it is "triton"."""
    if attention_backend == "triton":
        from hybridkv.attention_backends.triton_attention.hybrid_v4 import TritonHybridV4Attention

        return TritonHybridV4Attention()
    return HybridV4Attention()


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_idx: int, main_rope: InterleavedRope, compress_rope: InterleavedRope,
                 shard: V4Shard | None = None, parallel: TensorParallel | None = None) -> None:
        """shard / parallel: this tensor-parallel rank's query heads and output groups (sharding.py);
        the KV head, compressors and indexer stay whole. None: the whole layer."""
        super().__init__()
        shard = shard if shard is not None else V4Shard.of(cfg, None)
        self.parallel = parallel
        self.layer_type = cfg.layer_types[layer_idx]
        self.num_heads, self.head_dim = shard.num_heads, cfg.head_dim
        self.o_groups, self.eps = shard.num_groups, cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        d, D, H = cfg.hidden_size, cfg.head_dim, shard.num_heads
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(d, D, bias=False)
        self.norm = V4RMSNorm(D, cfg.rms_norm_eps)
        # Grouped output projection: rows [g*d_g, (g+1)*d_g) of wo_a act on head group g.
        self.wo_a = nn.Linear(H * D // self.o_groups, self.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.o_groups * cfg.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(H))  # float32 in every dtype
        self.rope = main_rope if self.layer_type == SLIDING else compress_rope
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.layer_type == CSA:
            self.compressor = Compressor(d, D, cfg.csa_ratio, True, cfg.rms_norm_eps, compress_rope)
            self.indexer = Indexer(cfg, compress_rope)
        elif self.layer_type == HCA:
            self.compressor = Compressor(d, D, cfg.hca_ratio, False, cfg.rms_norm_eps, compress_rope)
        # Bound by the model runner (DeepseekV4ForCausalLM.allocate_kv_cache).
        self.cache: V4LayerCache | None = None
        self.backend = HybridV4Attention()

    @property
    def plan_kind(self) -> str | None:
        return {CSA: "csa", HCA: "hca"}.get(self.layer_type)

    def _compress(self, comp: Compressor, cache: CompressorCache, x: torch.Tensor, meta: HybridAttentionMetadata,
                  out_space: str, mirror: HiSparseStep | None = None) -> torch.Tensor | None:
        """Pool every window that closed this step (from this step's raw rows and the ring's
        earlier ones), then keep the rows a later window may read in the ring. Returns the new
        entries [E, D] (None: no window closed). mirror: HiSparse's step, through which the
        entries reach their space when it is the host mirror."""
        kv, gate = comp.project(x)
        plan = meta.plans[self.plan_kind]
        entries = None
        if plan.num_entries:
            entries = comp.pool(
                plan.gather_rows(cache.state_kv, kv), plan.gather_rows(cache.state_gate, gate), plan.row_valid,
                plan.positions, x.dtype,  # the model dtype; the write stores them as the cache does (FP8 too)
            )
            if mirror is not None:
                write_entries(mirror, cache.entries, plan.out_slots[out_space], entries, self.backend.write)
            else:
                self.backend.write(cache.entries, plan.out_slots[out_space], entries)
        # After the pooling: a ring slot written now may still hold a row the pooling read.
        self.backend.write(cache.state_kv, plan.write_slots, kv[plan.write_rows])
        self.backend.write(cache.state_gate, plan.write_slots, gate[plan.write_rows])
        return entries

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: HybridAttentionMetadata) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        cache = self.cache
        if meta.kv_loads is not None:  # host-tier load-backs into this layer's pages land first
            meta.kv_loads.wait(*cache.paged_tensors())
        q_latent = self.q_norm(self.wq_a(x))
        q = rms_normalize(self.wq_b(q_latent).view(T, H, D), self.eps)
        q = self.rope(q, positions)
        kv = self.rope(self.norm(self.wkv(x)), positions)
        self.backend.write(cache.swa, meta.swa_slot_mapping, kv)

        entry_cache, entry_space, indexer_query, hisparse = None, None, None, None
        if self.layer_type == CSA:
            step = meta.hisparse if cache.hot is not None else None
            fresh = self._compress(self.compressor, cache.compressor, x, meta, C4, mirror=step)
            self._compress(self.indexer.compressor, cache.indexer, x, meta, INDEXER)
            iq, iw = self.indexer.queries(x, q_latent, positions)
            indexer_query = IndexerQuery(iq, iw, cache.indexer.entries, INDEXER, self.indexer.topk, self.indexer.scale)
            entry_cache, entry_space = cache.compressor.entries, C4
            if step is not None:
                hisparse = HiSparseLayer(step, cache.hot_layer, cache.hot)
                prepare_layer(step, cache.hot_layer, cache.hot, entry_cache, fresh, self.backend.swap_in)
        elif self.layer_type == HCA:
            self._compress(self.compressor, cache.compressor, x, meta, C128)
            entry_cache, entry_space = cache.compressor.entries, C128

        o = self.backend.forward(q, cache.swa, meta, self.attn_sink, self.scale, entry_cache, entry_space, indexer_query,
                                 hisparse)
        o = self.rope(o, positions, inverse=True)
        G = self.o_groups
        grouped = o.reshape(T, G, -1)  # heads are contiguous within a group
        if isinstance(self.wo_a, QuantizedLinear):  # block-quantized: each group's rows dequantized in tiles
            u = self.wo_a.grouped_forward(grouped).reshape(T, -1)
        else:
            w = self.wo_a.weight.view(G, -1, grouped.shape[-1])  # [G, d_g, H*D/G]
            u = torch.einsum("tgi,gri->tgr", grouped, w).reshape(T, -1)
        out = self.wo_b(u)
        return out if self.parallel is None else self.parallel.all_reduce(out)  # row-parallel wo_b
