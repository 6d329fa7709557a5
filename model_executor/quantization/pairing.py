"""Turning a checkpoint's stream of tensors into weights: quantized weights meet their scales.

A block-quantized linear layer is two checkpoint tensors: ``<module>.weight`` (FP8 / packed FP4
codes) and its scale, named ``<module>.scale`` in DeepSeek's original release naming or
``<module>.weight_scale_inv`` in HF's (the value multiplies despite the name). They can come in
either order and from different shards, so the first of a pair waits (compressed) until the
other arrives. What comes out is the checkpoint's stream with every pair replaced by one
BlockQuantizedTensor under the weight's name (or, with ``dequantize``, by the dense float32
weight), ready for the model's own name mapping.

Anything that cannot be paired is an error naming the tensor: a quantized weight without a
scale, a scale without a weight, a weight stored in a quantized dtype while config.json
declares no quantization, or a scale whose weight is stored dense.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from hybridkv.model_executor.quantization.config import QuantizationConfig
from hybridkv.model_executor.quantization.tensor import (
    BlockQuantizedTensor, block_quantized_from_checkpoint, is_quantized_dtype,
)

ORIGINAL_SCALE_SUFFIX = ".scale"  # DeepSeek release naming
HF_SCALE_SUFFIX = ".weight_scale_inv"  # transformers / vLLM / SGLang naming
WEIGHT_SUFFIX = ".weight"

CheckpointTensor = torch.Tensor | BlockQuantizedTensor


def scale_owner(name: str) -> str | None:
    """The module a scale tensor belongs to (``a.b.weight_scale_inv`` -> ``a.b``), None if not a scale name."""
    for suffix in (HF_SCALE_SUFFIX, ORIGINAL_SCALE_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


@dataclass
class _PendingPairs:
    """Halves of pairs seen so far, keyed by module name."""

    weights: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    scales: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    dense_weights: set[str] = field(default_factory=set)  # modules whose .weight arrived unquantized


def _show(names: list[str], limit: int = 4) -> str:
    head = ", ".join(repr(n) for n in names[:limit])
    return head + (f" and {len(names) - limit} more" if len(names) > limit else "")


def attach_block_scales(
    weights: Iterable[tuple[str, torch.Tensor]],
    config: QuantizationConfig | None,
    dequantize: bool = False,
    paired: list[str] | None = None,
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield the checkpoint's tensors with each quantized weight paired with its scale.

    ``config`` None (config.json declares no quantization) passes dense tensors through and
    refuses any scale or quantized-dtype weight. ``dequantize`` yields the dense float32 weight
    instead of the compressed one (the "expand once at load" option). ``paired``, if given,
    collects the names of the quantized weights (for the startup log).
    """
    pending = _PendingPairs()

    def pair(module: str) -> tuple[str, CheckpointTensor]:
        weight_name, weight = pending.weights.pop(module)
        scale_name, scale = pending.scales.pop(module)
        quantized = block_quantized_from_checkpoint(weight_name, weight, scale_name, scale, config)
        if paired is not None:
            paired.append(weight_name)
        return weight_name, quantized.dequantize(torch.float32) if dequantize else quantized

    for name, tensor in weights:
        owner = scale_owner(name)
        if owner is not None and config is not None:
            if owner in pending.scales:
                raise ValueError(
                    f"module {owner!r} has two block scales ({pending.scales[owner][0]!r} and {name!r}); "
                    "the checkpoint mixes namings"
                )
            pending.scales[owner] = (name, tensor)
            if owner in pending.weights:
                yield pair(owner)
            continue
        if name.endswith(WEIGHT_SUFFIX) and is_quantized_dtype(tensor.dtype, config is not None):
            module = name[: -len(WEIGHT_SUFFIX)]
            if config is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} is stored as {tensor.dtype}, a quantized format, but config.json "
                    "has no quantization_config; the config does not match the weights"
                )
            pending.weights[module] = (name, tensor)
            if module in pending.scales:
                yield pair(module)
            continue
        if owner is not None and name.endswith(HF_SCALE_SUFFIX):  # config is None here
            raise ValueError(
                f"checkpoint tensor {name!r} is an FP8 block scale, but config.json has no quantization_config; "
                "add the checkpoint's quantization_config (quant_method 'fp8') or use an unquantized checkpoint"
            )
        if name.endswith(WEIGHT_SUFFIX):
            pending.dense_weights.add(name[: -len(WEIGHT_SUFFIX)])
        yield name, tensor

    if pending.weights:
        missing = sorted(n for n, _ in pending.weights.values())
        raise ValueError(
            f"checkpoint is missing the block scale of {len(missing)} quantized weight(s): {_show(missing)} "
            f"(looked for '<module>{ORIGINAL_SCALE_SUFFIX}' and '<module>{HF_SCALE_SUFFIX}'); the download is "
            "incomplete or the checkpoint is broken"
        )
    for module, (scale_name, scale) in sorted(pending.scales.items()):
        if module in pending.dense_weights:
            raise ValueError(
                f"block scale {scale_name!r} belongs to {module + WEIGHT_SUFFIX!r}, which is stored unquantized; "
                "the checkpoint is inconsistent"
            )
        if scale_name.endswith(HF_SCALE_SUFFIX):
            raise ValueError(
                f"block scale {scale_name!r} has no weight: the checkpoint holds no {module + WEIGHT_SUFFIX!r}"
            )
        # `<module>.scale` with no `<module>.weight` at all is not a block scale after all
        # (a model may own a parameter named `scale`): hand it on, the model decides.
        yield scale_name, scale
