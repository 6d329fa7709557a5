"""BlockTable: the int32 page table of every running request in one block space.

Row r of `tensor` is one request's page ids in position order (page i holds tokens
[i*P, (i+1)*P)); entries it never had or already released hold NULL_PAGE (the reserved page 0).
This is the form paged kernels take (vLLM's BlockTable, FlashInfer's kv_indices): the runner
selects the rows of a step with one index_select instead of rebuilding tables from Python lists.

It is maintained incrementally by the KV cache manager: appending pages writes only those
entries, releasing a page writes one NULL_PAGE, freeing a row clears only the entries it used.
Writes are queued (last write to an entry wins) and applied with one index_put_ when the tensor
is next read (once per step), because a Python-level write into a tensor costs microseconds each. Rows are recycled; the
tensor grows by doubling when more requests run than it has rows, or when a request needs
more pages than a row holds.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridkv.block_manager.space_spec import NULL_PAGE


class BlockTable:
    def __init__(self, max_pages_per_row: int, initial_rows: int = 16) -> None:
        if max_pages_per_row < 1:
            raise ValueError(f"max_pages_per_row must be >= 1, got {max_pages_per_row}")
        self.width = max_pages_per_row
        self._tensor = torch.full((max(1, initial_rows), max_pages_per_row), NULL_PAGE, dtype=torch.int32)
        self.num_pages: list[int] = [0] * self._tensor.shape[0]  # entries written per row
        self._free_rows: list[int] = list(range(self._tensor.shape[0] - 1, -1, -1))
        # Queued writes (row, col) -> page. A dict, not lists: index_put_ leaves the winner among
        # duplicate indices unspecified, and a recycled row is rewritten before the next flush.
        self._pending: dict[tuple[int, int], int] = {}

    @property
    def tensor(self) -> torch.Tensor:
        """[rows, width] int32, with every queued write applied."""
        if self._pending:
            # Through a numpy view of the same memory: a fancy assignment there costs a few
            # microseconds against tens for tensor construction + index_put_ (once per step).
            idx = np.array(list(self._pending), dtype=np.int64)
            self._tensor.numpy()[idx[:, 0], idx[:, 1]] = np.fromiter(self._pending.values(), np.int32, len(idx))
            self._pending = {}
        return self._tensor

    @property
    def num_rows(self) -> int:
        return self._tensor.shape[0]

    def add_row(self) -> int:
        if not self._free_rows:
            old = self.tensor
            n = old.shape[0]
            self._tensor = torch.full((2 * n, self.width), NULL_PAGE, dtype=torch.int32)
            self._tensor[:n] = old
            self.num_pages.extend([0] * n)
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        n = self.num_pages[row]
        pending = self._pending
        for i in range(n):
            pending[row, i] = NULL_PAGE
        self.num_pages[row] = 0
        self._free_rows.append(row)

    def truncate(self, row: int, n: int) -> None:
        """Keep the row's first n entries (the others go back to NULL_PAGE)."""
        pending = self._pending
        for i in range(n, self.num_pages[row]):
            pending[row, i] = NULL_PAGE
        self.num_pages[row] = min(n, self.num_pages[row])

    def _widen(self, width: int) -> None:
        old = self.tensor
        self._tensor = torch.full((old.shape[0], width), NULL_PAGE, dtype=torch.int32)
        self._tensor[:, : self.width] = old
        self.width = width

    def append(self, row: int, pages: list[int]) -> None:
        n = self.num_pages[row]
        if n + len(pages) > self.width:
            self._widen(max(2 * self.width, n + len(pages)))
        pending = self._pending
        for i, page in enumerate(pages, start=n):
            pending[row, i] = page
        self.num_pages[row] = n + len(pages)

    def set(self, row: int, i: int, page: int) -> None:
        self._pending[row, i] = page

    def rows(self, rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """[len(rows), width] int32 copy of the given rows (width defaults to the longest row)."""
        if width is None:
            width = max((self.num_pages[int(r)] for r in rows), default=1) if rows.numel() else 1
        return torch.from_numpy(self.tensor.numpy()[:, : max(1, width)].take(rows.numpy(), axis=0))
