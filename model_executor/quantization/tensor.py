"""A block-quantized weight as the checkpoint stores it, validated against its scale.

Two layouts, both ``value[r, c] = decode(code[r, c]) * scale[r // block_rows, c // block_cols]``:

  FP8     float8 e4m3 codes [N, K], one scale per (block_rows x block_cols) block from
          quantization_config.weight_block_size (128 x 128 in every release); the grid is
          rounded up, so a partial last block has a scale of its own.
  MXFP4   e2m1 codes packed two per byte [N, K/2] (int8, uint8 or float4_e2m1fn_x2 on disk),
          one ue8m0 scale per 32 values along K: scale grid [N, K/32], block (1, 32).

Scales are kept as they come, so memory stays the file's: ue8m0 as its exponent bytes (uint8),
float scales as float32 (one per 16,384 weights, so their width does not matter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.model_executor.quantization.codecs import (
    E2M1, E4M3, E4M3_DECODE_FACTOR, E8M0_NAN, decode_e2m1, decode_e4m3, decode_e8m0, e4m3_nan_count,
)
from hybridkv.model_executor.quantization.config import MXFP4_GROUP_SIZE, QuantizationConfig

_FP4_STORAGE = tuple(
    d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)
_E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
QUANTIZED_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2) + _FP4_STORAGE


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """Whether a `.weight` of this dtype only makes sense together with a block scale."""
    return dtype in QUANTIZED_WEIGHT_DTYPES or "float8" in str(dtype) or "float4" in str(dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockQuantizedTensor:
    """Codes + per-block scales of one 2-D weight; ``shape`` is the logical [rows, cols]."""

    name: str  # the checkpoint name of the weight, for messages and the startup log
    codec: str  # E4M3 or E2M1
    codes: torch.Tensor  # E4M3: int8 [rows, cols]; E2M1: uint8 [rows, cols // 2]
    scales: torch.Tensor  # float32, or uint8 ue8m0 exponents; [cdiv(rows, br), cdiv(cols, bc)]
    block: tuple[int, int]  # (rows, cols) covered by one scale

    @property
    def shape(self) -> torch.Size:
        rows, stored = self.codes.shape
        return torch.Size((rows, stored * 2 if self.codec == E2M1 else stored))

    @property
    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def scales_are_e8m0(self) -> bool:
        """Power-of-two scales: multiplying by them is exact in any float dtype."""
        return self.scales.dtype == torch.uint8

    @property
    def format_name(self) -> str:
        scales = "ue8m0" if self.scales_are_e8m0 else "float32"
        if self.codec == E2M1:
            return f"MXFP4 e2m1 (1x{self.block[1]} groups, {scales} scales)"
        return f"FP8 e4m3 ({self.block[0]}x{self.block[1]} blocks, {scales} scales)"

    def to(self, device: torch.device | str) -> "BlockQuantizedTensor":
        return BlockQuantizedTensor(self.name, self.codec, self.codes.to(device), self.scales.to(device), self.block)

    # -- decoding ------------------------------------------------------------------------------
    def block_scales(self, row_blocks: slice = slice(None)) -> torch.Tensor:
        """float32 scales of the given rows of the scale grid, times the codec's decode factor
        (decode_e4m3 yields value / 2^8), so ``decode(codes) * block_scales`` is the value."""
        raw = self.scales[row_blocks]
        scales = decode_e8m0(raw) if self.scales_are_e8m0 else raw.float()
        return scales * E4M3_DECODE_FACTOR if self.codec == E4M3 else scales

    def decode_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) decoded to float16 *without* scales (E4M3: value / 2^8)."""
        if self.codec == E4M3:
            return decode_e4m3(self.codes[start:stop])
        return decode_e2m1(self.codes[start:stop])

    def row_scales(self, start: int, stop: int) -> torch.Tensor:
        """float32 [stop - start, column blocks]: the block scales of each row in [start, stop)."""
        br = self.block[0]
        grid = self.block_scales(slice(start // br, _cdiv(stop, br)))
        if br == 1:
            return grid
        rows = torch.arange(start, stop, device=grid.device) // br - start // br
        return grid.index_select(0, rows)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight, computed in float32 and cast once (as transformers dequantizes)."""
        rows, cols = self.shape
        dense = self.decode_rows(0, rows).float()
        apply_column_scales_(dense, self.row_scales(0, rows), self.block[1])
        return dense.to(dtype)


def apply_column_scales_(tile: torch.Tensor, scales: torch.Tensor, block_cols: int) -> torch.Tensor:
    """tile [R, K] *= scales [R or 1, cdiv(K, block_cols)] expanded along K, in place."""
    rows, cols = tile.shape
    if cols % block_cols == 0:
        tile.view(rows, cols // block_cols, block_cols).mul_(scales.unsqueeze(-1))
    else:  # a partial last column block
        tile.mul_(scales.repeat_interleave(block_cols, dim=1)[:, :cols])
    return tile


def column_scales(scales: torch.Tensor, block_cols: int, cols: int) -> torch.Tensor:
    """One row of block scales [cdiv(K, block_cols)] expanded to [K]."""
    return scales.repeat_interleave(block_cols)[:cols]


# -- building from a checkpoint pair ---------------------------------------------------------------


def _codec_and_codes(name: str, weight: torch.Tensor, config: QuantizationConfig) -> tuple[str, torch.Tensor]:
    if weight.dtype == torch.float8_e4m3fn:
        return E4M3, weight.view(torch.int8)
    if weight.dtype in _FP4_STORAGE:
        if not config.allows_fp4:
            raise ValueError(
                f"checkpoint tensor {name!r} is {weight.dtype} with a block scale, i.e. packed FP4 (e2m1), but "
                f"config.json does not declare FP4 weights (expert_dtype is {config.expert_dtype!r}; "
                "DeepSeek-V4 sets \"expert_dtype\": \"fp4\")"
            )
        return E2M1, weight.view(torch.uint8)
    raise ValueError(
        f"checkpoint tensor {name!r} is stored as {weight.dtype}, but config.json's quantization_config says "
        f"fmt {config.fmt!r}: expected float8_e4m3fn codes"
        + (" (or packed FP4 e2m1 as int8/uint8)" if config.allows_fp4 else "")
    )


def _scale_storage(scale_name: str, scale: torch.Tensor) -> torch.Tensor:
    if _E8M0_DTYPE is not None and scale.dtype == _E8M0_DTYPE:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:  # ue8m0 exponent bytes (how MX checkpoints without the dtype store them)
        if bool((scale == E8M0_NAN).any()):
            raise ValueError(f"block scale {scale_name!r} holds the ue8m0 NaN code 0xFF; the checkpoint is corrupt")
        return scale.contiguous()
    if scale.dtype in _FLOAT_SCALES:
        scale = scale.float().contiguous()
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"block scale {scale_name!r} holds NaN or infinite values; the checkpoint is corrupt")
        return scale
    raise ValueError(
        f"block scale {scale_name!r} is stored as {scale.dtype}; expected float32/bfloat16/float16 scales or "
        "ue8m0 exponents (float8_e8m0fnu or uint8)"
    )


def block_quantized_from_checkpoint(
    weight_name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor, config: QuantizationConfig
) -> BlockQuantizedTensor:
    """Pair a checkpoint weight with its block scale, checking every property a kernel relies on.

    Every error names the tensor and says what is wrong with it.
    """
    if weight.dim() != 2:
        raise ValueError(
            f"checkpoint tensor {weight_name!r} is a {weight.dim()}-D quantized weight of shape "
            f"{tuple(weight.shape)}; hybridkv loads 2-D block-quantized weights (one per linear layer)"
        )
    codec, codes = _codec_and_codes(weight_name, weight, config)
    codes = codes.contiguous()
    block = (1, MXFP4_GROUP_SIZE) if codec == E2M1 else config.weight_block
    rows, stored = codes.shape
    cols = stored * 2 if codec == E2M1 else stored
    want = (_cdiv(rows, block[0]), _cdiv(cols, block[1]))
    if tuple(scale.shape) != want:
        kind = f"MXFP4 groups of 1x{block[1]}" if codec == E2M1 else f"{block[0]}x{block[1]} FP8 blocks"
        raise ValueError(
            f"block scale {scale_name!r} has shape {tuple(scale.shape)}, but weight {weight_name!r} "
            f"[{rows}, {cols}] in {kind} needs scale shape {list(want)}; the scale does not belong to this "
            "weight or weight_block_size in config.json is wrong"
        )
    if codec == E4M3:
        bad = e4m3_nan_count(codes)
        if bad:
            raise ValueError(f"checkpoint tensor {weight_name!r} holds {bad} FP8 NaN code(s); the checkpoint is corrupt")
    return BlockQuantizedTensor(weight_name, codec, codes, _scale_storage(scale_name, scale), block)
