"""A rank's slice of a block-quantized weight: its codes and its scale, cut consistently.

A quantized linear layer is stored as codes ``<module>.weight`` and a scale grid (one value per
block of block_rows x block_cols values; FP8: 128 x 128, MXFP4: 1 x 32 with two codes per byte).
A rank that holds rows or columns [start, stop) of the weight reads those codes and the scale
rows/columns of the blocks they lie in. That is exact only when the rank's local block grid is
the global one shifted by whole blocks: `start` on a block boundary, or the whole slice inside
one block (then every local row shares the one scale row it reads). Any other split would give a
rank rows of two blocks under one local block, so it is refused naming the tensor and the
alignment it needs.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridkv.model_executor.parallel.layout import Slice


@dataclass(frozen=True)
class BlockGeometry:
    """How one quantized weight is stored: values per scale (rows, cols), and codes per stored
    element along the columns (2: packed FP4)."""

    block: tuple[int, int]
    packed: int = 1
    kind: str = "FP8"

    def codes_slice(self, name: str, part: Slice) -> Slice:
        """The slice of the stored codes holding the weight's `part` (checked against the blocks)."""
        self._check(name, part)
        if part.dim == 1 and self.packed > 1:
            return Slice(1, part.start // self.packed, part.stop // self.packed)
        return part

    def scale_slice(self, name: str, part: Slice) -> Slice:
        """The slice of the scale grid covering the weight's `part`."""
        self._check(name, part)
        b = self.block[part.dim]
        return Slice(part.dim, part.start // b, (part.stop - 1) // b + 1)

    def _check(self, name: str, part: Slice) -> None:
        if part.zeros or part.skip or part.length is not None:
            raise ValueError(f"{name!r} is block-quantized ({self.kind}); a tensor-parallel rank can read only "
                             "a plain row or column range of it, not a padded or zero slice")
        b = self.block[part.dim]
        aligned = part.start % b == 0 or part.start // b == (part.stop - 1) // b
        if not aligned or (part.dim == 1 and self.packed > 1 and (part.start % self.packed or part.stop % self.packed)):
            what = "rows" if part.dim == 0 else "columns"
            raise ValueError(
                f"tensor-parallel slice of {name!r} ({what} [{part.start}, {part.stop})) is not aligned to its "
                f"{self.kind} quantization blocks of {self.block[0]}x{self.block[1]}: a rank's {what} must start "
                f"at a multiple of {b} (or lie within one block); choose a tensor_parallel_size that splits "
                f"this dimension at multiples of {b}"
            )
