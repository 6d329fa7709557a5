"""The step's allowed-token bitmask: one row per constrained sequence that samples this step.

Rows are filled by llguidance's executor in parallel native threads (the GIL is released), one
int32 word per 32 vocabulary entries, and handed to the runner as a TokenBitmask
(model_executor/token_bitmask.py); unconstrained sequences have no row and are not touched.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridkv.engine.structured_output.request_grammar import RequestGrammar
from hybridkv.model_executor.token_bitmask import TokenBitmask

# Below this many rows the executor's thread hand-off costs more than it saves.
PARALLEL_ROWS = 4


class BitmaskBuilder:
    def __init__(self, width: int) -> None:
        """width: int32 words per row (ceil(vocab / 32))."""
        self.width = width
        self._executor: Any = None

    def build(self, rows: list[tuple[str, RequestGrammar, list[int]]]) -> TokenBitmask | None:
        """rows: (sequence id, its grammar, its output tokens) of each constrained sequence that
        samples now; every grammar is ready. None when there are none."""
        if not rows:
            return None
        import llguidance.numpy as llnp

        bits = np.zeros((len(rows), self.width), dtype=np.int32)
        matchers = [(grammar.sync(outputs), i) for i, (_, grammar, outputs) in enumerate(rows)]
        if len(matchers) >= PARALLEL_ROWS:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, matchers, bits)
        else:
            for matcher, i in matchers:
                llnp.fill_next_token_bitmask(matcher, bits, i)
        return TokenBitmask({seq_id: i for i, (seq_id, _, _) in enumerate(rows)}, torch.from_numpy(bits))
