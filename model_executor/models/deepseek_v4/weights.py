"""Checkpoint names -> DeepseekV4ForCausalLM state-dict names.

Two namings are accepted (deepseek_v4.md §10):
  * transformers save_pretrained output: original DeepSeek names under a "model." prefix,
    e.g. model.layers.0.attn.wq_a.weight, model.hc_head.hc_fn, head.weight;
  * the original release: no prefix, embed.weight, hc_head_fn / hc_head_base / hc_head_scale.
Our module tree mirrors the original names, so only a few renames are needed. MTP layers
(mtp.*) are not used and skipped. FP8 block-scaled release tensors are refused clearly.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch

_HC_LAYER = re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$")
_HC_HEAD = re.compile(r"^hc_head_(fn|base|scale)$")


def canonical_name(name: str) -> str | None:
    """Our parameter/buffer name for a checkpoint tensor name (None = skip it)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("mtp.") or name.startswith("mtp_"):
        return None
    if name.endswith(".scale") or name.endswith(".weight_scale_inv"):
        raise ValueError(
            f"checkpoint tensor {name!r} is an FP8 block scale; hybridkv loads DeepSeek-V4 weights in "
            "float32/bfloat16/float16 only, so dequantize the checkpoint first"
        )
    if name == "embed.weight":
        return "embed_tokens.weight"
    m = _HC_HEAD.match(name)
    if m:
        return f"hc_head.hc_{m.group(1)}"
    m = _HC_LAYER.match(name)
    if m:
        return f"{m.group(1)}.hc_{m.group(2)}.{m.group(3)}"
    return name


def load_v4_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    targets = model.state_dict(keep_vars=True)  # parameters + persistent buffers (tid2eid, router bias)
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = canonical_name(ckpt_name)
        if name is None:
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} does not belong to this DeepSeek-V4 model (no {name!r})")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        loaded.add(name)
    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing DeepSeek-V4 weights for: {shown}")
