"""What every kernel of this package decides the same way: the dtype and precision of the
tl.dot operands, the power-of-two block sizes, the online-softmax floor.

Scores and the softmax are always accumulated in float32. The dot operands stay in the model
dtype on a GPU (bfloat16 / float16 go to the tensor cores as they are); float32 operands ask for
IEEE precision, not TF32, so a float32 model matches the torch reference to ~1e-6. Triton's CPU
interpreter has no bfloat16 arithmetic (it holds bfloat16 as raw uint16), so under it every
operand is upcast to float32 first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# tl.dot wants every dimension of its operands to be at least 16 on the GPUs.
MIN_DOT = 16
# Finite stand-in for -inf as the running max of an online softmax: a row none of whose keys a
# block lets it see gets exp(-inf - NEG_BIG) = 0 (never exp(-inf + inf) = NaN), and an empty
# decode split a log-sum-exp that weighs nothing. A kernel global must be a tl.constexpr.
NEG_BIG = tl.constexpr(-1e30)


def is_interpreted(kernel) -> bool:
    """Whether `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return isinstance(kernel, InterpretedFunction)


def dot_config(dtype: torch.dtype, kernel) -> tuple[tl.dtype, str]:
    """(operand dtype, input_precision) of the tl.dot calls for inputs of `dtype`."""
    if dtype not in _TL_DTYPES:
        raise TypeError(f"triton attention supports float32, bfloat16 and float16, not {dtype}")
    if is_interpreted(kernel) or dtype == torch.float32:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "tf32"  # the precision only applies to float32 operands


def dot_block(n: int) -> int:
    """A power-of-two block covering n, no smaller than the tl.dot minimum."""
    return max(MIN_DOT, triton.next_power_of_2(n))
