"""Element formats of quantized weights and scales, decoded with vectorised integer ops.

Why not ``tensor.to(torch.float32)``: torch's float8 -> float conversion on CPU is a scalar
loop (about 6 ns per element on an AMD Zen 3, 25 ms for a 2048x2048 matrix, 30x an fp32 matmul
of it), and float4_e2m1fn_x2 has no conversion at all. Both formats are small subsets of
float16, so a few vectorised integer ops rebuild the float16 bit pattern exactly:

  e4m3fn  s eeee mmm (bias 7)  -> float16 s 0eeee mmm0000000 (bias 15) = value / 2^8, exactly
          (subnormals included: float16's subnormal grid contains e4m3's). The 2^8 goes into
          the block scale. The NaN codes 0x7F/0xFF would read as +-480; loading refuses them.
  e2m1    s ee m (bias 1), two per byte, low nibble first -> a 256-entry table from a byte to
          its two float16 values (exact), read with index_select.
  e8m0    eeeeeeee -> 2^(e - 127) as float32 bits e << 23 (e = 0 is 2^-127, the float32
          subnormal 0x00400000; e = 0xFF is NaN and refused at load).
"""
from __future__ import annotations

import torch

E4M3 = "e4m3"
E2M1 = "e2m1"
E4M3_DECODE_FACTOR = 2.0**8  # decode_e4m3 returns value / 2^8
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 0xFF
_E4M3_SIGN_COPY = ~0x4000  # after the shift, bit 14 holds a copy of the sign: clear it


def _e2m1_byte_table() -> torch.Tensor:
    """int32 [256]: byte b -> the float16 bit patterns of (low nibble, high nibble) of b."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float16)
    byte = torch.arange(256)
    pairs = torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1).contiguous()
    return pairs.view(torch.int32).reshape(256)


_E2M1_BYTE_TABLE = _e2m1_byte_table()  # a constant, never written


def decode_e4m3(data: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """int8 e4m3fn codes [..] -> float16 values / 2^8 (exact), same shape.

    ``scratch``: an int16 tensor of data's shape to write into (saves an allocation per tile).
    """
    bits = data.to(torch.int16) if scratch is None else scratch.copy_(data)  # sign-extending widen
    bits.bitwise_left_shift_(7).bitwise_and_(_E4M3_SIGN_COPY)
    return bits.view(torch.float16)


def decode_e2m1(packed: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [R, C] (two e2m1 codes per byte, low nibble first) -> float16 [R, 2C], exact.

    ``scratch``: an int32 tensor of packed's shape for the table indices.
    """
    rows, cols = packed.shape
    index = packed.to(torch.int32) if scratch is None else scratch.copy_(packed)
    table = _E2M1_BYTE_TABLE if packed.device.type == "cpu" else _E2M1_BYTE_TABLE.to(packed.device)
    pairs = torch.index_select(table, 0, index.view(-1))
    return pairs.view(torch.float16).view(rows, 2 * cols)


def decode_e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2^(e - 127), exact (0 -> 2^-127)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    return bits.view(torch.float32)


def e4m3_nan_count(data: torch.Tensor) -> int:
    """How many e4m3fn NaN codes (0x7F, 0xFF) an int8 code tensor holds.

    The NaN codes are the largest int8 (0x7F) and the largest uint8 (0xFF), so two max
    reductions, which allocate nothing, answer "none" for a sound checkpoint; only a corrupt one
    pays for counting. (A mask per weight fragmented the heap by about the size of the dense
    model over a load, measured.)"""
    if data.numel() == 0 or (int(data.max()) != 0x7F and int(data.view(torch.uint8).max()) != 0xFF):
        return 0
    return int(((data & 0x7F) == 0x7F).sum())
