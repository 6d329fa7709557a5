"""MTP drafting: the model's own multi-token prediction layer proposes the drafts (DeepSeek-V4).

The drafts come from the model runner (ModelRunner.propose_mtp; model_executor/mtp_drafter.py),
which keeps each request's MTP state next to the model: after every step it has run the MTP
layer over the step's rows with the main model's final streams, so a decoding request's first
draft is ready, and k-1 more are chained from it -- for every decoding request of the batch in
one forward per draft position, when the step begins (begin_step); propose() then hands each
request its drafts as the scheduler reaches it. The chain writes the MTP layer's K/V at the
positions of the drafts, so their pages are allocated first: the allocation the scheduler makes
next for the verify chunk of the last token and its k drafts.
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
        self._drafts: dict[str, list[int]] = {}  # this step's, per request (begin_step)

    def _max_drafts(self, req: Request) -> int:
        """Drafts a decoding request may verify: none unless it samples by plain argmax (the others
        decode normally, which is exact), and no more than it may still generate after the step's
        own token."""
        if req.grammar is not None or not plain_greedy(req.params, req.num_output_tokens):
            return 0
        return min(self.spec.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def begin_step(self, running: list[Request]) -> None:
        """Draft for every running request that decodes this step, in one batched chain."""
        self._drafts = {}
        ids, computed, last, ks = [], [], [], []
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or not req.output_token_ids:
                continue  # not a decode (a prefill chunk, a resume)
            k = self._max_drafts(req)
            if k <= 0:
                continue
            if k > 1 and not self.kv.allocate(req.request_id, req.num_tokens + k, decode=True):
                k = 1  # no pages for the chain's positions: the first draft needs none
            ids.append(req.request_id)
            computed.append(req.num_computed_tokens)
            last.append(req.all_token_ids[-1])
            ks.append(k)
        if not ids:
            return
        # The chain writes into pages before the step's plan runs its tier copies: a page just
        # reused must be copied out first (StepExecutor.flush_copies does the same between steps).
        copies = self.kv.take_transfers()
        if not copies.empty:
            self.runner.run_copies(copies)
            self.kv.copies_done(copies)
        self._drafts = self.runner.propose_mtp(ids, computed, last, ks, self.kv.plan(ids, copies=False))

    def propose(self, req: Request, budget: int) -> list[int]:
        """This step's drafts of a decoding request, at most budget - 1 ([] where it has none: no
        MTP row at its last token, or it does not draft)."""
        return self._drafts.pop(req.request_id, [])[: max(0, budget - 1)]
