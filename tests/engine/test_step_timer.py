"""StepTimer (engine/step_timer.py): fits a prefill step's overhead and its seconds per FLOP from
observed steps, and turns a latency target into a FLOP budget."""
from __future__ import annotations

import pytest

from hybridkv.engine.step_timer import StepTimer


def test_fits_overhead_and_per_flop_time_from_prefill_steps():
    overhead, rate = 0.08, 50e9
    timer = StepTimer(0.25)
    for i in range(40):
        f = (2 + i % 5) * 1e9
        timer.observe(f, overhead + f / rate, computed_prefill=True)
        timer.observe(1e8, 0.02, computed_prefill=False)  # decode-only steps do not enter the fit
    assert timer.overhead_seconds == pytest.approx(overhead, rel=0.05)
    assert 1 / timer.seconds_per_flop == pytest.approx(rate, rel=0.05)
    assert timer.budget_flops == pytest.approx((0.25 - overhead) * rate, rel=0.05)


def test_follows_a_machine_that_slows_down():
    timer = StepTimer(0.25)
    for i in range(30):
        f = (1 + i % 4) * 1e9
        timer.observe(f, 0.01 + f / 100e9, computed_prefill=True)
    fast = timer.budget_flops
    for i in range(30):
        f = (1 + i % 4) * 1e9
        timer.observe(f, 0.01 + f / 25e9, computed_prefill=True)
    assert timer.budget_flops == pytest.approx(fast / 4, rel=0.15)


def test_equal_samples_fall_back_to_the_average_rate():
    timer = StepTimer(0.25)
    for _ in range(10):
        timer.observe(2e9, 0.1, computed_prefill=True)
    assert timer.overhead_seconds == 0.0 and timer.seconds_per_flop == pytest.approx(0.1 / 2e9)


def test_the_prior_is_slow_so_the_first_chunks_are_small():
    assert StepTimer(0.25).budget_flops <= 0.25 * 20e9


def test_tiny_or_empty_samples_do_not_move_the_compute_estimate():
    timer = StepTimer(0.25)
    before = timer.seconds_per_flop
    timer.observe(1e3, 5.0, computed_prefill=True)  # too few FLOPs to say anything
    timer.observe(1e10, 0.0, computed_prefill=True)
    assert timer.seconds_per_flop == before


def test_an_implausible_fit_never_makes_compute_look_free():
    timer = StepTimer(0.25)
    # Time falls as FLOPs rise (noise): the fitted slope would be negative; the average rate is used.
    for f, t in [(1e9, 0.5), (2e9, 0.3), (3e9, 0.1), (4e9, 0.05)]:
        timer.observe(f, t, computed_prefill=True)
    assert timer.seconds_per_flop > 0 and timer.overhead_seconds == 0.0


def test_rejects_a_non_positive_target():
    with pytest.raises(ValueError, match="target_seconds"):
        StepTimer(0)


def test_fits_the_read_term_that_short_chunks_in_long_contexts_pay():
    # Steps mix chunk sizes and contexts: time = 0.03 + flops / 80 GFLOP/s + reads / 20 G/s.
    timer = StepTimer(0.25)
    truth = lambda f, r: 0.03 + f / 80e9 + r / 20e9  # noqa: E731
    for i in range(60):
        f, r = (1 + i % 7) * 1e9, (0.2 + (i * 3) % 5) * 1e9
        timer.observe(f, truth(f, r), computed_prefill=True, reads=r)
    assert timer.overhead_seconds == pytest.approx(0.03, rel=0.05)
    assert 1 / timer.seconds_per_flop == pytest.approx(80e9, rel=0.05)
    assert 1 / timer.seconds_per_read == pytest.approx(20e9, rel=0.05)
    assert timer.seconds(4e9, 2e9) == pytest.approx(truth(4e9, 2e9), rel=0.01)
