"""Putting block-quantized checkpoint weights into a model built with nn.Linear layers.

Models are written with plain nn.Linear (the dense path, oneDNN prepacking, transformers
parity). A model loader hands each quantized weight it meets to a QuantizedWeightInstaller with
the linear module it belongs to (and the row offset for a fused projection's shard); when the
load is over, `finish` swaps each of those nn.Linear modules for a QuantizedLinear holding the
compressed shards, and the dense weight it replaces is freed.

A quantized weight whose target is not an nn.Linear (an embedding, a router stored as a bare
parameter) cannot stay compressed: the loader dequantizes it into the parameter and tells the
installer, which logs them once the load is over.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from hybridkv.model_executor.quantization.linear import QuantizedLinear
from hybridkv.model_executor.quantization.summary import name_patterns
from hybridkv.model_executor.quantization.tensor import BlockQuantizedTensor

logger = logging.getLogger(__name__)


@dataclass
class QuantizedWeightInstaller:
    model: nn.Module
    pending: dict[str, list[tuple[int, BlockQuantizedTensor]]] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)  # linear module -> a checkpoint name loaded dense into it
    dequantized: list[str] = field(default_factory=list)  # quantized checkpoint tensors expanded into parameters

    def keeps_compressed(self, module_name: str) -> bool:
        """Whether the weight of `module_name` can stay quantized (it is an nn.Linear's)."""
        try:
            return isinstance(self.model.get_submodule(module_name), nn.Linear)
        except AttributeError:
            return False

    def add(self, module_name: str, tensor: BlockQuantizedTensor, row_start: int = 0) -> None:
        if module_name in self.dense:
            raise self._mixed(module_name, tensor.name, self.dense[module_name])
        self.pending.setdefault(module_name, []).append((row_start, tensor))

    def note_dense(self, module_name: str, checkpoint_name: str) -> None:
        """A dense checkpoint weight was copied into `module_name`'s weight."""
        if module_name in self.pending:
            raise self._mixed(module_name, self.pending[module_name][0][1].name, checkpoint_name)
        self.dense.setdefault(module_name, checkpoint_name)

    def note_dequantized(self, checkpoint_name: str) -> None:
        """A quantized checkpoint tensor whose target is not a linear layer was expanded into it."""
        self.dequantized.append(checkpoint_name)

    @staticmethod
    def _mixed(module_name: str, quantized: str, dense: str) -> ValueError:
        return ValueError(
            f"{module_name!r} is fused from checkpoint weights stored in different formats ({quantized!r} is "
            f"block-quantized, {dense!r} is not); hybridkv needs every shard of a fused projection in one format"
        )

    def finish(self) -> list[str]:
        """Swap every collected nn.Linear for a QuantizedLinear; returns the swapped module names."""
        for module_name, shards in self.pending.items():
            linear = self.model.get_submodule(module_name)
            quantized = QuantizedLinear.replacing(linear, shards)
            parent_name, _, leaf = module_name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, leaf, quantized)
        names = list(self.pending)
        self.pending = {}
        if self.dequantized:
            logger.info("%d block-quantized tensor(s) are not linear-layer weights and were dequantized at load: %s",
                        len(self.dequantized), name_patterns(self.dequantized))
        return names
