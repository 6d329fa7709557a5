"""N-gram (prompt-lookup) drafting: the tokens that followed the last n tokens' most recent
earlier occurrence in the request's prompt + output.

Cost: each request keeps an index (NgramIndex) from every n-gram (prompt_lookup_min..max) to
the position of its latest earlier end. A step indexes only the tokens appended since the last
one (a few dict writes per token and n) and looks up at most max-min+1 keys, so a lookup costs
the same at any context length; the prompt is indexed once, at the request's first draft.
"""
from __future__ import annotations

from hybridkv.engine.request import Request
from hybridkv.engine.speculative.config import SpeculativeConfig
from hybridkv.model_executor.sampler import drafts_verifiable


class NgramIndex:
    def __init__(self, min_n: int, max_n: int, max_drafts: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # the n-grams ending before this position are recorded
        self.max_drafts = max_drafts
        self.draft_len = max_drafts  # this request's current draft length (adapt_draft_len)

    def adapt_draft_len(self, proposed: int, accepted: int) -> None:
        """After a verify: draft one more than was accepted when a draft was rejected, twice as
        many when all were taken. Each draft row costs a query row of the verify step; on text the
        drafts rarely predict (free answers) the draft shrinks to one token, which costs about
        nothing beside the decode row, and it grows back as soon as copying starts."""
        if accepted < proposed:
            self.draft_len = accepted + 1
        else:
            self.draft_len = min(self.max_drafts, 2 * max(self.draft_len, proposed))

    def propose(self, toks: list[int], k: int) -> list[int]:
        last = len(toks) - 1  # the suffix ending here is the query, not an earlier occurrence
        for p in range(self.indexed, last):
            for n, ends in self.ends.items():
                if p + 1 >= n:
                    ends[tuple(toks[p + 1 - n : p + 1])] = p  # later positions overwrite: the latest wins
        self.indexed = max(self.indexed, last)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > len(toks):
                continue
            p = self.ends[n].get(tuple(toks[len(toks) - n :]))
            if p is not None:
                return toks[p + 1 : p + 1 + k]
        return []


class NgramProposer:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec, self.max_model_len = spec, max_model_len

    def begin_step(self, running: list[Request]) -> None:
        """Nothing to prepare: each request's lookup is its own (propose)."""

    def propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decoding request (at most budget - 1 and what it may still generate after
        the step's own token); [] for a request whose drafts cannot be verified exactly
        (constrained, penalised, min_tokens not yet reached, with logprobs: sampler.drafts_verifiable;
        those decode normally, which is exact). Greedy and sampled requests are drafted alike."""
        if req.grammar is not None or not drafts_verifiable(req.params, req.num_output_tokens):
            return []
        k = min(self.spec.num_speculative_tokens, budget - 1, req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1)
        if k <= 0:
            return []
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max,
                                         self.spec.num_speculative_tokens)
        return req.ngram_index.propose(req.all_token_ids, min(k, req.ngram_index.draft_len))
