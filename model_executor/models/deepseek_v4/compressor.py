"""Token-group compressors of DeepSeek-V4 (CSA: ratio m with overlap; HCA: ratio m, none).

Every token contributes raw rows (C_t = W_kv x, Z_t = W_gate x). Entry w pools, per channel,
a softmax over the rows of its window (logits Z + learned position bias `ape`):
  HCA: the m rows of window w.
  CSA: 2m slots: the a-halves [:D] of window w-1 and the b-halves [D:] of window w
       (window 0 has no a-slots: weight 0). Receptive field 2m, stride m.
then RMSNorm and RoPE at the window's *first* token position w·m.

The raw rows live in the paged `state` space (written for every token, read back when a
window closes), so a sequence can stop and resume at any token: `project` computes the rows,
`pool` turns gathered rows into entries.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.model_executor.models.deepseek_v4.norms import V4RMSNorm
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope


class Compressor(nn.Module):
    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float, rope: InterleavedRope) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = (2 if overlap else 1) * head_dim
        self.row_width = width
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(ratio, width))  # float32 in every dtype
        self.norm = V4RMSNorm(head_dim, eps)
        self.rope = rope

    @property
    def rows_per_entry(self) -> int:
        return (2 if self.overlap else 1) * self.ratio

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw rows of the new tokens: (C [T, κD], Z [T, κD]), kept in float32 in the state space."""
        return self.wkv(x).float(), self.wgate(x).float()

    def pool(
        self, kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """kv/gate [E, rows_per_entry, κD] (window order), valid [E, rows] -> entries [E, D]."""
        m, D = self.ratio, self.head_dim
        ape = self.ape.float()
        if self.overlap:
            values = torch.cat((kv[:, :m, :D], kv[:, m:, D:]), dim=1)
            logits = torch.cat((gate[:, :m, :D] + ape[:, :D], gate[:, m:, D:] + ape[:, D:]), dim=1)
        else:
            values, logits = kv, gate + ape
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
        values = values.masked_fill(~valid[:, :, None], 0.0)
        pooled = (values.to(dtype) * torch.softmax(logits, dim=1).to(dtype)).sum(dim=1)
        return self.rope(self.norm(pooled), positions)
