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

from block_manager.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduling_policy import SchedulingPolicy


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


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens before the step)
    num_new_tokens: int
    samples: bool  # the chunk reaches the last known token: sample the next one

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


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
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens))
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
            hit = self.kv.match_prefix(req.all_token_ids, req.namespace)
            req.num_computed_tokens = hit.num_tokens
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.kv.allocate(req.request_id, req.num_computed_tokens + n, hit, req.namespace, req.priority):
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
        out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens))
        return True

    def _preempt(self, req: Request) -> None:
        # Computed whole pages go to the prefix cache first, so the resume is mostly a hit.
        self.kv.cache_computed_pages(req.request_id, req.all_token_ids, req.num_computed_tokens)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the forward -------------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and publish newly completed pages to the prefix cache."""
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens = s.end
            self.kv.cache_computed_pages(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_prompt_tokens and not req.output_token_ids:
                self.kv.mark_boundary(req.request_id)  # the prompt's end: its siblings/retries match here
            self.kv.release_out_of_window(req.request_id, req.num_computed_tokens)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (finished or aborted) and release its pages."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
            self.kv.cache_computed_pages(req.request_id, req.all_token_ids, req.num_computed_tokens)
            self.kv.mark_boundary(req.request_id)  # the turn's end: the next turn matches here
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req.request_id)
