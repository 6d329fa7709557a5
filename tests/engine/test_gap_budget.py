"""GapBudget (engine/gap_budget.py): while streams decode, the mean planned gap is the target,
no step is planned longer than max_seconds, banking stops when it earns nothing, and prefill
never waits more than MAX_BANKING_STEPS steps."""
from __future__ import annotations

import pytest

from hybridkv.engine.gap_budget import MAX_BANKING_STEPS, MIN_PREFILL_SHARE, GapBudget


def _simulate(budget: GapBudget, decode_seconds: float, steps: int, actual=None) -> list[float]:
    """Run `steps` watched steps; a step takes what it was allowed (banking: its decodes), or
    actual(planned) when given. Returns the measured step times."""
    times = []
    for _ in range(steps):
        allowed = budget.plan(True, decode_seconds)
        planned = decode_seconds if allowed == 0.0 else allowed
        t = actual(planned) if actual else planned
        budget.observe(t)
        times.append(t)
    return times


def test_max_equal_to_target_holds_every_step_to_the_target():
    b = GapBudget(0.25, 0.25)
    assert [b.plan(True, 0.05) for _ in range(5)] == [0.25] * 5


def test_decode_only_steps_bank_for_longer_steps_and_the_mean_stays_at_the_target():
    b = GapBudget(0.25, 0.45)
    times = _simulate(b, 0.07, 400)
    assert max(times) <= 0.45 + 1e-12, "no step is planned longer than max_seconds"
    assert sum(times) / len(times) == pytest.approx(0.25, abs=0.01), "the mean gap is the target"
    long_steps = [t for t in times if t > 0.25 + 1e-9]
    assert len(long_steps) > len(times) // 4, "banked time was not spent on longer steps"


def test_no_bank_without_watched_streams():
    b = GapBudget(0.25, 0.45)
    _simulate(b, 0.07, 1)  # one banking step
    assert b.credit_seconds > 0
    assert b.plan(False, 0.0) is None and b.credit_seconds == 0.0


def test_a_decode_batch_near_the_target_is_not_made_to_bank():
    # Banking would earn almost nothing per step: every step spends (and prefill keeps its share,
    # twice the decodes, which here is past max_seconds: see the next test).
    b = GapBudget(0.25, 0.45)
    assert [b.plan(True, 0.245) for _ in range(5)] == [pytest.approx(0.49)] * 5
    assert not b.banking


@pytest.mark.parametrize("longest", [0.25, 0.45])
def test_prefill_keeps_half_of_a_step_whose_decodes_take_the_target(longest):
    # A decode batch as slow as the target (or slower) would leave prompts the minimum chunk
    # every step; the step may instead take twice its decodes, past max_seconds if need be.
    b = GapBudget(0.25, longest)
    for decode_seconds in (0.245, 0.3, 1.0):
        allowed = b.plan(True, decode_seconds)
        b.observe(allowed)
        assert allowed == pytest.approx(decode_seconds / (1 - MIN_PREFILL_SHARE)), (decode_seconds, allowed)
    assert b.credit_seconds >= -b.bank_seconds


def test_a_machine_slower_than_estimated_stops_banking_at_once():
    # The timer thinks decodes take 0.05 s; they take 0.3 s, over the target: the first banking
    # step earns nothing, so the next step is held to the target (prefill runs) instead of banking on.
    b = GapBudget(0.25, 0.45)
    plans = []
    for _ in range(6):
        allowed = b.plan(True, 0.05)
        plans.append(allowed)
        b.observe(0.3)
    assert plans[0] == 0.0 and all(p == 0.25 for p in plans[1::2]), plans
    assert b.credit_seconds >= -b.bank_seconds


def test_prefill_never_waits_more_than_max_banking_steps():
    # A bank so large that credit never overflows it: the row of banking steps is still cut.
    b = GapBudget(0.25, 100.0)
    plans = [b.plan(True, 0.07) for _ in range(3 * (MAX_BANKING_STEPS + 1))]
    for _ in plans:
        b.observe(0.07)
    spends = [i for i, p in enumerate(plans) if p != 0.0]
    assert spends and spends[0] <= MAX_BANKING_STEPS
    assert all(b2 - b1 <= MAX_BANKING_STEPS + 1 for b1, b2 in zip(spends, spends[1:]))


def test_debt_is_paid_back_by_banking_and_spending_never_drops_below_the_target():
    b = GapBudget(0.25, 0.45)
    b.plan(True, 0.07)
    b.observe(3.0)  # the VM stalled: deep in debt, clamped to one bank
    assert b.credit_seconds == pytest.approx(-b.bank_seconds)
    plans = []
    for _ in range(20):
        allowed = b.plan(True, 0.07)
        plans.append(allowed)
        b.observe(0.07 if allowed == 0.0 else allowed)
    # The stalled step banked nothing, so the next one is held to the target; then decode-only
    # steps pay the debt back before any longer step.
    assert plans[:3] == [0.25, 0.0, 0.0], plans
    assert all(p == 0.0 or p >= 0.25 for p in plans), plans
    assert any(p > 0.25 for p in plans), "credit never built up again"


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_step_seconds"):
        GapBudget(0.25, 0.2)
    with pytest.raises(ValueError, match="target_step_seconds must be > 0"):
        GapBudget(0.0, 0.2)


def test_first_tokens_alone_get_the_longest_step_and_no_credit():
    # Streamed prompts wait and nothing decodes: the step may take max_seconds; there is no
    # gap to average, so credit left from earlier streams is dropped and the step is not counted.
    b = GapBudget(0.25, 0.45)
    _simulate(b, 0.07, 1)  # one banking step leaves credit
    assert b.credit_seconds > 0
    assert b.plan_first_tokens() == 0.45
    b.observe(2.0)  # a long first-token step does not put later streams in debt
    assert b.credit_seconds == 0.0 and not b.banking
    # Non-streamed decodes beside the waiting prompts: prefill still keeps its share.
    assert b.plan_first_tokens(0.1) == 0.45
    assert b.plan_first_tokens(0.5) == pytest.approx(0.5 / (1 - MIN_PREFILL_SHARE))
