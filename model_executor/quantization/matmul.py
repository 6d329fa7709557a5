"""y = x @ W.T for a block-quantized W, dequantizing W one row tile at a time.

Weight-only quantization: activations stay in the compute dtype, the weight is expanded tile
by tile into it and multiplied, so the temporary memory is one tile (a few MB at most, in
cache) instead of the whole weight, and the bytes read from memory per token are the
compressed ones.

A tile is rows [r0, r1) of W, all inside one row of the scale grid when the blocks have
several rows (FP8: 128), at most ``tile_elements`` elements. Where a tile's rows share one
row of scales and the batch is small (decode), the scales multiply x's columns instead of
the tile's elements (``(x * s) @ q.T == x @ (q * s).T``, T x K multiplies instead of R x K),
when that is exact enough: always in float32, and in any dtype for power-of-two (ue8m0) scales.

This is the portable kernel (CPU, and any device torch runs); `kernel_for` is where a fused
block-scaled GEMM for a device (e.g. a Triton FP8 kernel on CUDA) plugs in.
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridkv.model_executor.quantization.tensor import BlockQuantizedTensor, apply_column_scales_, column_scales

# Elements of one dequantized tile: 2^19 float32 = 2 MiB (+1 MiB of int16 scratch) stays in
# L2/L3 on the CPUs we measured (AMD Zen 3: 128-row tiles of a 2048-wide weight were the fastest).
DEFAULT_TILE_ELEMENTS = 1 << 19

BlockQuantizedMatmul = Callable[[torch.Tensor, BlockQuantizedTensor, int, int], torch.Tensor]


def _row_tiles(start: int, stop: int, block_rows: int, rows_per_tile: int):
    """(r0, r1) tiles covering [start, stop), none crossing a multiple of block_rows."""
    r = start
    while r < stop:
        block_end = min(stop, (r // block_rows + 1) * block_rows) if block_rows > 1 else stop
        r1 = min(block_end, r + rows_per_tile)
        yield r, r1
        r = r1


def dequantizing_matmul(
    x: torch.Tensor, weight: BlockQuantizedTensor, start: int, stop: int,
    tile_elements: int = DEFAULT_TILE_ELEMENTS,
) -> torch.Tensor:
    """x [T, K] (compute dtype) @ W[start:stop].T -> [T, stop - start] in x's dtype."""
    tokens, cols = x.shape
    if cols != weight.shape[1]:
        raise ValueError(f"{weight.name}: input has {cols} features, the weight expects {weight.shape[1]}")
    dtype = x.dtype
    out = torch.empty(tokens, stop - start, dtype=dtype, device=x.device)
    block_rows, block_cols = weight.block
    rows_per_tile = max(1, tile_elements // cols)
    if block_rows > 1:
        rows_per_tile = min(rows_per_tile, block_rows)
    # Scaling x is exact for power-of-two scales in any dtype; for float scales only in float32
    # (bfloat16 would round x * s differently from transformers' bf16(q * s)).
    scale_x = block_rows > 1 and tokens <= rows_per_tile and (weight.scales_are_e8m0 or dtype == torch.float32)
    tile = torch.empty(rows_per_tile, cols, dtype=torch.float32, device=x.device)
    scaled_x_block = -1
    x_scaled = x
    for r0, r1 in _row_tiles(start, stop, block_rows, rows_per_tile):
        rows = r1 - r0
        w = tile[:rows]
        w.copy_(weight.decode_rows(r0, r1))
        if scale_x:
            block = r0 // block_rows
            if block != scaled_x_block:  # one scaled copy of x per row of the scale grid
                s = weight.block_scales(slice(block, block + 1))[0]
                x_scaled = x * column_scales(s, block_cols, cols).to(dtype)
                scaled_x_block = block
        else:
            apply_column_scales_(w, weight.row_scales(r0, r1), block_cols)
        w_compute = w if dtype == torch.float32 else w.to(dtype)
        out[:, r0 - start : r1 - start] = torch.mm(x_scaled, w_compute.t())
    return out


def kernel_for(device: torch.device, codec: str) -> BlockQuantizedMatmul:
    """The matmul to run for weights of `codec` on `device`. Today the dequantizing kernel
    everywhere; a device-specific block-scaled GEMM is registered here when one exists."""
    return dequantizing_matmul
