"""StepTimer: what a step costs in seconds, learnt from the steps this engine actually ran, so the
scheduler can size prefill chunks to a time target.

Why learnt: the same model runs at 20 or 200 GFLOP/s depending on the CPU, dtype and threads, so
a fixed token budget either stalls streams on a slow machine or wastes steps on a fast one.

The model is  seconds = overhead + per_flop x FLOPs + per_read x reads  (FLOPs and K/V reads as
model_executor/step_cost.py prices them), fitted by weighted least squares over recent steps
that computed a prefill chunk, with exponential forgetting so it follows a machine that gets
busier or quieter. Each term is there for a reason: a step with a prefill chunk pays a fixed
price (weights read at small-batch efficiency), and a short chunk late in a long context pays
for reading the whole prefix's K/V, which its FLOPs do not show. A rate without those terms
blames them on the FLOPs, shrinks the next chunks, and spirals down to the minimum chunk.
When the samples do not pin all three numbers (too few, too alike, or a fit that makes some
cost negative), fewer terms are fitted, down to seconds/FLOP averaged (pessimistic: smaller
chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(x) for row in a for x in row) or 1.0
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-9 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class StepTimer:
    target_seconds: float
    # Before any measurement: 20 GFLOP/s, no overhead, reads free: slower than any machine we
    # run on, so the first chunks are small and the fit then moves to the truth.
    seconds_per_flop: float = 1 / 20e9
    seconds_per_read: float = 0.0
    overhead_seconds: float = 0.0
    forgetting: float = 0.9  # weight kept by older samples per new one (~10 steps of memory)
    min_sample_flops: float = 1e8  # steps cheaper than this say little about compute speed
    samples: int = 0
    # The average rate (seconds / FLOPs of whole steps, overhead and reads included) over about
    # 1 / (1 - average_forgetting) recent samples: what the "auto" step target scales by
    # (engine/step_target.py). The fitted marginal rate is the right one for pricing a chunk, but
    # it trades off against the overhead term and swung 157-374 GFLOP/s in one float32 run on a
    # 224 GFLOP/s machine; the average stayed within 175-188.
    average_forgetting: float = 0.97
    _average: list[float] = field(default_factory=lambda: [0.0, 0.0], repr=False)  # seconds, GFLOP
    # Exponentially weighted sums of x x^T and x t for x = (1, GFLOP, Greads).
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)], repr=False)
    _xt: list[float] = field(default_factory=lambda: [0.0] * 3, repr=False)

    def __post_init__(self) -> None:
        if not self.target_seconds > 0:
            raise ValueError(f"target_seconds must be > 0, got {self.target_seconds}")

    def seconds(self, flops: float, reads: float = 0.0) -> float:
        """Estimated time of a step with this work (including the per-step overhead)."""
        return self.overhead_seconds + self.seconds_per_flop * flops + self.seconds_per_read * reads

    @property
    def average_seconds_per_flop(self) -> float:
        """Seconds per FLOP of recent steps that computed prefill, all their time included; the
        first (pessimistic) rate until one is measured."""
        seconds, gflops = self._average
        return seconds / gflops / 1e9 if gflops > 0 else self.seconds_per_flop

    @property
    def budget_flops(self) -> float:
        """FLOPs (with no reads) a step may do and still finish within the target."""
        return max(0.0, self.target_seconds - self.overhead_seconds) / self.seconds_per_flop

    def observe(self, flops: float, seconds: float, computed_prefill: bool, reads: float = 0.0) -> None:
        if not computed_prefill or flops < self.min_sample_flops or seconds <= 0:
            return
        a = self.average_forgetting
        self._average = [a * self._average[0] + seconds, a * self._average[1] + flops / 1e9]
        g = self.forgetting
        x = (1.0, flops / 1e9, reads / 1e9)  # giga-units keep the sums well scaled
        for i in range(3):
            self._xt[i] = g * self._xt[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = g * self._xx[i][j] + x[i] * x[j]
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        xx, xt = self._xx, self._xt
        average = xt[0] / xx[0][1]  # seconds per GFLOP with no other term: the pessimistic rate
        # Try (overhead, flops, reads), then (overhead, flops); keep the first plausible fit:
        # every coefficient >= 0 and compute at least a fifth of the average rate.
        for terms in ((0, 1, 2), (0, 1)):
            if self.samples < 2 * len(terms):
                continue
            sol = _solve([[xx[i][j] for j in terms] for i in terms], [xt[i] for i in terms])
            if sol is None or min(sol) < 0 or not 0.2 * average <= sol[1] <= average:
                continue
            coef = dict(zip(terms, sol))
            self.overhead_seconds = coef[0]
            self.seconds_per_flop = coef[1] / 1e9
            self.seconds_per_read = coef.get(2, 0.0) / 1e9
            return
        self.overhead_seconds, self.seconds_per_flop, self.seconds_per_read = 0.0, average / 1e9, 0.0
