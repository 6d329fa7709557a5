"""y = x @ W.T for a block-quantized W, dequantizing W one row tile at a time.

Weight-only quantization: activations are not quantized, the weight is expanded tile by tile
and multiplied, so the temporary memory is one tile (a few MB at most, in cache) instead of the
whole weight, and the bytes read from memory per token are the compressed ones. (On the CPUs
measured the expansion itself, a few vectorised passes per tile, costs more than the bytes it
saves: benchmarks/quantized_decode.py; a fused kernel is what turns the saving into speed.)

A tile is rows [r0, r1) of W, at most ``tile_elements`` elements, decoded to float32
(codecs.py) and scaled in place by its block scales, then multiplied. For a decode step (few
tokens) the scales multiply x's columns instead (``(x * s) @ q.T == x @ (q * s).T``: T x K
multiplies instead of R x K); the tile is then one row of the scale grid (128 rows).

The product is always computed in float32, whatever the activations' dtype (bfloat16 /
float16 in, the same dtype out, rounded once): the decoded tile is float32 anyway, and on CPU
converting it to bfloat16 for a bf16 matmul measured 2x slower than multiplying in float32 (the
weights are exact either way: e4m3 / e2m1 times a power of two fits bfloat16; float scales
round as bf16(q * s) would). A dense bfloat16 model rounds its weights once at load instead,
so the two agree to bfloat16 rounding, not bit for bit.

This is the portable kernel (CPU, and any device torch runs); `kernel_for` is where a fused
block-scaled GEMM for a device (e.g. a Triton FP8 kernel on CUDA) plugs in.
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridkv.model_executor.quantization.tensor import BlockQuantizedTensor, apply_column_scales_, scale_columns

# Elements of one dequantized tile: 2^19 float32 = 2 MiB (+1 MiB of int16 scratch) stays in
# L2/L3 on the CPUs we measured (AMD Zen 3: 128-row tiles of a 2048-wide weight were the fastest).
DEFAULT_TILE_ELEMENTS = 1 << 19
# Up to this many tokens, scaling x's columns (T x K multiplies per tile) beats scaling the tile (R x K).
SCALE_X_MAX_TOKENS = 16

BlockQuantizedMatmul = Callable[[torch.Tensor, BlockQuantizedTensor, int, int], torch.Tensor]


def _row_tiles(start: int, stop: int, rows_per_tile: int, block_rows: int | None = None):
    """(r0, r1) tiles covering [start, stop), at most rows_per_tile rows each; with block_rows,
    none crosses a multiple of it (so that a tile's rows share one row of the scale grid)."""
    r = start
    while r < stop:
        r1 = min(stop, r + rows_per_tile)
        if block_rows is not None:
            r1 = min(r1, (r // block_rows + 1) * block_rows)
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
    x = x.float()  # the tiles are float32: multiply in float32, round the output once
    out = torch.empty(tokens, stop - start, dtype=torch.float32, device=x.device)
    block_rows, block_cols = weight.block
    rows_per_tile = max(1, tile_elements // cols)
    # Decode (few tokens): scale x's columns, one row of the scale grid per tile. Otherwise
    # scale the tile in place (one cheap float32 pass over it).
    scale_x = block_rows > 1 and tokens <= SCALE_X_MAX_TOKENS
    rows_per_tile = min(rows_per_tile, stop - start, block_rows if scale_x else stop - start)
    tile = torch.empty(rows_per_tile, cols, dtype=torch.float32, device=x.device)
    scratch = weight.decode_scratch(rows_per_tile)
    x_in, x_block = x, -1
    for r0, r1 in _row_tiles(start, stop, rows_per_tile, block_rows if scale_x else None):
        rows = r1 - r0
        w = tile[:rows]
        w.copy_(weight.decode_rows(r0, r1, scratch[:rows]))
        if scale_x:
            block = r0 // block_rows
            if block != x_block:  # one scaled copy of x per row of the scale grid
                x_in, x_block = scale_columns(x, weight.block_scales(slice(block, block + 1)), block_cols), block
        else:
            apply_column_scales_(w, weight.row_scales(r0, r1), block_cols)
        if rows == stop - start:
            torch.mm(x_in, w.t(), out=out)
        else:
            out[:, r0 - start : r1 - start] = torch.mm(x_in, w.t())
    return out if dtype == torch.float32 else out.to(dtype)


def kernel_for(device: torch.device, codec: str) -> BlockQuantizedMatmul:
    """The matmul to run for weights of `codec` on `device`. Today the dequantizing kernel
    everywhere; a device-specific block-scaled GEMM is registered here when one exists."""
    return dequantizing_matmul
