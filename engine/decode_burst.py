"""How many greedy decode steps a schedule may run in one model call (num_scheduler_steps).

A decode step of a small model on the CPU is its weight stream plus the Python around it: the
scheduler, the step's metadata, the sampler, the stop checks and the outputs. That Python runs
on caches the weight stream has just emptied: single-stream, the demo model in bf16 on a 2-core
Zen 4, ~0.8-1.0 ms of an 8-10 ms step outside the layers and the logits (a whole step of a
one-layer model of the same vocabulary, everything warm, takes ~0.26 ms). A burst runs k steps
in one C++ call (FusedDecode.burst: the layers, the logits head and the greedy argmax, k times)
and the engine then books the tokens one step at a time, so every request's tokens, stops, pages
and outputs are those k single steps would have given.

A burst is taken only where k single steps would have done nothing but decode greedily:
- every scheduled request is a decode, every running request is scheduled, none was preempted
  and none waits (a waiting request would otherwise be admitted k steps late);
- each samples by plain argmax: greedy, no logprobs, no penalties, min_tokens already reached
  (the sampler's own test for its argmax path), so the head's argmax is the sampler's token;
- no tier below the device (host, storage, HiSparse), whose copies are planned step by step;
- k is cut to what every request may still generate (max_tokens, max_model_len). A request that
  stops inside a burst (EOS, a stop token or string) leaves the tokens computed after its stop
  unused: their K/V sits past the request's end in pages it frees, and no page holding them is
  published (only whole pages of its computed tokens are).
"""
from __future__ import annotations

from collections.abc import Sequence

from hybridkv.engine.config import DEFAULT_SCHEDULER_STEPS
from hybridkv.engine.request import Request
from hybridkv.model_executor.sampler import plain_greedy


def burst_limit(num_scheduler_steps: int | None, target_step_seconds: float | str | None, streaming: bool) -> int:
    """The most steps a call may run (EngineConfig.num_scheduler_steps resolved): as set, else
    DEFAULT_SCHEDULER_STEPS offline, and 1 under a step-time target or for a server that streams
    (a burst of k steps hands each stream k tokens at once and admits new requests k steps late)."""
    if num_scheduler_steps is not None:
        return num_scheduler_steps
    return 1 if streaming or target_step_seconds is not None else DEFAULT_SCHEDULER_STEPS


def burst_steps(limit: int, scheduled: Sequence[Request], num_new_tokens: Sequence[int], num_running: int,
                num_waiting: int, max_model_len: int) -> int:
    """Steps the next model call may run (1: an ordinary step). scheduled: the step's requests,
    num_new_tokens: each one's tokens this step."""
    if limit <= 1 or num_waiting or len(scheduled) != num_running or not scheduled:
        return 1
    steps = limit
    for req, n in zip(scheduled, num_new_tokens):
        if n != 1 or not req.output_token_ids or not plain_greedy(req.params, req.num_output_tokens):
            return 1
        steps = min(steps, req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens)
        if steps <= 1:
            return 1
    return steps
