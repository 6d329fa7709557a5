"""Which part of DeepSeek-V4 each tensor-parallel rank holds (the SGLang / vLLM layout).

- attention: the query heads are split evenly (wq_b column-parallel by heads, attn_sink by
  heads); the grouped output projection follows them by head groups: a rank holds the wo_a rows
  of its groups and the matching o_groups * o_lora_rank input columns of wo_b (row-parallel),
  whose partial outputs are all-reduced. num_heads and o_groups must both divide evenly.
- everything else of attention is replicated: the single shared KV head (wkv and its norm),
  wq_a / q_norm, the compressors, the indexer (its keys and its queries), and so every block
  space (SWA keys, C4 / C128 entries, indexer keys, compressor state). Every rank computes the
  same KV and writes it into its own copy of the spaces. This is what SGLang does for MLA's
  single latent head without DP attention: one KV head cannot be split across ranks, and keeping
  it whole means the spaces, their pages and the step's KV plan are the same on every rank, so
  the driver's one block manager plans for all of them.
- mHC (the hyper-connections), the norms and the routers are replicated (every rank routes the
  same way).
- MoE without expert parallelism: every routed expert and the shared expert are split on their
  intermediate size (w1 / w3 column-, w2 row-parallel). With expert parallelism rank r holds the
  whole routed experts [r * E / size, (r + 1) * E / size) and never reads the others; the
  shared expert stays split. Either way the layer's partial outputs take one all-reduce.
- the embedding and the head are vocab-parallel, as for dense models.

Quantized checkpoints (FP8 128x128 blocks, MXFP4 experts) are sliced codes and scale together
(parallel/block_slices.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from hybridkv.model_executor.models.deepseek_v4.config import V4Config
from hybridkv.model_executor.models.deepseek_v4.weights import canonical_name
from hybridkv.model_executor.parallel.block_slices import BlockGeometry
from hybridkv.model_executor.parallel.layout import Slice, VocabShard, split_evenly
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.quantization import QuantizationConfig
from hybridkv.model_executor.quantization.config import MXFP4_GROUP_SIZE
from hybridkv.model_executor.quantization.pairing import WEIGHT_SUFFIX, scale_owner

_ATTN = re.compile(r"^layers\.\d+\.attn\.(wq_b|wo_a|wo_b)\.weight$|^layers\.\d+\.attn\.attn_sink$")
_SHARED = re.compile(r"^layers\.\d+\.ffn\.shared_experts\.(w[123])\.weight$")
_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts\.)(\d+)(\.w[123]\.weight)$")


@dataclass(frozen=True)
class V4Shard:
    """One rank's part of a DeepSeek-V4 model. Ranges are [start, stop)."""

    rank: int
    size: int
    head_dim: int
    o_lora_rank: int
    heads: tuple[int, int]  # query heads
    groups: tuple[int, int]  # output-projection head groups (they hold exactly `heads`)
    shared_mlp: tuple[int, int]  # the shared expert's intermediate columns
    expert_mlp: tuple[int, int]  # each routed expert's intermediate columns (whole under EP)
    experts: tuple[int, int]  # routed experts held (all of them without EP)
    expert_parallel: bool
    vocab: VocabShard
    quantization: QuantizationConfig | None = None

    @classmethod
    def of(cls, cfg: V4Config, parallel: TensorParallel | None,
           quantization: QuantizationConfig | None = None) -> "V4Shard":
        """The layout of `parallel`'s rank (the whole model for None); ValueError naming the
        constraint a size does not meet."""
        rank, size = (0, 1) if parallel is None else (parallel.rank, parallel.size)
        ep = parallel is not None and parallel.expert_parallel
        if cfg.num_heads % size or cfg.o_groups % size:
            raise ValueError(f"tensor_parallel_size={size} must divide DeepSeek-V4's num_attention_heads "
                             f"({cfg.num_heads}) and o_groups ({cfg.o_groups}): each rank holds whole head "
                             "groups of the grouped output projection")
        heads, groups = cfg.num_heads // size, cfg.o_groups // size
        f = cfg.moe_intermediate_size
        shared = split_evenly(f, rank, size, "moe_intermediate_size")
        if ep:
            if cfg.n_routed_experts % size:
                raise ValueError(f"enable_expert_parallel: tensor_parallel_size={size} must divide the model's "
                                 f"n_routed_experts ({cfg.n_routed_experts}): each rank holds whole experts")
            experts, expert_mlp = split_evenly(cfg.n_routed_experts, rank, size, "n_routed_experts"), (0, f)
        else:
            experts, expert_mlp = (0, cfg.n_routed_experts), shared
        return cls(rank, size, cfg.head_dim, cfg.o_lora_rank, (rank * heads, (rank + 1) * heads),
                   (rank * groups, (rank + 1) * groups), shared, expert_mlp, experts, ep,
                   VocabShard.of(cfg.vocab_size, rank, size), quantization)

    @classmethod
    def check_every_rank(cls, cfg: V4Config, parallel: TensorParallel,
                         quantization: QuantizationConfig | None) -> None:
        """Raise (naming the tensor and the alignment) if any rank's slice of a quantized weight
        would not be block-aligned: in the driver, before a worker starts or a byte is read."""
        if quantization is None:
            return
        for rank in range(parallel.size):
            shard = cls.of(cfg, TensorParallel(rank, parallel.size, parallel.expert_parallel), quantization)
            first = f"layers.0.ffn.experts.{shard.experts[0]}"
            for name in ("layers.0.attn.wq_b", "layers.0.attn.wo_a", "layers.0.attn.wo_b",
                         "layers.0.ffn.shared_experts.w1", "layers.0.ffn.shared_experts.w2",
                         f"{first}.w1", f"{first}.w2"):
                shard.slice_of(name + WEIGHT_SUFFIX)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_groups(self) -> int:
        return self.groups[1] - self.groups[0]

    @property
    def num_experts(self) -> int:
        return self.experts[1] - self.experts[0]

    def local_name(self, name: str) -> str:
        """Our (canonical) parameter name -> this rank's module name: a routed expert's global id
        becomes its index among the rank's experts."""
        m = _EXPERT.match(name)
        if m is None:
            return name
        return f"{m.group(1)}{int(m.group(2)) - self.experts[0]}{m.group(3)}"

    # -- checkpoint slices -----------------------------------------------------------------------
    def slice_of(self, name: str) -> Slice | None:
        """The rank's slice of checkpoint tensor `name` (either naming scheme, weights.py), None:
        held whole. A block scale is cut like its weight (block_slices.py)."""
        owner = scale_owner(name)
        if owner is not None and self.quantization is not None:
            weight = owner + WEIGHT_SUFFIX
            part = self._logical_slice(weight)
            if part is None or part.skip:
                return part
            return self._geometry(weight).scale_slice(weight, part)
        part = self._logical_slice(name)
        if (part is None or part.skip or self.quantization is None or part.length is not None
                or not name.endswith(WEIGHT_SUFFIX)):
            return part  # held whole, not read, or the (never quantized) vocab-parallel embedding / head
        return self._geometry(name).codes_slice(name, part)

    def _geometry(self, name: str) -> BlockGeometry:
        """How the checkpoint stores weight `name`: MXFP4 routed experts when expert_dtype is
        fp4, FP8 blocks otherwise."""
        q = self.quantization
        if q.allows_fp4 and _EXPERT.match(canonical_name(name) or ""):
            return BlockGeometry((1, MXFP4_GROUP_SIZE), packed=2, kind="MXFP4")
        return BlockGeometry(q.weight_block)

    def _logical_slice(self, name: str) -> Slice | None:
        """The slice of the (dense, logical) tensor `name`."""
        if self.size == 1:
            return None
        ours = canonical_name(name)
        if ours is None:
            return Slice(skip=True)  # the MTP layers: never read
        parts = ours.split(".")
        D, R = self.head_dim, self.o_lora_rank
        m = _ATTN.match(ours)
        if m:
            module = m.group(1)
            if module is None:  # attn_sink
                return Slice(0, *self.heads)
            if module == "wq_b":
                return Slice(0, self.heads[0] * D, self.heads[1] * D)
            lora = (self.groups[0] * R, self.groups[1] * R)  # the groups' o_lora_rank rows of wo_a, columns of wo_b
            return Slice(0, *lora) if module == "wo_a" else Slice(1, *lora)
        m = _SHARED.match(ours)
        if m:
            return Slice(1 if m.group(1) == "w2" else 0, *self.shared_mlp)
        m = _EXPERT.match(ours)
        if m:
            if not self.experts[0] <= int(m.group(2)) < self.experts[1]:
                return Slice(skip=True)
            if self.expert_parallel:
                return None  # whole experts
            return Slice(1 if parts[-2] == "w2" else 0, *self.expert_mlp)
        if ours in ("embed_tokens.weight", "head.weight"):
            return Slice(0, self.vocab.start, self.vocab.stop, self.vocab.padded)
        return None
