"""TensorParallel: one rank's place in a tensor-parallel group and the collectives its forward runs.

The object is passed down explicitly (runner -> model -> layers); nothing reads a module-level
"current group". The collectives use torch.distributed's default process group, which the engine
initialises (gloo on the CPU, NCCL on CUDA) before any model is built. A model built for planning
only (on the meta device) gets one too and never runs a collective.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommTime:
    """Seconds this rank spent in the forward's collectives, and how many it ran (what
    benchmarks/tensor_parallel.py reports per step)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class TensorParallel:
    """rank in [0, size). Rank 0 is the driver: it samples, and only it receives the logits.
    expert_parallel: a mixture-of-experts model holds whole routed experts, a different set on
    each rank (vLLM's enable_expert_parallel), instead of every expert's slice; dense models
    refuse it (model_runner.build_model)."""

    rank: int
    size: int
    expert_parallel: bool = False
    comm: CommTime = field(default_factory=CommTime, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x` (a row-parallel layer's output), in place."""
        x = x.contiguous()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self._count(t0)
        return x

    def _count(self, started: float) -> None:
        self.comm.seconds += time.perf_counter() - started
        self.comm.calls += 1

    def gather_vocab(self, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's logits columns joined on rank 0 ([N, vocab_size]); None on the other ranks.
        Each rank holds the same padded number of columns (layout.VocabShard), the padding is cut."""
        local_logits = local_logits.contiguous()
        t0 = time.perf_counter()
        if self.rank == 0:
            parts = [torch.empty_like(local_logits) for _ in range(self.size)]
            dist.gather(local_logits, parts, dst=0)
            self._count(t0)
            return torch.cat(parts, dim=-1)[..., :vocab_size]
        dist.gather(local_logits, None, dst=0)
        self._count(t0)
        return None
