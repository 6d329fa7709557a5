"""What the startup log says about a loaded model's weights: formats, which tensors, memory.

"Which tensors" is summarised by name pattern (layer and expert indices collapsed to ``*``),
so a 43-layer, 256-expert model gives a handful of lines instead of ten thousand names.
Weight memory counts what a load keeps resident: parameters, persistent buffers (router
tables) and the quantized codes and scales; derived tables (RoPE cos/sin) are not weights.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridkv.model_executor.quantization.linear import quantized_linears

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def name_pattern(name: str) -> str:
    """``layers.12.ffn.experts.7.w1`` -> ``layers.*.ffn.experts.*.w1``."""
    return _INDEX.sub("*", name)


def name_patterns(names: list[str]) -> str:
    """Names summarised by pattern with counts: ``layers.*.attn.wq_a (x43), head``."""
    counts = Counter(name_pattern(n) for n in names)
    return ", ".join(f"{p} (x{c})" if c > 1 else p for p, c in sorted(counts.items()))


@dataclass
class WeightInventory:
    """A loaded model's weights by storage format."""

    quantized: dict[str, list[str]] = field(default_factory=dict)  # format -> module names
    quantized_bytes: dict[str, int] = field(default_factory=dict)
    dense_bytes: dict[torch.dtype, int] = field(default_factory=dict)
    # The CPU linears' packed copies (layers.fast_linear): held beside the parameters, or instead
    # of them where a parameter was released once packed. Not in total_bytes, which counts the
    # checkpoint's tensors as loaded.
    packed_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.quantized_bytes.values()) + sum(self.dense_bytes.values())

    @property
    def quantized_modules(self) -> int:
        return sum(len(v) for v in self.quantized.values())


def weight_inventory(model: nn.Module) -> WeightInventory:
    """Bytes held per format (tied tensors counted once)."""
    inv = WeightInventory()
    counted: set[int] = set()
    for name, module in quantized_linears(model):
        for fmt in module.format_names:
            inv.quantized.setdefault(fmt, []).append(name)
        for shard, tensor in module.shards():
            counted.update((tensor.codes.data_ptr(), tensor.scales.data_ptr()))
            inv.quantized_bytes[tensor.format_name] = inv.quantized_bytes.get(tensor.format_name, 0) + tensor.nbytes
        if module.bias is not None:
            counted.add(module.bias.data_ptr())
            inv.dense_bytes[module.bias.dtype] = inv.dense_bytes.get(module.bias.dtype, 0) + module.bias.nbytes
    for tensor in model.state_dict(keep_vars=True).values():
        if tensor.is_meta:  # a parameter released once packed: its packed copy is counted below
            continue
        ptr = tensor.data_ptr()
        if ptr in counted or tensor.numel() == 0:
            continue
        counted.add(ptr)
        inv.dense_bytes[tensor.dtype] = inv.dense_bytes.get(tensor.dtype, 0) + tensor.nbytes
    inv.packed_bytes = _packed_copy_bytes(model)
    return inv


def _packed_copy_bytes(model: nn.Module) -> int:
    """Bytes of the packed weight copies the model's modules hold (their `packed` /
    `blocked_packed` tensors: layers.BlockedLinearWeight, AmxLinearWeight, PackedLinearWeight;
    oneDNN's opaque copies are not counted)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for obj in vars(module).values():
            for attr in ("packed", "blocked_packed"):
                t = getattr(obj, attr, None)
                if (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta
                        and t.data_ptr() not in seen):
                    seen.add(t.data_ptr())
                    total += t.nbytes
    return total


def weight_memory_bytes(model: nn.Module) -> int:
    """Bytes of weights the model keeps resident (quantized codes + scales + dense tensors)."""
    return weight_inventory(model).total_bytes


def checkpoint_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_weights(
    inv: WeightInventory, file_bytes: int | None = None, dequantized_at_load: list[str] | None = None,
) -> list[str]:
    """Log lines: one per quantized format kept (with its tensors), the quantized checkpoint
    tensors expanded at load on request, then the dense tensors and the totals."""
    lines = []
    for fmt, modules in sorted(inv.quantized.items()):
        lines.append(f"weights kept {fmt}: {len(modules)} linear layer(s), {_gib(inv.quantized_bytes.get(fmt, 0))}: "
                     f"{name_patterns(modules)}")
    if dequantized_at_load:
        lines.append(f"block-quantized weights dequantized at load (requested): {len(dequantized_at_load)} "
                     f"tensor(s): {name_patterns(dequantized_at_load)}")
    dense = ", ".join(f"{str(d).removeprefix('torch.')} {_gib(b)}" for d, b in sorted(inv.dense_bytes.items(), key=str))
    held = inv.total_bytes + inv.packed_bytes
    total = f"weight memory {_gib(held)}"
    if inv.packed_bytes:
        total += f" (parameters {_gib(inv.total_bytes)}, packed copies for the CPU linears {_gib(inv.packed_bytes)})"
    if file_bytes:
        total += f" (checkpoint files {_gib(file_bytes)}, ratio {held / file_bytes:.2f})"
    lines.append(f"{total}; dense tensors: {dense or 'none'}")
    return lines
