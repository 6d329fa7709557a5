"""The vocab-parallel embedding: each rank looks up the tokens of its vocabulary rows, the others
contribute zeros, and an all-reduce gives every rank the full embedding."""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.model_executor.parallel.layout import VocabShard
from hybridkv.model_executor.parallel.state import TensorParallel


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's `shard.padded` vocabulary rows. An nn.Embedding subclass so
    that parameter counting (step_cost) and a tied LM head read its weight as usual."""

    def __init__(self, shard: VocabShard, hidden_size: int, parallel: TensorParallel) -> None:
        super().__init__(shard.padded, hidden_size)
        self.shard = shard
        self.parallel = parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.shard.start) | (input_ids >= self.shard.stop)
        local = (input_ids - self.shard.start).masked_fill(outside, 0)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)
