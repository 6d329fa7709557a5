"""The allowed-next-token bitmask of a step's constrained sequences, and how the sampler applies it.

The engine's grammar matchers (engine/structured_output/) compute, for every constrained
sequence that samples this step, one bit per vocabulary entry (bit j of 32-bit word w: token
32 * w + j may come next); the runner hands the rows to the sampler, which sets every forbidden
logit to -inf before anything else reads the logits. The model side thus never sees the grammar
library: it gets a plain int32 tensor, in the packed layout llguidance and xgrammar both write.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# float32 -inf as int32 bits (0xFF800000): (bit - 1) & this is 0.0 for an allowed token and -inf
# for a forbidden one, so the mask becomes an additive bias with integer ops alone.
_NEG_INF_BITS = np.int32(-8388608)


@dataclass
class TokenBitmask:
    """One step's masks: sequence id -> its row of `bits` ([R, ceil(V / 32)] int32)."""

    rows: dict[str, int]
    bits: torch.Tensor

    def __post_init__(self) -> None:
        if self.bits.dim() != 2 or self.bits.dtype != torch.int32 or self.bits.shape[0] != len(self.rows):
            raise ValueError(f"TokenBitmask: expected int32 bits [{len(self.rows)}, W], got "
                             f"{self.bits.dtype} {tuple(self.bits.shape)}")


def _bias(bits: torch.Tensor, vocab: int) -> np.ndarray:
    """[R, vocab] float32 array: 0.0 where the token is allowed, -inf where it is not (tokens past
    the mask's width are forbidden). The packed words are little-endian on every host torch runs
    on (x86-64, AArch64), so byte k of a word holds tokens 8k..8k+7."""
    words = np.ascontiguousarray(bits.numpy())
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    x = allowed[:, :vocab].astype(np.int32)
    x -= 1
    x &= _NEG_INF_BITS
    return x.view(np.float32)


def token_bias(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The additive mask of `bits` as a [R, vocab] float32 tensor (0.0 allowed, -inf forbidden)."""
    return torch.from_numpy(_bias(bits, vocab))


def apply_token_bitmask(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """float32 logits [B, V] with each masked row's forbidden tokens at -inf: rows[i] is the row
    of logits that bits[i] constrains. Returns a new tensor; `logits` is never modified.

    In numpy, single-threaded: unpackbits, two integer ops and one add take ~1 ms for 32 rows of
    49,152 tokens, where torch's where / masked_fill / even a clone took 5-20 ms on a 2-core VM
    whose other processes kept both cores busy (its OpenMP threads wait for each other)."""
    vocab = logits.shape[1]
    if not logits.is_cpu:  # the runner samples on the host; kept correct for any caller
        return _apply_torch(logits, bits, rows)
    bias = _bias(bits, vocab)
    src = logits.float().contiguous().numpy()
    if rows == list(range(src.shape[0])):
        return torch.from_numpy(np.add(src, bias))
    out = src.copy()
    out[rows] += bias
    return torch.from_numpy(out)


def _apply_torch(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.float().clone()
    index = torch.tensor(rows, dtype=torch.long, device=out.device)
    out[index] += token_bias(bits, out.shape[1]).to(out.device)
    return out
