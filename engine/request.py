"""Request: the engine's state for one sequence being generated."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

import torch

from hybridkv.engine.outputs import PositionLogprobs
from hybridkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridkv.engine.structured_output.request_grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what still fits in max_model_len
    namespace: Hashable = None  # prefix-cache namespace (cache salt / LoRA)
    index: int = 0  # which of the user's n samples this sequence is
    priority: int = 0  # higher = its cached pages are evicted later (eviction_policy="priority")
    # Fairness key: sequences with the same key came from one client request (its prompts x n);
    # admission is round-robin across keys, so one large request cannot hold others back.
    client_id: Hashable = None
    # A client watches the tokens arrive (a stream): its decodes hold prefill chunks to the
    # step-time target. A whole (non-streaming) response waits for its last token anyway.
    interactive: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache (set on first schedule)
    num_host_cached_tokens: int = 0  # of num_cached_tokens, those loaded back from the host tier
    num_storage_cached_tokens: int = 0  # of those, the ones the storage tier had prefetched
    num_computed_tokens_at_preemption: int = 0  # at the last preemption (swap accounting)
    cached_tokens_per_space: dict[str, int] = field(default_factory=dict)  # block space -> prompt tokens it served from cache
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Structured outputs: this sequence's grammar matcher (None: unconstrained). The scheduler
    # admits the request only once it is compiled (engine/structured_output/manager.py).
    grammar: "RequestGrammar | None" = None
    # Speculative decoding: this sequence's n-gram index (engine/speculative/ngram_proposer.py).
    ngram_index: object = None
    # Timestamps for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.logprobs is not None:
            self.logprobs = []
        # all_token_ids grows with outputs; a preempted request recomputes over all of it.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def grammar_ready(self) -> bool:
        """No grammar, or one compiled without error: the request may be admitted."""
        return self.grammar is None or (self.grammar.ready and self.grammar.error is None)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.finished else None
