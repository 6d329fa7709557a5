"""Builds tiny DeepSeek-V4 checkpoints (transformers' DeepseekV4ForCausalLM) for tests.

transformers' init zeroes the attention sinks, compressor position biases, hash tables and
router biases and uses std 0.02 elsewhere, which would hide indexing bugs (a zero `ape`
makes every slot of a window look alike; zero tid2eid routes every token to expert 0).
Every tensor is re-initialised at O(1)-activation scales, as the reference scripts do.
"""
from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from tiny_checkpoints import build_tokenizer

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]


def v4_config(vocab_size: int, **overrides):
    from transformers import DeepseekV4Config

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.25,  # rope dim 8
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        layer_types=list(LAYER_TYPES),
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=16,
        # >= 16 indexer heads: with few heads many entries score exactly 0 (ReLU) and top-k
        # ties make any two correct implementations pick different entries.
        index_n_heads=16,
        index_head_dim=16,
        index_topk=8,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return DeepseekV4Config(**base)


@torch.no_grad()
def randomize_(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config

    def rn(shape, std):
        return torch.randn(shape, generator=g) * std

    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("embed_tokens.weight"):
            v = rn(shape, 1.0)
        elif "norm" in name and p.dim() == 1:
            v = 1.0 + rn(shape, 0.1)
        elif name.endswith(".sinks") or name.endswith("position_bias"):
            v = rn(shape, 0.5)
        elif name.endswith(".base") or name.endswith("hc_base"):
            v = rn(shape, 0.1)
        elif name.endswith(".scale") or name.endswith("hc_scale"):
            v = 1.0 + rn(shape, 0.1)
        elif p.dim() >= 2:  # linear weights [.., out, in] (incl. stacked experts, hc fn, router)
            v = rn(shape, shape[-1] ** -0.5)
        else:
            v = rn(shape, 0.1)
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            V, k = b.shape
            rows = [torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(V)]
            b.copy_(torch.stack(rows).to(b.dtype))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(rn(tuple(b.shape), 0.1).to(b.dtype))


def with_mtp_layer(config):
    """A copy of a V4 config with one more layer at the end as the MTP layer is built: sliding
    attention and a top-k routed (not hashed) MoE."""
    cfg, n = copy.deepcopy(config), config.num_hidden_layers
    cfg.num_hidden_layers = n + 1
    # (a release config's legacy compress_ratios list the MTP layer already: cut at the trunk's)
    cfg.layer_types = list(config.layer_types[:n]) + ["sliding_attention"]
    cfg.mlp_layer_types = list(config.mlp_layer_types[:n]) + ["moe"]
    return cfg


@torch.no_grad()
def mtp_tensors(config, seed: int, prefix: str = "model.mtp.0.") -> dict[str, torch.Tensor]:
    """Random MTP weights under the names DeepSeek's checkpoints use (save_pretrained writes none):
    the decoder layer's tensors (an HF model one layer longer, randomised like the trunk, saved:
    its last layer's names are the original ones) and the MTP's own projections, norms and hc_head."""
    from transformers import DeepseekV4ForCausalLM

    n, d, hc = config.num_hidden_layers, config.hidden_size, config.hc_mult
    longer = DeepseekV4ForCausalLM(with_mtp_layer(config)).eval()
    randomize_(longer, seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        longer.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    layer = f"model.layers.{n}."
    out = {prefix + k[len(layer) :]: v for k, v in saved.items() if k.startswith(layer)}
    g = torch.Generator().manual_seed(seed + 2)
    for name in ("e_proj", "h_proj"):
        out[f"{prefix}{name}.weight"] = torch.randn(d, d, generator=g) * d**-0.5
    for name in ("enorm", "hnorm", "norm"):
        out[f"{prefix}{name}.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    out[f"{prefix}hc_head_fn"] = torch.randn(hc, hc * d, generator=g) * (hc * d) ** -0.5
    out[f"{prefix}hc_head_base"] = 0.1 * torch.randn(hc, generator=g)
    out[f"{prefix}hc_head_scale"] = 1.0 + 0.1 * torch.randn(1, generator=g)
    return out


def build_v4_checkpoint(path: str, seed: int = 0, mtp: bool = False, **overrides) -> str:
    """Write a tiny DeepSeek-V4 checkpoint (save_pretrained naming) plus a tokenizer to path.
    mtp: with random MTP-layer weights (model.mtp.0.*, mtp_tensors); the trunk is the same."""
    from transformers import DeepseekV4ForCausalLM

    tok = build_tokenizer()
    config = v4_config(
        len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **overrides,
    )
    config.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    randomize_(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if mtp:
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        tensors.update(mtp_tensors(config, seed))
        save_file(tensors, file, metadata={"format": "pt"})
    tok.save_pretrained(path)
    return path


def hf_v4_model(path: str):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Tiny shapes run fastest on one intra-op thread (and do not fight other test processes)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
