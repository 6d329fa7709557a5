"""StepExecutor: one scheduled step on the model, behind one call.

It asks the KV manager for the step's plan (block tables, rows, tier copies) and has the model
runner execute it: an ordinary forward, or a decode burst of several greedy steps in one model
call (engine/decode_burst.py) where the schedule allows one. Between steps it hands the runner
the copies decided since the last plan (write-through of pages a step completed, copies of
pages requests published as they left) and tells the manager they ran, so the storage tier's
write-behind can read them; it also tells the runner which requests left (their HiSparse
hot-buffer rows), before each step and at each flush, so an idle engine holds none. The engine
books what comes back.
"""
from __future__ import annotations

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.engine.decode_burst import burst_steps
from hybridkv.engine.scheduler import Scheduler, SchedulerOutput
from hybridkv.model_executor.batch import ModelInput
from hybridkv.model_executor.model_runner import ModelRunner, RunnerOutput, SampledToken
from hybridkv.model_executor.token_bitmask import TokenBitmask


# Decode steps a burst runs at most while speculative decoding is on (see StepExecutor.__init__).
SPECULATIVE_BURST_STEPS = 4


class StepExecutor:
    def __init__(self, kv: KVCacheManager, runner: ModelRunner, max_model_len: int, burst_limit: int,
                 stats: dict, speculative: bool = False) -> None:
        """burst_limit: the most decode steps one model call may run (1: never a burst).
        stats: the engine's counters ("burst_calls" is counted here). speculative: drafts are
        verified (engine/speculative/): a step that verifies drafts is never a burst, and one in
        which no request found a draft runs a short one (SPECULATIVE_BURST_STEPS), so text that
        does not repeat keeps most of what bursts save while drafting resumes soon after."""
        self.kv, self.runner, self.max_model_len = kv, runner, max_model_len
        self.burst_limit = burst_limit
        self.speculative = speculative
        self.stats = stats

    def run(self, sched: SchedulerOutput, scheduler: Scheduler,
            token_bitmask: TokenBitmask | None = None) -> list[RunnerOutput]:
        """Execute a non-empty schedule: one RunnerOutput per decode step run (several for a
        burst, each with every scheduled sequence's token of that step; the caller stops taking
        a sequence's tokens once it stopped). token_bitmask: the allowed next tokens of the
        constrained sequences (structured outputs); a step with one never runs as a burst."""
        self.runner.release_requests(self.kv.take_freed())  # preempted by this schedule
        steps = 1 if token_bitmask is not None else self._burst_steps(sched, scheduler)
        if steps > 1:
            tokens = self._run_burst(sched, steps)
            if tokens is not None:
                return [RunnerOutput(sampled={rid: SampledToken(toks[j], None, None) for rid, toks in tokens.items()})
                        for j in range(steps)]
        plan = self.kv.plan([s.request_id for s in sched.scheduled])
        return [self.runner.execute(ModelInput(sched.scheduled, token_bitmask, frozenset(sched.drafts)), plan)]

    def flush_copies(self) -> None:
        """Execute the tier copies decided since the last plan, now (no forward waits for them),
        and release the runner's state of the requests that left."""
        self.runner.release_requests(self.kv.take_freed())
        copies = self.kv.take_transfers()
        if copies.empty:
            return
        self.runner.run_copies(copies)
        self.kv.copies_done(copies)

    # -- decode bursts (num_scheduler_steps) ------------------------------------------------------
    def _burst_steps(self, sched: SchedulerOutput, scheduler: Scheduler) -> int:
        if (self.burst_limit <= 1 or sched.drafts or sched.preempted or self.kv.storage is not None
                or self.runner.hot_buffers is not None or not self.runner.burst_fits(len(sched.scheduled))):
            return 1
        limit = min(self.burst_limit, SPECULATIVE_BURST_STEPS) if self.speculative else self.burst_limit
        return burst_steps(limit, [s.request for s in sched.scheduled],
                           [s.num_new_tokens for s in sched.scheduled], scheduler.num_running,
                           scheduler.num_waiting, self.max_model_len)

    def _run_burst(self, sched: SchedulerOutput, steps: int) -> dict[str, list[int]] | None:
        """The burst's tokens per request, or None (an ordinary step runs instead): the pages of
        all its steps are allocated first (all-or-nothing per request; pages taken for a burst
        that then does not run are the ones the next steps would take)."""
        for s in sched.scheduled:
            if not self.kv.allocate(s.request_id, s.end + steps - 1, decode=True):
                return None
        plan = self.kv.plan([s.request_id for s in sched.scheduled])
        if not plan.copies.empty:  # a burst runs without a host tier; nothing is pending then
            raise AssertionError("a decode burst was planned with tier copies pending")
        tokens = self.runner.execute_burst(sched.model_input(), steps, plan)
        if tokens is not None:
            self.stats["burst_calls"] += 1
        return tokens
