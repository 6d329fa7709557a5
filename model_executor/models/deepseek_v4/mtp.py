"""DeepSeek-V4's multi-token prediction (MTP) layer, the drafter of speculative decoding.

As in DeepSeek's reference (MTPBlock(Block)), it is one more V4 decoder layer with a head of its
own around it. For main-model position i, whose final hyper-connection streams h_i [hc, d]
(before the model's hc_head) predicted token i+1:

    e = enorm(embed(t_{i+1}))              the embedding is the main model's
    x = e_proj(e) (broadcast over streams) + h_proj(hnorm(h_i))
    x = DecoderLayer(x)                    sliding-window attention only (no compressor, no
                                           indexer), a routed MoE with the gate bias (never hashed)
    logits = head(norm(hc_head(x)))        its own hc_head_* and norm, the main model's head

which predicts token i+2. Chained, x (the layer's output streams) stands in for h: the next step
reads x and the token just drafted. The layer's id is num_hidden_layers, past every main layer,
which is why it is sliding and top-k routed (released configs list ratio 0 for it).

Checkpoint names: `mtp.0.<name>` (the original release) or `model.mtp.0.<name>`, where <name> is
a decoder layer's (attn.*, ffn.*, attn_norm, ffn_norm, hc_attn_* / hc_ffn_*) or e_proj, h_proj,
enorm, hnorm, norm, hc_head_fn / hc_head_base / hc_head_scale. Our module mirrors them under
`mtp.`, with the main layers' hyper-connection renames (weights.canonical_name).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridkv.attention_backends.hybrid_metadata import HybridAttentionMetadata
from hybridkv.model_executor.models.deepseek_v4.config import SLIDING, V4Config
from hybridkv.model_executor.models.deepseek_v4.decoder_layer import V4DecoderLayer
from hybridkv.model_executor.models.deepseek_v4.mhc import HyperHead
from hybridkv.model_executor.models.deepseek_v4.norms import V4RMSNorm
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope
from hybridkv.model_executor.models.deepseek_v4.sharding import V4Shard


def mtp_layer_config(cfg: V4Config) -> V4Config:
    """The main config with the MTP layer appended at index num_layers: sliding, top-k routed."""
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + 1, layer_types=cfg.layer_types + (SLIDING,),
                               mlp_layer_types=cfg.mlp_layer_types + ("moe",))


class V4MTPLayer(V4DecoderLayer):
    """MTPBlock: the decoder layer (its modules directly under mtp.*, as in the checkpoint) plus
    the projections, norms and hc_head that wrap it."""

    def __init__(self, cfg: V4Config, main_rope: InterleavedRope, compress_rope: InterleavedRope) -> None:
        layer_cfg = mtp_layer_config(cfg)
        super().__init__(layer_cfg, cfg.num_layers, main_rope, compress_rope, V4Shard.of(layer_cfg, None), None)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = V4RMSNorm(d, eps)
        self.hnorm = V4RMSNorm(d, eps)
        self.norm = V4RMSNorm(d, eps)
        self.hc_head = HyperHead(cfg.hc_mult, d, cfg.hc_eps, eps)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Module,  # type: ignore[override]
                positions: torch.Tensor, meta: HybridAttentionMetadata) -> torch.Tensor:
        """streams [T, hc, d]: h_i of each row (the main model's, or a previous MTP step's output);
        next_ids [T]: t_{i+1}; positions [T]: i, where the rows' K/V go in the MTP layer's slice of
        the swa space. Returns the layer's output streams [T, hc, d] (head_hidden: the logits' input)."""
        e = self.e_proj(self.enorm(embed(next_ids)))
        x = e.unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return super().forward(x, positions, meta, next_ids)

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The input of the shared logits head for these output streams."""
        return self.norm(self.hc_head(streams))
