"""Verification of n-gram drafts: which drafted tokens the model agrees with, booked token by
token, and the counters that say how well drafting pays.

A drafted request runs as one chunk of k+1 rows (its last accepted token, then the k drafts); the
runner returns the model's token after its rows: for a greedy request the argmax after every row,
for a sampled one (temperature > 0) the token drawn from each row's sampling distribution up to the
first that differs from the draft (model_executor/rejection_sampler.py: speculative sampling,
exact). Draft i is accepted when it equals the model's token after row i and every earlier draft was
accepted; the model's token after the last accepted row follows them, so a step yields 1..k+1
tokens, each the one plain decoding would have produced (greedy), or with the law plain sampling
gives it (sampled; the same token for a seeded request). The tokens are taken one at a time with the
engine's stop checks (EOS, stop ids and strings, max_tokens): those after a stop are dropped, and
the request's computed length counts only the tokens it kept (the K/V of the rest is overwritten or
its pages given back). "The same token" holds bit for bit where the model's rows do not depend on
the chunk's row count (the engine's batch-invariance contract,
tests/engine/test_batch_invariance.py)."""
from __future__ import annotations

from typing import Callable

from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.scheduler import Scheduler
from hybridkv.engine.speculative.config import SpeculativeConfig
from hybridkv.engine.speculative.mtp_proposer import MtpProposer
from hybridkv.engine.speculative.ngram_proposer import NgramProposer


def accepted_length(drafts: list[int], tokens: list[int]) -> int:
    """The longest prefix of drafts equal to the model's tokens (which hold one more past it)."""
    a = 0
    while a < len(drafts) and drafts[a] == tokens[a]:
        a += 1
    return a


class Verifier:
    def __init__(self, scheduler: Scheduler, num_speculative_tokens: int, stats: dict) -> None:
        """stats: the engine's counters, where these are kept: verify chunks run (spec_drafts), draft
        tokens proposed and accepted, and per draft position the number accepted (position i is
        accepted only after 0..i-1 were)."""
        self.scheduler = scheduler
        self.stats = stats
        stats.update(spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0,
                     spec_accepted_per_position=[0] * num_speculative_tokens)

    @classmethod
    def attach(cls, spec: SpeculativeConfig | None, scheduler: Scheduler, max_model_len: int,
               stats: dict, runner=None) -> "Verifier | None":
        """The engine's verifier, with the scheduler's drafter set (None, nothing set: off); runner:
        the model runner, which drafts with method "mtp"."""
        if spec is None:
            return None
        scheduler.proposer = (MtpProposer(spec, max_model_len, runner, scheduler.kv) if spec.method == "mtp"
                              else NgramProposer(spec, max_model_len))
        return cls(scheduler, spec.num_speculative_tokens, stats)

    def book(self, req: Request, drafts: list[int], tokens: list[int],
             take: Callable[[int], RequestStatus | None]) -> RequestStatus | None:
        """Take the accepted tokens (tokens: the runner's RunnerOutput.verified entry; take: the
        engine's append + stop check of one token) and set the request's computed length to what it
        kept; the stop status, if one was reached."""
        a = accepted_length(drafts, tokens)
        st = self.stats
        st["spec_drafts"] += 1
        st["spec_draft_tokens"] += len(drafts)
        st["spec_accepted_tokens"] += a
        for i in range(a):
            st["spec_accepted_per_position"][i] += 1
        if req.ngram_index is not None:  # n-gram drafts adapt their length; MTP drafts k each step
            req.ngram_index.adapt_draft_len(len(drafts), a)
        start, kept, status = req.num_computed_tokens, 0, None
        for tok in drafts[:a] + [tokens[a]]:
            kept += 1
            status = take(tok)
            if status is not None:
                break
        # computed: the last known token and the accepted drafts the request kept
        self.scheduler.update_after_verify(req, start + kept)
        return status
