"""TensorParallel: one rank's place in a tensor-parallel group and the collectives its forward runs.

The object is passed down explicitly (runner -> model -> layers); nothing reads a module-level
"current group". The collectives use torch.distributed's default process group, which the engine
initialises (gloo on the CPU, NCCL on CUDA) before any model is built. A model built for planning
only (on the meta device) gets one too and never runs a collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """rank in [0, size). Rank 0 is the driver: it samples, and only it receives the logits."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x` (a row-parallel layer's output), in place."""
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's logits columns joined on rank 0 ([N, vocab_size]); None on the other ranks.
        Each rank holds the same padded number of columns (layout.VocabShard), the padding is cut."""
        local_logits = local_logits.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(local_logits) for _ in range(self.size)]
            dist.gather(local_logits, parts, dst=0)
            return torch.cat(parts, dim=-1)[..., :vocab_size]
        dist.gather(local_logits, None, dst=0)
        return None
