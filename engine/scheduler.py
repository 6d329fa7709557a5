"""Scheduler: continuous batching under a token budget (vLLM v1 style).

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (one
token per decoding request, the next chunk for a request still in prefill), then waiting
requests in the order of the scheduling policy (engine/scheduling_policy.py: fcfs, lpm,
dfs-weight), each admitted with its prefix-cache hit. A request whose pages
cannot be allocated preempts the most recently admitted running request (recompute: its
pages go back, computed whole pages stay in the prefix cache, and it later resumes by
prefilling prompt + outputs so far, mostly from cache).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.scheduling_policy import SchedulingPolicy
from hybridkv.model_executor.batch import ModelInput, ScheduledSequence


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(eq=False)
class ScheduledRequest(ScheduledSequence):
    """One request's work in a step: the executor's ScheduledSequence (what the runner reads),
    plus the engine's Request it came from. The scheduler builds it once; the step's ModelInput
    is the scheduled list itself, with no per-request conversion."""

    request: Request

    @classmethod
    def of(cls, req: Request, start: int, n: int) -> "ScheduledRequest":
        toks = req.all_token_ids
        end = start + n
        return cls(
            req.request_id, toks[start:end], start, end, end == len(toks), req.params, req.generator,
            req.prompt_token_ids, req.output_token_ids, req,
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    def model_input(self) -> ModelInput:
        """The runner's view of the step: the scheduled sequences themselves (executor-side type)."""
        return ModelInput(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.policy = SchedulingPolicy(config.policy)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        allocate, scheduled = self.kv.allocate, out.scheduled  # hot loop: one pass per running request
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start, total = req.num_computed_tokens, len(req.all_token_ids)
            n = min(total - start, budget)
            while not allocate(req.request_id, start + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest.of(req, start, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; everything after it too

        # Admit waiting requests only when nobody had to be preempted this step.
        if self.waiting and budget > 0 and not out.preempted:
            order = self.policy.order(self.waiting, self.kv)
            for req in order.requests:
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                if req.request_id in order.deferred and (out.scheduled or self.running):
                    continue  # in-batch grouping: the group's first request computes the shared prefix
                if not self._admit(req, budget, now, out):
                    break
                budget -= out.scheduled[-1].num_new_tokens
        return out

    def _admit(self, req: Request, budget: int, now: float, out: SchedulerOutput) -> bool:
        hit = None
        if not req.wants_prompt_logprobs:  # cached tokens have no logits to report
            # touch=False: a request that cannot be admitted yet must not bump hit counts on
            # every retry; allocate(touch_hit=True) counts the hit once, when it is admitted.
            hit = self.kv.match_prefix(req.all_token_ids, req.namespace, touch=False)
            req.num_computed_tokens = hit.num_tokens
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.kv.allocate(
            req.request_id, req.num_computed_tokens + n, hit, req.namespace, req.priority, touch_hit=True
        ):
            req.num_computed_tokens = 0
            return False
        self.waiting.remove(req)
        if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
            req.num_cached_tokens = req.num_computed_tokens
            req.cached_tokens_per_space = dict(hit.per_space_tokens) if hit is not None else {}
            self.kv.record_query(req.num_prompt_tokens, hit)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest.of(req, req.num_computed_tokens, n))
        return True

    def _preempt(self, req: Request) -> None:
        # Computed whole pages go to the prefix cache first, so the resume is mostly a hit.
        self.kv.retire(req.request_id, req.all_token_ids, req.num_computed_tokens, turn_done=False)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the forward -------------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and publish newly completed pages to the prefix cache."""
        commit = self.kv.commit
        for s in out.scheduled:
            req = s.request
            end = req.num_computed_tokens = s.end
            # The prompt's end is marked as a likely match point: its siblings/retries match there.
            prompt_done = not req.output_token_ids and end == len(req.prompt_token_ids)
            commit(req.request_id, req.all_token_ids, end, prompt_done)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (finished or aborted) and release its pages."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
            # The turn's end is marked: the next turn of the conversation matches there.
            self.kv.retire(req.request_id, req.all_token_ids, req.num_computed_tokens, turn_done=True)
            return
        try:
            self.waiting.remove(req)
        except ValueError:
            pass
        self.kv.free(req.request_id)
