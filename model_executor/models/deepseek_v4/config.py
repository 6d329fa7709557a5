"""DeepSeek-V4 hyper-parameters, read once from the transformers config.

transformers' DeepseekV4Config already folds the legacy fields (compress_ratios,
compress_rate_csa/hca, num_hash_layers, qk_rope_head_dim, flat rope_scaling) into
layer_types / compress_rates / mlp_layer_types / rope_parameters{main, compress}; this
module reads those into one frozen dataclass so the layers never touch the raw config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: dict = field(hash=False)
    compress_rope: dict = field(hash=False)

    @property
    def num_csa_layers(self) -> int:
        return sum(t == CSA for t in self.layer_types)

    @property
    def num_hca_layers(self) -> int:
        return sum(t == HCA for t in self.layer_types)

    def ratio(self, layer_type: str) -> int:
        return {CSA: self.csa_ratio, HCA: self.hca_ratio}[layer_type]

    @classmethod
    def from_hf(cls, config) -> "V4Config":
        g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
        n = config.num_hidden_layers
        layer_types = g("layer_types")
        if layer_types is None and g("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[r] for r in g("compress_ratios")]
        if layer_types is None:
            raise ValueError("DeepSeek-V4 config.json needs layer_types (or the legacy compress_ratios)")
        layer_types = tuple(layer_types[:n])
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        if bad or len(layer_types) != n:
            raise ValueError(f"DeepSeek-V4 layer_types must list {n} entries from {LAYER_TYPES}, got {list(layer_types)}")
        mlp_types = g("mlp_layer_types")
        if mlp_types is None:
            n_hash = g("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        mlp_types = tuple(mlp_types[:n])
        if any(t not in MLP_TYPES for t in mlp_types) or len(mlp_types) != n:
            raise ValueError(f"DeepSeek-V4 mlp_layer_types must list {n} entries from {MLP_TYPES}, got {list(mlp_types)}")
        rates = dict(g("compress_rates") or {})
        csa_ratio = int(rates.get(CSA, g("compress_rate_csa", 4)))
        hca_ratio = int(rates.get(HCA, g("compress_rate_hca", 128)))
        head_dim = config.head_dim
        partial = g("partial_rotary_factor")
        rope_dim = int(head_dim * partial) if partial is not None else int(g("qk_rope_head_dim", head_dim))
        if rope_dim % 2 or rope_dim > head_dim or rope_dim > config.index_head_dim:
            raise ValueError(f"DeepSeek-V4 rope dim {rope_dim} must be even and fit head_dim and index_head_dim")
        rope = g("rope_parameters") or {}
        main = dict(rope.get("main") or {"rope_type": "default", "rope_theta": g("rope_theta", 10000.0)})
        compress = dict(rope.get("compress") or {"rope_type": "default", "rope_theta": g("compress_rope_theta", 160000.0)})
        if config.num_key_value_heads not in (None, 1):
            raise ValueError(f"DeepSeek-V4 shares one K=V head; num_key_value_heads={config.num_key_value_heads}")
        if config.num_attention_heads % config.o_groups:
            raise ValueError("num_attention_heads must be a multiple of o_groups")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=n,
            num_heads=config.num_attention_heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=config.q_lora_rank,
            o_groups=config.o_groups,
            o_lora_rank=config.o_lora_rank,
            sliding_window=config.sliding_window,
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            csa_ratio=csa_ratio,
            hca_ratio=hca_ratio,
            index_n_heads=config.index_n_heads,
            index_head_dim=config.index_head_dim,
            index_topk=config.index_topk,
            hc_mult=config.hc_mult,
            hc_sinkhorn_iters=config.hc_sinkhorn_iters,
            hc_eps=float(config.hc_eps),
            n_routed_experts=config.n_routed_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            n_shared_experts=g("n_shared_experts", 1) or 0,
            moe_intermediate_size=config.moe_intermediate_size,
            routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
            scoring_func=g("scoring_func", "sqrtsoftplus"),
            swiglu_limit=float(g("swiglu_limit", 10.0) or 0.0),
            rms_norm_eps=float(config.rms_norm_eps),
            main_rope=main,
            compress_rope=compress,
        )
