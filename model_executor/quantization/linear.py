"""QuantizedLinear: a drop-in for nn.Linear whose weight stays block-quantized in memory.

The weight is one or more row shards, each a BlockQuantizedTensor as the checkpoint stored it:
a fused projection (Llama's qkv_proj = q_proj | k_proj | v_proj, gate_up_proj) is loaded from
separately quantized checkpoint weights whose scale grids only line up when every shard but
the last has a multiple of the block rows (128) -- true for real models, not for tiny ones. So
shards whose grids line up are merged into one at construction, and the others stay separate,
each multiplied by its own kernel into its slice of the output.

Codes and scales are registered buffers (they follow ``module.to(device)`` and are counted as
the model's weight memory); the bias, if any, stays a dense parameter.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.model_executor.quantization.matmul import kernel_for
from hybridkv.model_executor.quantization.tensor import BlockQuantizedTensor


@dataclass(frozen=True)
class RowShard:
    """Output rows [start, stop) of the layer come from one quantized weight."""

    start: int
    stop: int
    names: tuple[str, ...]  # checkpoint weights merged into this shard
    codec: str
    block: tuple[int, int]
    scale_format: str


def _mergeable(a: BlockQuantizedTensor, b: BlockQuantizedTensor) -> bool:
    """b's scale grid continues a's exactly: same format, and a ends on a block-row boundary."""
    return (a.codec == b.codec and a.block == b.block and a.scales.dtype == b.scales.dtype
            and a.scale_format == b.scale_format and a.shape[1] == b.shape[1] and a.shape[0] % a.block[0] == 0)


def _merge(a: BlockQuantizedTensor, b: BlockQuantizedTensor) -> BlockQuantizedTensor:
    return BlockQuantizedTensor(
        f"{a.name}+{b.name}", a.codec, torch.cat((a.codes, b.codes)), torch.cat((a.scales, b.scales)), a.block,
        a.scale_format,
    )


class QuantizedLinear(nn.Module):
    """y = x @ W.T + b with W kept block-quantized (FP8 blocks or MXFP4 groups)."""

    def __init__(
        self, in_features: int, out_features: int, shards: list[tuple[int, BlockQuantizedTensor]],
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.layout: list[RowShard] = []
        merged: list[tuple[int, BlockQuantizedTensor, tuple[str, ...]]] = []
        expected_start = 0
        for start, tensor in sorted(shards, key=lambda s: s[0]):
            rows, cols = tensor.shape
            if cols != in_features:
                raise ValueError(f"{tensor.name} has {cols} input features, the layer has {in_features}")
            if start != expected_start:
                raise ValueError(
                    f"{tensor.name} covers output rows [{start}, {start + rows}) but rows from {expected_start} "
                    "are not covered (shards must tile the output without gaps or overlaps)"
                )
            expected_start = start + rows
            if merged and _mergeable(merged[-1][1], tensor):
                prev_start, prev, names = merged[-1]
                merged[-1] = (prev_start, _merge(prev, tensor), names + (tensor.name,))
            else:
                merged.append((start, tensor, (tensor.name,)))
        if expected_start != out_features:
            raise ValueError(f"quantized shards cover {expected_start} output rows, the layer has {out_features}")
        for i, (start, tensor, names) in enumerate(merged):
            self.register_buffer(f"codes_{i}", tensor.codes)
            self.register_buffer(f"scales_{i}", tensor.scales)
            self.layout.append(RowShard(start, start + tensor.shape[0], names, tensor.codec, tensor.block,
                                        tensor.scale_format))
        self._names = [t.name for _, t, _ in merged]

    @classmethod
    def replacing(cls, linear: nn.Linear, shards: list[tuple[int, BlockQuantizedTensor]]) -> "QuantizedLinear":
        """A QuantizedLinear with `linear`'s shape, bias and device."""
        device = linear.weight.device
        return cls(linear.in_features, linear.out_features, [(s, t.to(device)) for s, t in shards], linear.bias)

    # -- the weight --------------------------------------------------------------------------------
    def shards(self) -> Iterator[tuple[RowShard, BlockQuantizedTensor]]:
        """The row shards with their tensors (rebuilt from the buffers, which `.to()` may replace)."""
        for i, shard in enumerate(self.layout):
            codes, scales = getattr(self, f"codes_{i}"), getattr(self, f"scales_{i}")
            yield shard, BlockQuantizedTensor(self._names[i], shard.codec, codes, scales, shard.block, shard.scale_format)

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight_nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.shards())

    @property
    def checkpoint_names(self) -> list[str]:
        return [n for shard in self.layout for n in shard.names]

    @property
    def format_names(self) -> list[str]:
        return sorted({t.format_name for _, t in self.shards()})

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [out, in] weight (for tests and debugging; forward never builds it)."""
        return torch.cat([t.dequantize(dtype) for _, t in self.shards()])

    # -- compute -------------------------------------------------------------------------------
    def rows_matmul(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x [T, in] @ W[start:stop].T -> [T, stop - start]: the shards overlapping those rows."""
        parts = []
        for shard, tensor in self.shards():
            lo, hi = max(start, shard.start), min(stop, shard.stop)
            if lo < hi:
                kernel = kernel_for(x.device, shard.codec)
                parts.append(kernel(x, tensor, lo - shard.start, hi - shard.start))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.rows_matmul(x.reshape(-1, shape[-1]), 0, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def grouped_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, in] -> [T, G, out / G]: group g through output rows [g*R, (g+1)*R) only
        (DeepSeek-V4's grouped output projection wo_a)."""
        tokens, groups, width = x.shape
        if width != self.in_features or self.out_features % groups:
            raise ValueError(f"grouped input {tuple(x.shape)} does not fit a [{self.out_features}, {self.in_features}] weight")
        rows = self.out_features // groups
        outs = [self.rows_matmul(x[:, g].contiguous(), g * rows, (g + 1) * rows) for g in range(groups)]
        out = torch.stack(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias.view(groups, rows)
        return out

    def extra_repr(self) -> str:
        formats = "; ".join(self.format_names)
        return f"in_features={self.in_features}, out_features={self.out_features}, shards={len(self.layout)}, {formats}"


def quantized_linears(model: nn.Module) -> Iterator[tuple[str, QuantizedLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            yield name, module


def quantized_weight_numel(model: nn.Module, exclude: tuple[nn.Module, ...] = ()) -> int:
    """Logical elements of every QuantizedLinear weight (parameter counts miss them: they are buffers)."""
    return sum(m.weight_numel for _, m in quantized_linears(model) if not any(m is e for e in exclude))
