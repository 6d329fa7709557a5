"""The "auto" step target (`hybridkv serve`'s default): a fixed amount of prefill work, in seconds
on this machine.

A step target is a latency budget: while streams decode, prefill chunks are sized so that a
stream's gaps between tokens average the target (engine/gap_budget.py). The right number of
seconds depends on the model, the dtype and the machine. On the online load of benchmarks/online_peer.py (random 512
in / 64 out, concurrency 16, demo model, 2-core Zen 4; benchmarks/README.md) the old fixed 0.25 s left TPOT at vLLM-CPU's (float32 1.02x, bf16
0.97x); the targets that beat vLLM on TTFT and TPOT at once were ~0.16-0.2 s in float32 and
~0.09-0.12 s in bfloat16, while 0.14 s (float32) and 0.07 s (bf16) let first tokens wait about
as long as vLLM's or longer. Both good ranges are the time of about TOKENS_PER_TARGET prompt
tokens at the average rate of the steps that carry prefill there (~1.17 ms a token in float32,
~0.73 ms in bf16): the load is mostly prefill, and what a step can carry beside its decodes
without queueing prompts is an amount of prefill work, not of time.

So "auto" takes

    target  = TOKENS_PER_TARGET x (average seconds per FLOP x FLOPs per prompt token), within
              [MIN_TARGET_SECONDS, MAX_TARGET_SECONDS]
    longest = LONGEST_PER_TARGET x target, at most MAX_LONGEST_SECONDS

with the average seconds per FLOP of the last ~30 steps that computed prefill, everything in them
included, as the scheduler's StepTimer measures it (before the first one: the timer's
deliberately slow first rate, 20 GFLOP/s, which puts the demo model at the ceiling). A smaller
target raises the share of decodes and step overhead in each step, which slows that average and
raises the target again: the rule steadies itself.

Normalisers tried first, and why not: a multiple of the live decode batch's time shrinks when
prompts queue (fewer streams decode), which shrinks chunks and queues more prompts (in process:
throughput -9%, TTFT x2-3); a multiple of a lone decode step timed at start-up is a memory-bound
time, and this VM's memory speed moved it 12-23 ms (float32) between engines built a minute
apart, while prefill is compute-bound; the timer's fitted marginal rate (what prices a chunk)
trades off against its overhead term and swung 157-374 GFLOP/s within one float32 run, moving
the target 0.09-0.22 s.
"""
from __future__ import annotations

STEP_TARGET_AUTO = "auto"
TOKENS_PER_TARGET = 140
# max_step_seconds / target in the measured settings (0.16 / 0.3 float32, 0.09 / 0.17 bf16).
LONGEST_PER_TARGET = 1.9
# The old fixed default: a model or machine whose prefill is slower keeps it (gap_budget's
# MIN_PREFILL_SHARE then gives prompts half of every step that decodes take most of).
MAX_TARGET_SECONDS = 0.25
# The server's latency goal bounds a stream's p99 gap at 0.5 s.
MAX_LONGEST_SECONDS = 0.4
# Below this a step's fixed cost (scheduling, metadata, sampling: ~1 ms in Python) takes a
# noticeable share of every short prefill chunk.
MIN_TARGET_SECONDS = 0.05


def auto_step_target(seconds_per_token: float, max_step_seconds: float | None = None) -> tuple[float, float]:
    """(target, longest step) in seconds where a prompt token takes seconds_per_token (at the
    average rate of steps with prefill). An explicit max_step_seconds is kept as the longest
    step, and the target never exceeds it."""
    if not seconds_per_token > 0:
        raise ValueError(f"seconds_per_token must be > 0, got {seconds_per_token}")
    target = min(MAX_TARGET_SECONDS, max(MIN_TARGET_SECONDS, TOKENS_PER_TARGET * seconds_per_token))
    if max_step_seconds is not None:
        return min(target, max_step_seconds), max_step_seconds
    return target, min(MAX_LONGEST_SECONDS, LONGEST_PER_TARGET * target)
