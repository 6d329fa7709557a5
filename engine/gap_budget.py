"""GapBudget: how long the next step may take while streams decode, so that a stream's gaps
between tokens average `target_seconds` and none is planned longer than `max_seconds` (unless
decodes alone take half of that: prefill keeps half of every step, MIN_PREFILL_SHARE); and
while streamed prompts wait for their first tokens with no stream decoding, max_seconds.

Every step is a gap in every decoding stream. Holding each step to the target (max_seconds ==
target_seconds, the old rule) gives even gaps, but each step then carries a short prefill chunk
and pays the step's fixed cost again for it; a prompt token in a short chunk costs more than in
a long one (demo model, Zen 3: ~2.45 ms a prompt token in 0.25 s steps of ~80 prompt tokens,
~2.0 ms in 0.45 s steps of ~190). With max_seconds above the target, time a step leaves under
the target is kept as credit and a later step spends it on a longer prefill chunk. The mean gap
is still the target; the longest planned one is max_seconds. (vLLM's CPU server has no bound at
all: a step takes every waiting prompt.)

Where the credit comes from: steps that ran shorter than planned or had little prefill to do
(a prompt's last chunk, nothing waiting), and decode-only steps planned on purpose while the
credit is low ("banking"). A step spends instead of banking when one more decode-only step
would earn more than the bank holds. So with decode-only steps shorter than 2 x target -
max_seconds (the demo model at the serve defaults: 55-75 ms against 0.1 s) credit comes mostly
from short steps and banking mostly repays overruns; with dearer decodes, steps alternate
between banking and spending.

The credit counts measured step times, not estimates, so a step that ran long is paid back by
the following ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridkv.engine.step_target import STEP_TARGET_AUTO

# Banking needs each decode-only step to leave at least this share of the bank under the
# target, estimated before it and measured after it; otherwise (a decode batch that alone takes
# about the target, or a machine slower than the timer thinks) the step is held to the target,
# as with no bank, and the minimum prefill chunk runs. So is every step after MAX_BANKING_STEPS
# in a row: prefill never waits longer than that.
MIN_EARN_SHARE = 0.1
MAX_BANKING_STEPS = 10
# Prefill's least share of a step that carries it. A target is an absolute time, and a decode
# batch can take most of it or more (a larger model, a slower CPU, more streams): the target
# alone would then leave prompts the minimum chunk a step and their first tokens would wait for
# minutes. So a step may always take twice its decodes: streams then wait at most twice as long
# as decodes alone would make them, and prompts keep half the machine.
MIN_PREFILL_SHARE = 0.5


def least_step_seconds(decode_seconds: float) -> float:
    """The shortest step that leaves prefill its share (MIN_PREFILL_SHARE) beside these decodes."""
    return decode_seconds / (1.0 - MIN_PREFILL_SHARE)


def check_step_seconds(target: float | str | None, longest: float | None) -> None:
    """The configs' check of a (target_step_seconds, max_step_seconds) pair; None = unset,
    "auto" = engine/step_target.py's target, which an explicit longest step bounds."""
    if target == STEP_TARGET_AUTO:
        if longest is not None and not longest > 0:
            raise ValueError(f"max_step_seconds must be > 0 or None, got {longest}")
        return
    if isinstance(target, str):
        raise ValueError(f"target_step_seconds must be seconds, {STEP_TARGET_AUTO!r} or None, got {target!r}")
    if target is not None and not target > 0:
        raise ValueError(f"target_step_seconds must be > 0 or None, got {target}")
    if longest is not None and (target is None or not longest >= target):
        raise ValueError(f"max_step_seconds ({longest}) needs a target_step_seconds ({target}) no larger than it")


@dataclass
class GapBudget:
    target_seconds: float
    max_seconds: float
    credit_seconds: float = 0.0  # left by steps shorter than the target; negative: owed
    watched: bool = False  # the step being planned carries decodes of interactive streams
    banking: bool = False  # the step being planned is decodes only
    banked_in_a_row: int = 0
    last_earned_seconds: float = 0.0  # the target minus the last banking step's measured time

    def __post_init__(self) -> None:
        check_step_seconds(self.target_seconds, self.max_seconds)  # the configs' own check

    @property
    def bank_seconds(self) -> float:
        """The most credit kept: what lifts one step from the target to max_seconds."""
        return self.max_seconds - self.target_seconds

    def retarget(self, target_seconds: float, max_seconds: float) -> None:
        """A new (target, longest step) pair (the "auto" target follows the machine's measured
        prefill rate); credit beyond the new bank is dropped."""
        self.target_seconds, self.max_seconds = target_seconds, max_seconds
        bank = self.bank_seconds
        self.credit_seconds = max(-bank, min(bank, self.credit_seconds))

    def plan(self, watched: bool, decode_seconds: float) -> float | None:
        """Seconds the next step may take; None: no limit (no interactive stream decodes); 0.0:
        decodes only, the step banks its time (no prefill, not even the minimum chunk).
        decode_seconds: the estimated time of the step's decodes alone. The answer is over
        max_seconds only where decodes alone take more than half of it (MIN_PREFILL_SHARE)."""
        self.watched, self.banking = watched, False
        if not watched:
            self.credit_seconds, self.banked_in_a_row = 0.0, 0
            return None
        least = least_step_seconds(decode_seconds)
        bank = self.bank_seconds
        if bank <= 0:
            return max(self.target_seconds, least)
        earn = self.target_seconds - decode_seconds
        floor = MIN_EARN_SHARE * bank
        if (self.credit_seconds + earn > bank  # banking once more would overflow the bank
                or earn < floor or (self.banked_in_a_row and self.last_earned_seconds < floor)
                or self.banked_in_a_row >= MAX_BANKING_STEPS):
            self.banked_in_a_row = 0
            # Spend; never less than the target, so being in debt does not starve prefill.
            return max(least, min(self.max_seconds, self.target_seconds + max(0.0, self.credit_seconds)))
        self.banking = True
        self.banked_in_a_row += 1
        return 0.0

    def plan_first_tokens(self, decode_seconds: float = 0.0) -> float:
        """Seconds the next step may take when streamed prompts wait for their first tokens and
        no stream decodes: the longest planned gap, or twice the decodes of non-streamed requests
        where they take more than half of it (MIN_PREFILL_SHARE). There are no gaps to average
        yet, so no credit is kept (a stream that starts decoding starts from an empty bank)."""
        self.plan(False, 0.0)
        return max(self.max_seconds, least_step_seconds(decode_seconds))

    def observe(self, seconds: float) -> None:
        """The measured time of the step just planned."""
        if not self.watched:
            return
        if self.banking:
            self.last_earned_seconds = self.target_seconds - seconds
        bank = self.bank_seconds
        self.credit_seconds = max(-bank, min(bank, self.credit_seconds + self.target_seconds - seconds))
