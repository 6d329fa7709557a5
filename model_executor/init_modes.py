"""Building a model whose weights will all come from a checkpoint: skip random initialisation.

nn.Linear / nn.Embedding initialise their weights randomly in __init__, which writes every page
of every weight. For a model the runner builds that is wasted: each parameter is overwritten
from the checkpoint, and the loaders fail on any the checkpoint does not provide. It is also
what made a block-quantized checkpoint briefly hold the whole dense model: its linear layers'
dense weights are replaced by compressed ones when the load ends, and a weight that was never
written was never resident (a fresh allocation only takes memory when a page is first touched),
so skipping the initialisers keeps the peak of such a load near the compressed size.

The switch is a TorchFunctionMode, active only inside its ``with`` block on the current thread
(no global state is patched): the in-place random initialisers return their tensor untouched.
"""
from __future__ import annotations

import torch
from torch.nn import init
from torch.overrides import TorchFunctionMode

_RANDOM_INITIALISERS = frozenset({
    init.uniform_, init.normal_, init.trunc_normal_, init.kaiming_uniform_, init.kaiming_normal_,
    init.xavier_uniform_, init.xavier_normal_, init.orthogonal_, init.sparse_,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
})


class SkipRandomInit(TorchFunctionMode):
    """Inside this mode, random initialisers leave their tensor as allocated (uninitialised)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)
