"""Checkpoint names -> DeepseekV4ForCausalLM state-dict names.

Two namings are accepted (deepseek_v4.md §10):
  * transformers save_pretrained output: original DeepSeek names under a "model." prefix,
    e.g. model.layers.0.attn.wq_a.weight, model.hc_head.hc_fn, head.weight;
  * the original release: no prefix, embed.weight, hc_head_fn / hc_head_base / hc_head_scale.
Our module tree mirrors the original names, so only a few renames are needed. The MTP layer
(mtp.0.*, mtp.py) is loaded under `mtp.` when the model was built with it (speculative decoding
with method "mtp") and skipped otherwise, so it costs no memory.

Released checkpoints are block-quantized (FP8 projections, FP4 or FP8 routed experts, §10):
model_executor/quantization pairs each `<name>.weight` with its `<name>.scale` (or HF's
`weight_scale_inv`) before the tensors reach this loader, which keeps the linear layers'
weights compressed (QuantizedLinear) and dequantizes any other quantized tensor into its
parameter. A scale that reaches canonical_name unpaired means config.json declared no
quantization, and is refused.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import torch

from hybridkv.model_executor.quantization import BlockQuantizedTensor, QuantizedWeightInstaller

_HC_LAYER = re.compile(r"^(layers\.\d+|mtp)\.hc_(attn|ffn)_(fn|base|scale)$")
_HC_HEAD = re.compile(r"^(mtp\.)?hc_head_(fn|base|scale)$")
_MTP_LAYER = re.compile(r"^mtp\.(\d+)\.")
# Copies of the shared embedding and head some exports put under the MTP layer: the model's are used.
_MTP_SHARED = ("embed.weight", "embed_tokens.weight", "head.weight", "shared_head.head.weight")


def canonical_name(name: str, mtp: bool = False) -> str | None:
    """Our parameter/buffer name for a checkpoint tensor name (None = skip it). mtp: the model has
    its MTP layer (mtp.0.* -> mtp.*); without it every mtp.* tensor is skipped."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("mtp_"):
        return None
    m = _MTP_LAYER.match(name)
    if m:
        if not mtp:
            return None
        if m.group(1) != "0":
            raise ValueError(f"checkpoint tensor {name!r}: only one MTP layer (mtp.0) is supported")
        rest = name[m.end() :]
        if rest in _MTP_SHARED:
            return None
        name = "mtp." + rest
    if name.endswith(".scale") or name.endswith(".weight_scale_inv"):
        raise ValueError(
            f"checkpoint tensor {name!r} is an FP8 block scale, but config.json declares no quantization_config, "
            "so it cannot be paired with its weight; restore the checkpoint's quantization_config "
            "(quant_method 'fp8', as DeepSeek ships it)"
        )
    if name == "embed.weight":
        return "embed_tokens.weight"
    m = _HC_HEAD.match(name)
    if m:
        return f"{m.group(1) or ''}hc_head.hc_{m.group(2)}"
    m = _HC_LAYER.match(name)
    if m:
        return f"{m.group(1)}.hc_{m.group(2)}.{m.group(3)}"
    return name


def load_v4_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor | BlockQuantizedTensor]],
    local_name: Callable[[str], str] | None = None, mtp: bool = False,
) -> None:
    """Copy the checkpoint's tensors into `model`. local_name: a tensor-parallel rank's renaming of
    our names to its modules (its routed experts are numbered from 0; sharding.V4Shard). mtp: load
    the MTP layer (the model has one)."""
    targets = model.state_dict(keep_vars=True)  # parameters + persistent buffers (tid2eid, router bias)
    loaded: set[str] = set()
    installer = QuantizedWeightInstaller(model)
    for ckpt_name, tensor in weights:
        name = canonical_name(ckpt_name, mtp)
        if name is None:
            continue
        if local_name is not None:
            name = local_name(name)
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} does not belong to this DeepSeek-V4 model (no {name!r})")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        loaded.add(name)
        if isinstance(tensor, BlockQuantizedTensor):
            module_name, _, leaf = name.rpartition(".")
            if leaf == "weight" and installer.keeps_compressed(module_name):
                installer.add(module_name, tensor)
                continue
            installer.note_dequantized(ckpt_name)  # e.g. a router weight: not a linear layer
            tensor = tensor.dequantize(torch.float32)
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing DeepSeek-V4 weights for: {shown}")
    installer.finish()
