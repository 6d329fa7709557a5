"""The "auto" step target (engine/step_target.py): a fixed amount of prefill work, in seconds at
the rate the scheduler's StepTimer measures."""
from __future__ import annotations

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.step_target import (
    LONGEST_PER_TARGET, MAX_LONGEST_SECONDS, MAX_TARGET_SECONDS, MIN_TARGET_SECONDS, TOKENS_PER_TARGET,
    auto_step_target,
)
from hybridkv.engine.step_timer import StepTimer


def test_target_is_a_fixed_number_of_prompt_tokens_within_its_bounds():
    # The demo model on online_peer.py's load (Zen 4): ~1.17 ms a prompt token at the average rate of
    # steps with prefill in float32, ~0.73 ms in bf16 -> inside the ranges that met vLLM-CPU's TTFT
    # and TPOT at once (~0.16-0.2 s and ~0.09-0.12 s).
    assert auto_step_target(1.17e-3) == pytest.approx((TOKENS_PER_TARGET * 1.17e-3, TOKENS_PER_TARGET * 1.17e-3 * 1.9))
    assert 0.16 <= auto_step_target(1.17e-3)[0] <= 0.2 and 0.09 <= auto_step_target(0.73e-3)[0] <= 0.12
    assert auto_step_target(1e-6) == pytest.approx((MIN_TARGET_SECONDS, MIN_TARGET_SECONDS * LONGEST_PER_TARGET))
    # A slow model keeps the old fixed default, and no step is planned past the server's gap bound.
    assert auto_step_target(0.1) == (MAX_TARGET_SECONDS, MAX_LONGEST_SECONDS)
    assert MAX_LONGEST_SECONDS <= 0.5, "the server's latency goal bounds a stream's p99 gap at 0.5 s"
    for seconds in (1e-6, 1e-4, 1e-3, 1.0):
        target, longest = auto_step_target(seconds)
        assert MIN_TARGET_SECONDS <= target <= longest <= MAX_LONGEST_SECONDS


def test_an_explicit_longest_step_bounds_the_target():
    assert auto_step_target(1e-3, max_step_seconds=0.1) == (0.1, 0.1)
    assert auto_step_target(1e-3, max_step_seconds=0.5) == pytest.approx((0.14, 0.5))
    with pytest.raises(ValueError, match="seconds_per_token"):
        auto_step_target(0.0)


def test_config_accepts_auto_and_names_a_bad_value():
    EngineConfig(model="m", target_step_seconds="auto", max_step_seconds=0.3)
    with pytest.raises(ValueError, match="'auto'"):
        EngineConfig(model="m", target_step_seconds="fast")
    with pytest.raises(ValueError, match="max_step_seconds"):
        EngineConfig(model="m", target_step_seconds="auto", max_step_seconds=0)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_timer_average_rate_counts_whole_steps_with_prefill():
    timer = StepTimer(0.25)
    assert timer.average_seconds_per_flop == timer.seconds_per_flop  # nothing measured yet
    timer.observe(2e9, 0.010, computed_prefill=True)
    timer.observe(1e9, 0.020, computed_prefill=False)  # decode-only: not a sample
    timer.observe(1e7, 0.020, computed_prefill=True)  # too little work to say anything
    assert timer.average_seconds_per_flop == pytest.approx(0.010 / 2e9)
    timer.observe(1e9, 0.010, computed_prefill=True)
    a = timer.average_forgetting
    assert timer.average_seconds_per_flop == pytest.approx((a * 0.010 + 0.010) / (a * 2e9 + 1e9))


def test_scheduler_follows_the_rate_its_timer_measures(tiny_ckpt, caplog, monkeypatch):
    caplog.set_level("INFO", logger="hybridkv.engine.scheduler")
    rate = [None]  # seconds per FLOP the timer reports; None: its own
    own = StepTimer.average_seconds_per_flop
    monkeypatch.setattr(StepTimer, "average_seconds_per_flop",
                        property(lambda self: own.fget(self) if rate[0] is None else rate[0]))
    ckpt = tiny_ckpt("llama")
    eng = LLMEngine(EngineConfig(model=ckpt, max_model_len=512, target_step_seconds="auto"))
    sched = eng.scheduler
    per_token = sched.step_cost.flops_per_token
    assert (sched.gaps.target_seconds, sched.gaps.max_seconds) == auto_step_target(
        sched.timer.seconds_per_flop * per_token)  # the timer's first, pessimistic rate
    eng.add_request("stream", [5, 6, 7, 8], _greedy(12))
    outs = {}
    for seconds_per_token, expected in ((1e-3, (0.14, 0.14 * LONGEST_PER_TARGET)),
                                        (2e-3, (MAX_TARGET_SECONDS, MAX_LONGEST_SECONDS)),
                                        (1e-7, (MIN_TARGET_SECONDS, MIN_TARGET_SECONDS * LONGEST_PER_TARGET))):
        rate[0] = seconds_per_token / per_token
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        assert (sched.gaps.target_seconds, sched.gaps.max_seconds) == pytest.approx(expected)
        assert f"step target (auto): {expected[0]:.3f} s" in caplog.text, "a moved target is logged"
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
    # The target sizes chunks, never tokens: the same output as with no target at all.
    ref = LLMEngine(EngineConfig(model=ckpt, max_model_len=512))
    ref.add_request("stream", [5, 6, 7, 8], _greedy(12))
    while ref.has_unfinished_requests():
        for o in ref.step():
            if o.finished:
                assert o.outputs[0].token_ids == outs["stream"]


def test_an_explicit_longest_step_holds_with_auto(tiny_ckpt, monkeypatch):
    eng = LLMEngine(EngineConfig(model=tiny_ckpt("llama"), max_model_len=512, target_step_seconds="auto",
                                 max_step_seconds=0.07))
    sched = eng.scheduler
    monkeypatch.setattr(StepTimer, "average_seconds_per_flop",
                        property(lambda self: 1e-3 / sched.step_cost.flops_per_token))  # 0.14 s by the rule alone
    eng.add_request("stream", [5, 6, 7], _greedy(3))
    while eng.has_unfinished_requests():
        eng.step()
        assert (sched.gaps.target_seconds, sched.gaps.max_seconds) == (0.07, 0.07)
