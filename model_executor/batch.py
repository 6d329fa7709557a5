"""The scheduled batch the model runner consumes, defined on the executor's side.

The engine builds a ModelInput from its SchedulerOutput each step (its ScheduledRequests are
ScheduledSequences, so the step's input is the scheduled list itself); the runner
never sees engine types, so model_executor does not import engine. Lists are the engine's own
(no copies): the runner only reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.model_executor.sampling_params import SamplingParams
from hybridkv.model_executor.token_bitmask import TokenBitmask


@dataclass(eq=False, slots=True)  # slots: one is built per request per step
class ScheduledSequence:
    """One sequence's work in a step: compute positions [start, end)."""

    request_id: str
    token_ids: list[int]  # the new tokens, one per computed position
    start: int  # first position computed (= tokens already in the KV cache)
    end: int  # start + len(token_ids): plain fields, read several times per sequence per step
    samples: bool  # the chunk reaches the last known token: sample the next one
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties read them)

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and this chunk covers prompt positions."""
        return self.params.prompt_logprobs is not None and self.start < self.num_prompt_tokens


@dataclass
class ModelInput:
    """One step's work for the runner (the engine's SchedulerOutput says how much and what else)."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    # Structured outputs: the allowed next tokens of the constrained sequences that sample now,
    # read by the sampler only (rank 0 under tensor parallelism: never sent to the workers).
    token_bitmask: TokenBitmask | None = None
    # Speculative decoding: sequences whose every row gets its greedy token (the last accepted
    # token and its drafts, verified in one forward); they sample nothing else.
    verify: frozenset[str] = frozenset()


def verify_rows(sequences: list[ScheduledSequence], verify: frozenset[str]) -> list[ScheduledSequence]:
    """The step's sequences with each verified chunk (a decoding request's last token and its
    drafts at positions start..end-1) split into one-token decodes, one per position, in order.

    Row j then runs as the decode of position start + j over the context up to it: every layer
    writes all rows' K/V before attending, so it reads the earlier drafts' K/V as a decode step
    after accepting them would, through the same paged decode kernel (and the fused decode path)
    whose bits plain decoding produces. A verify step thus costs about one decode step of k+1 rows
    instead of a prefill chunk's path, and its greedy tokens are the ones one-token decoding gives."""
    if not verify:
        return sequences
    out: list[ScheduledSequence] = []
    for s in sequences:
        if s.request_id not in verify:
            out.append(s)
            continue
        for j, tok in enumerate(s.token_ids):
            out.append(ScheduledSequence(s.request_id, [tok], s.start + j, s.start + j + 1, False, s.params,
                                         s.generator, s.prompt_token_ids, s.output_token_ids))
    return out
