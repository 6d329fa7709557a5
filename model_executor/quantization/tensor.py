"""A block-quantized weight as the checkpoint stores it, validated against its scale.

Two layouts, both ``value[r, c] = decode(code[r, c]) * scale[r // block_rows, c // block_cols]``:

  FP8     float8 e4m3 codes [N, K], one scale per (block_rows x block_cols) block from
          quantization_config.weight_block_size (128 x 128 in every release); the grid is
          rounded up, so a partial last block has a scale of its own.
  MXFP4   e2m1 codes packed two per byte [N, K/2] (int8, uint8 or float4_e2m1fn_x2 on disk),
          one ue8m0 scale per 32 values along K: scale grid [N, K/32], block (1, 32).

Scales: MXFP4's (one per 32 values) stay the ue8m0 exponent bytes they are on disk, so memory
stays the file's; FP8's (one per 16,384 values, so their width does not matter) are decoded
once at load to float32 and pre-multiplied by the codec's decode factor, which saves the
per-tile work of decoding them on every matmul.
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
_INTEGER_STORAGE = (torch.int8, torch.uint8)


def is_quantized_dtype(dtype: torch.dtype, quantized_checkpoint: bool) -> bool:
    """Whether a `.weight` of this dtype only makes sense together with a block scale: any
    float8 / float4 dtype, and in a checkpoint that declares quantization also int8 / uint8
    (how packed FP4 is stored). An unquantized checkpoint's int8 weight loads as before."""
    name = str(dtype)
    return "float8" in name or "float4" in name or (quantized_checkpoint and dtype in _INTEGER_STORAGE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockQuantizedTensor:
    """Codes + per-block scales of one 2-D weight; ``shape`` is the logical [rows, cols]."""

    name: str  # the checkpoint name of the weight, for messages and the startup log
    codec: str  # E4M3 or E2M1
    codes: torch.Tensor  # E4M3: int8 [rows, cols]; E2M1: uint8 [rows, cols // 2]
    # [cdiv(rows, br), cdiv(cols, bc)]: uint8 ue8m0 exponents (MXFP4), or float32 already
    # multiplied by the codec's decode factor (so decode_rows(...) * scale is the value)
    scales: torch.Tensor
    block: tuple[int, int]  # (rows, cols) covered by one scale
    scale_format: str = "float32"  # how the checkpoint stored the scales: "ue8m0" or "float32"

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
    def format_name(self) -> str:
        if self.codec == E2M1:
            return f"MXFP4 e2m1 (1x{self.block[1]} groups, {self.scale_format} scales)"
        return f"FP8 e4m3 ({self.block[0]}x{self.block[1]} blocks, {self.scale_format} scales)"

    def to(self, device: torch.device | str) -> "BlockQuantizedTensor":
        return BlockQuantizedTensor(self.name, self.codec, self.codes.to(device), self.scales.to(device), self.block,
                                    self.scale_format)

    # -- decoding ------------------------------------------------------------------------------
    def block_scales(self, row_blocks: slice = slice(None)) -> torch.Tensor:
        """float32 scales of the given rows of the scale grid, such that
        ``decode_rows(...) * block_scales`` is the value (the decode factor included)."""
        raw = self.scales[row_blocks]
        return decode_e8m0(raw) if raw.dtype == torch.uint8 else raw

    def decode_scratch(self, rows: int) -> torch.Tensor:
        """Integer scratch for decode_rows of up to `rows` rows (reused across a matmul's tiles)."""
        dtype = torch.int16 if self.codec == E4M3 else torch.int32
        return torch.empty(rows, self.codes.shape[1], dtype=dtype, device=self.codes.device)

    def decode_rows(self, start: int, stop: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) decoded to float16 *without* scales (E4M3: value / 2^8)."""
        if self.codec == E4M3:
            return decode_e4m3(self.codes[start:stop], scratch)
        return decode_e2m1(self.codes[start:stop], scratch)

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


def scale_columns(x: torch.Tensor, scales: torch.Tensor, block_cols: int) -> torch.Tensor:
    """x [T, K] * one row of block scales [1, cdiv(K, block_cols)] expanded along K (a new tensor)."""
    tokens, cols = x.shape
    scales = scales.to(x.dtype)
    if cols % block_cols == 0:
        return (x.view(tokens, cols // block_cols, block_cols) * scales.view(1, -1, 1)).view(tokens, cols)
    return x * scales.view(-1).repeat_interleave(block_cols)[:cols]


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


def _scale_storage(scale_name: str, scale: torch.Tensor, codec: str) -> tuple[torch.Tensor, str]:
    """(scales as kept in memory, the checkpoint's scale format); see the module docstring."""
    if _E8M0_DTYPE is not None and scale.dtype == _E8M0_DTYPE:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:  # ue8m0 exponent bytes (how MX checkpoints without the dtype store them)
        if bool((scale == E8M0_NAN).any()):
            raise ValueError(f"block scale {scale_name!r} holds the ue8m0 NaN code 0xFF; the checkpoint is corrupt")
        if codec == E2M1:
            return scale.clone(memory_format=torch.contiguous_format), "ue8m0"
        values, fmt = decode_e8m0(scale), "ue8m0"
    elif scale.dtype in _FLOAT_SCALES:
        values, fmt = scale.float(), "float32"
    else:
        raise ValueError(
            f"block scale {scale_name!r} is stored as {scale.dtype}; expected float32/bfloat16/float16 scales or "
            "ue8m0 exponents (float8_e8m0fnu or uint8)"
        )
    if codec == E4M3:
        values = values * E4M3_DECODE_FACTOR
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"block scale {scale_name!r} holds NaN, infinite or out-of-range values; the checkpoint is corrupt")
    return values.clone(memory_format=torch.contiguous_format), fmt


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
    # A copy: safetensors hands out views of its memory-mapped file, and a kept view would keep
    # the whole file mapped (its dense tensors' pages too) for as long as the model lives.
    codes = codes.clone(memory_format=torch.contiguous_format)
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
    scales, scale_format = _scale_storage(scale_name, scale, codec)
    return BlockQuantizedTensor(weight_name, codec, codes, scales, block, scale_format)
