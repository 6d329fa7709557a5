"""Scheduler: continuous batching under a token budget (vLLM v1 style).

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (one
token per decoding request, the next chunk for a request still in prefill), then waiting
requests in the order of the scheduling policy (engine/scheduling_policy.py: fcfs, lpm,
dfs-weight), each admitted with its prefix-cache hit.

Latency target (`target_step_seconds`, the server's default): while any interactive (streamed)
request is decoding or waiting for its first token, a
step's prefill chunks are sized so that the step's estimated time stays under the target (FLOPs
from the model's StepCost, seconds per FLOP learnt by engine/step_timer.py). A long prompt then
arrives in many short chunks instead of freezing every stream for one long step, and a burst of
streamed prompts gets its first tokens one prompt after another (steps up to max_step_seconds)
instead of all at the end of one step that prefilled them all. When nobody watches (only
non-streamed requests) the token budget alone applies, for throughput. One prefill chunk of at
least `min_prefill_chunk` tokens always runs, so prefill never starves.
With `max_step_seconds` above the target (the server's default), the target is the streams'
mean gap rather than every step's: time steps leave under it is kept as credit and a later
step spends it on a longer prefill chunk, up to max_step_seconds (engine/gap_budget.py); a step
planned to bank credit runs decodes only.

A request whose pages
cannot be allocated preempts the most recently admitted running request (recompute: its
pages go back, computed whole pages stay in the prefix cache, and it later resumes by
prefilling prompt + outputs so far, mostly from cache).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.engine.gap_budget import GapBudget, check_step_seconds
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.scheduling_policy import SchedulingPolicy
from hybridkv.engine.step_target import MAX_TARGET_SECONDS, STEP_TARGET_AUTO, auto_step_target
from hybridkv.engine.step_timer import StepTimer
from hybridkv.model_executor.batch import ModelInput, ScheduledSequence
from hybridkv.model_executor.step_cost import StepCost

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    # None: the token budget alone sizes prefill chunks; "auto": engine/step_target.py
    target_step_seconds: float | str | None = None
    # The longest step planned while streams decode (engine/gap_budget.py); None: the target, so
    # every step is held to it. Above it, time steps leave under the target buys longer prefill steps.
    max_step_seconds: float | None = None
    min_prefill_chunk: int = 4  # tokens; the prefill progress every step makes at least
    preemption_mode: str = "recompute"  # "swap": the KV manager keeps a preempted request's pages below the device

    def __post_init__(self) -> None:
        check_step_seconds(self.target_step_seconds, self.max_step_seconds)
        if self.min_prefill_chunk < 1:
            raise ValueError(f"min_prefill_chunk must be >= 1, got {self.min_prefill_chunk}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(eq=False, slots=True)
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
    estimated_flops: float = 0.0  # priced only when the scheduler has a latency target
    estimated_reads: float = 0.0  # K/V read once per chunk (StepCost.chunk_reads units)
    computed_prefill: bool = False  # some chunk computed more than one token
    # Speculative decoding: request id -> the drafts it verifies this step (its chunk is the last
    # token + these; engine/speculative/verifier.py books it)
    drafts: dict[str, list[int]] = field(default_factory=dict)

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
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, step_cost: StepCost | None = None) -> None:
        self.config = config
        self.kv = kv
        self.step_cost = step_cost
        self.timer: StepTimer | None = None
        self.gaps: GapBudget | None = None
        self.auto_target = config.target_step_seconds == STEP_TARGET_AUTO
        if config.target_step_seconds is not None:
            if step_cost is None:
                raise ValueError("a target_step_seconds needs the model's step_cost to price chunks")
            if self.auto_target:  # follows the timer's average rate (its first, slow one until measured)
                self.timer = StepTimer(MAX_TARGET_SECONDS)
                self.gaps = GapBudget(*self._auto_step_target())
                self._logged_target = self.gaps.target_seconds
            else:
                self.timer = StepTimer(config.target_step_seconds)
                self.gaps = GapBudget(config.target_step_seconds, config.max_step_seconds or config.target_step_seconds)
        # Preemption accounting: resumes that loaded pages back from the host (swap-ins), tokens
        # they loaded, and whole-page tokens a resume had to recompute (the cache had lost them).
        self.num_swap_ins = 0
        self.num_resumed_host_tokens = 0
        self.num_recomputed_after_preemption = 0
        # Per step, while watched requests decode: seconds left for prefill chunks (None = no limit).
        self._seconds_left: float | None = None
        self._floor_used = False  # this step's guaranteed min_prefill_chunk went to someone
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.policy = SchedulingPolicy(config.policy)
        # Speculative decoding's drafter (engine/speculative/: ngram_proposer.py, mtp_proposer.py); None: off.
        self.proposer = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.kv.request_arrived(request.request_id, request.all_token_ids, request.namespace,
                                cacheable=not request.wants_prompt_logprobs)

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
        if self.timer is not None:
            self._start_pricing(out)
        self.kv.poll()
        if self.proposer is not None:  # drafts for the whole batch at once, where the drafter batches them
            self.proposer.begin_step(running=self.running)

        # Hot loop: one pass per running request. A decode that stays inside its last page (the
        # common step) skips the allocate call: its pages' grow_at says there is nothing to do.
        i = 0
        running, timer, pages_of = self.running, self.timer, self.kv.request_pages
        allocate, scheduled = self.kv.allocate, out.scheduled
        while i < len(running) and budget > 0:
            req = running[i]
            toks = req.all_token_ids
            start, total = req.num_computed_tokens, len(toks)
            n = total - start
            if n > budget:
                n = budget
            if timer is not None and (total - start > 1 or not req.output_token_ids):  # not a decode
                n = self._price_chunk(start, n, total, out)
                if n == 0:  # over this step's latency budget: it continues next step
                    i += 1
                    continue
            if n == 1 and self.proposer is not None and req.output_token_ids:
                drafts = self.proposer.propose(req, budget)
                # all-or-nothing like any chunk; with no room the request just decodes
                if drafts and allocate(req.request_id, total + len(drafts), decode=True):
                    out.drafts[req.request_id] = drafts
                    scheduled.append(ScheduledRequest(
                        req.request_id, toks[start:total] + drafts, start, total + len(drafts), False, req.params,
                        req.generator, req.prompt_token_ids, req.output_token_ids, req,
                    ))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            end = start + n
            pages = pages_of.get(req.request_id)
            if pages is None or end >= pages.grow_at:
                preempted_self = False
                while not allocate(req.request_id, end, decode=n == 1 and bool(req.output_token_ids)):
                    victim = running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        preempted_self = True
                        break
                if preempted_self:
                    break  # everything after it was preempted too
            scheduled.append(ScheduledRequest(  # ScheduledRequest.of, inlined
                req.request_id, toks[start:end], start, end, end == total, req.params, req.generator,
                req.prompt_token_ids, req.output_token_ids, req,
            ))
            budget -= n
            i += 1

        # Admit waiting requests only when nobody had to be preempted this step.
        if self.waiting and budget > 0 and not out.preempted:
            order = self.policy.order(self.waiting, self.kv)
            for req in order.requests:
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                if req.request_id in order.deferred and (out.scheduled or self.running):
                    continue  # in-batch grouping: the group's first request computes the shared prefix
                if req.num_cached_tokens < 0 and not self.kv.ready(req.request_id, req.all_token_ids, req.namespace):
                    continue  # its prefix is still being read
                if req.grammar is not None and not req.grammar_ready:
                    continue  # its grammar is still compiling (structured outputs)
                if not self._admit(req, budget, now, out):
                    break
                budget -= out.scheduled[-1].num_new_tokens
        return out

    def _admit(self, req: Request, budget: int, now: float, out: SchedulerOutput) -> bool:
        hit = None
        if not req.wants_prompt_logprobs:  # cached tokens have no logits to report
            # touch=False: a request that cannot be admitted yet must not bump hit counts on
            # every retry; allocate(touch_hit=True) counts the hit once, when it is admitted.
            hit = self.kv.match_prefix(req.all_token_ids, req.namespace, touch=False, request_id=req.request_id)
            req.num_computed_tokens = hit.num_tokens
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.timer is not None:
            n = self._price_chunk(req.num_computed_tokens, n, req.num_tokens, out)
        if n == 0 or not self.kv.allocate(
            req.request_id, req.num_computed_tokens + n, hit, req.namespace, req.priority, touch_hit=True
        ):
            req.num_computed_tokens = 0
            return False
        self.waiting.remove(req)
        if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
            req.num_cached_tokens = req.num_computed_tokens
            # where the hit came from below the device (the request's metrics report it)
            req.num_host_cached_tokens, req.num_storage_cached_tokens = self.kv.admitted(req.request_id, hit)
            req.cached_tokens_per_space = dict(hit.per_space_tokens) if hit is not None else {}
            self.kv.record_query(req.num_prompt_tokens, hit)
        elif req.num_preemptions:  # a resume: what came back, and what the cache no longer held
            self.num_resumed_host_tokens += hit.host_tokens if hit is not None else 0
            if hit is not None and hit.host_tokens:
                self.num_swap_ins += 1
            lost = req.num_computed_tokens_at_preemption
            self.num_recomputed_after_preemption += max(0, lost - req.num_computed_tokens)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest.of(req, req.num_computed_tokens, n))
        return True

    # -- latency target ------------------------------------------------------------------------
    def _start_pricing(self, out: SchedulerOutput) -> None:
        """Price this step's decodes (O(1) per running request) and set the seconds left for
        prefill chunks; no limit unless an interactive (streamed) request decodes or waits."""
        n = context = 0
        watched = False
        for r in self.running:
            computed = r.num_computed_tokens
            if r.output_token_ids and len(r.all_token_ids) - computed == 1:
                n += 1
                context += computed
                watched = watched or r.interactive
        self._floor_used = False
        if self.auto_target:
            self._retarget()
        cost = self.step_cost
        flops = cost.decode_flops(n, context) if n else 0.0
        out.estimated_flops = flops
        out.estimated_reads = max(0.0, flops - n * (cost.flops_per_token + cost.flops_per_sample))  # its attention
        decode_seconds = self.timer.seconds(flops, out.estimated_reads)
        if watched:
            allowed = self.gaps.plan(True, decode_seconds)
        else:
            # A streamed prompt waiting for its first token watches this step too: one step that
            # prefilled every waiting prompt would hand each its first token only at the end of
            # all of them; steps held to max_step_seconds finish them one after another. (Stops
            # at the first interactive request: on a server that is the queue's head.)
            waiting_stream = any(r.interactive for r in self.waiting)
            allowed = self.gaps.plan_first_tokens(decode_seconds) if waiting_stream else self.gaps.plan(False, 0.0)
        if self.gaps.banking:  # decodes only, not even the minimum chunk
            self._floor_used = True
        self._seconds_left = None if allowed is None else allowed - decode_seconds

    def _retarget(self) -> None:
        """The "auto" target at the timer's current rate; logged when it moves by a tenth."""
        target, longest = self._auto_step_target()
        self.gaps.retarget(target, longest)
        if abs(target - self._logged_target) > 0.1 * self._logged_target:
            self._logged_target = target
            logger.info("step target (auto): %.3f s, longest step %.3f s (steps with prefill ran at %.0f GFLOP/s)",
                        target, longest, 1e-9 / self.timer.average_seconds_per_flop)

    def _auto_step_target(self) -> tuple[float, float]:
        """The "auto" (target, longest step): a fixed number of prompt tokens at the average
        rate the timer has measured (engine/step_target.py)."""
        per_token = self.timer.average_seconds_per_flop * self.step_cost.flops_per_token
        return auto_step_target(per_token, self.config.max_step_seconds)

    def _price_chunk(self, start: int, n: int, total: int, out: SchedulerOutput) -> int:
        """How many of n prefill tokens from `start` (of `total` known) fit this step; charges
        them to the step."""
        cost, timer = self.step_cost, self.timer
        if self._seconds_left is not None:
            sample = timer.seconds_per_flop * cost.flops_per_sample if start + n == total else 0.0
            fit = cost.max_chunk(start, n, self._seconds_left - sample, timer.seconds_per_flop, timer.seconds_per_read)
            if fit < min(n, self.config.min_prefill_chunk) and not self._floor_used:
                fit = min(n, self.config.min_prefill_chunk)  # the one chunk that always runs
            if fit == 0:
                return 0
            self._floor_used = True
            n = fit
        flops = cost.chunk_flops(start, n, samples=start + n == total)
        reads = cost.chunk_reads(start, n)
        if self._seconds_left is not None:
            self._seconds_left -= timer.seconds_per_flop * flops + timer.seconds_per_read * reads
        out.estimated_flops += flops
        out.estimated_reads += reads
        out.computed_prefill = True
        return n

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The wall time of a step this scheduler planned (the timer learns from it)."""
        if self.timer is not None:
            self.gaps.observe(seconds)
            self.timer.observe(out.estimated_flops, seconds, out.computed_prefill, out.estimated_reads)

    def _preempt(self, req: Request) -> None:
        # Computed whole pages go to the prefix cache first, so the resume is mostly a hit.
        self.kv.retire(req.request_id, req.all_token_ids, req.num_computed_tokens, turn_done=False,
                       swap=self.config.preemption_mode == "swap")
        req.num_computed_tokens_at_preemption = req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the forward -------------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and publish newly completed pages to the prefix cache."""
        commit, pages_of = self.kv.commit, self.kv.request_pages
        drafts = out.drafts
        for s in out.scheduled:
            if drafts and s.request_id in drafts:
                continue  # its computed count is what verification accepts (verifier.py)
            req = s.request
            end = req.num_computed_tokens = s.end
            # The prompt's end is marked as a likely match point: its siblings/retries match there.
            prompt_done = not req.output_token_ids and end == len(req.prompt_token_ids)
            if not prompt_done and end < pages_of[req.request_id].commit_at:
                continue  # no page completed, no window moved past a page (KVCacheManager.commit)
            commit(req.request_id, req.all_token_ids, end, prompt_done)

    def update_after_decodes(self, requests: list[Request]) -> None:
        """update_after_step for one more step of these decodes (a decode burst's later steps):
        each computed one more token."""
        commit, pages_of = self.kv.commit, self.kv.request_pages
        for req in requests:
            end = req.num_computed_tokens = req.num_computed_tokens + 1
            if end >= pages_of[req.request_id].commit_at:
                commit(req.request_id, req.all_token_ids, end)

    def update_after_verify(self, req: Request, num_computed_tokens: int) -> None:
        """A verified request's computed count: only its accepted tokens. The pages taken for the
        rejected positions past them go back; the slots of rejected tokens in the last page kept
        are overwritten by later tokens, and no page is published before it is whole."""
        req.num_computed_tokens = num_computed_tokens
        self.kv.truncate(req.request_id, num_computed_tokens)
        if num_computed_tokens >= self.kv.request_pages[req.request_id].commit_at:
            self.kv.commit(req.request_id, req.all_token_ids, num_computed_tokens)

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
