"""MTP drafting: the model's own multi-token prediction layer proposes the drafts (DeepSeek-V4).

The drafts come from the model runner (ModelRunner.propose_mtp; model_executor/mtp_drafter.py),
which keeps each request's MTP state next to the model: after every step it has run the MTP
layer over the step's rows with the main model's final streams, so a decoding request's first
draft is ready, and k-1 more are chained from it here. The chain writes the MTP layer's K/V at the
positions of the drafts, so their pages are allocated first -- the same allocation the scheduler
makes next for the verify chunk of the last token and its k drafts.
"""
from __future__ import annotations

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.engine.request import Request
from hybridkv.engine.speculative.config import SpeculativeConfig
from hybridkv.model_executor.model_runner import ModelRunner
from hybridkv.model_executor.sampler import plain_greedy


class MtpProposer:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.spec, self.max_model_len = spec, max_model_len
        self.runner, self.kv = runner, kv

    def propose(self, req: Request, budget: int) -> list[int]:
        """Up to num_speculative_tokens greedy drafts (at most budget - 1 and what the request may
        still generate after the step's own token); [] for a request that does not sample by plain
        argmax (those decode normally, which is exact) or has no MTP row at its last token."""
        if req.grammar is not None or not plain_greedy(req.params, req.num_output_tokens):
            return []
        k = min(self.spec.num_speculative_tokens, budget - 1, req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1)
        if k <= 0:
            return []
        if k > 1 and not self.kv.allocate(req.request_id, req.num_tokens + k, decode=True):
            k = 1  # no pages for the chain's positions: the first draft needs none
        # The chain writes into pages before the step's plan runs its tier copies: a page just
        # reused must be copied out first (StepExecutor.flush_copies does the same between steps).
        copies = self.kv.take_transfers()
        if not copies.empty:
            self.runner.run_copies(copies)
            self.kv.copies_done(copies)
        rid = req.request_id
        drafts = self.runner.propose_mtp([rid], [req.num_computed_tokens], [req.all_token_ids[-1]], k,
                                         self.kv.plan([rid], copies=False))
        return drafts.get(rid, [])
