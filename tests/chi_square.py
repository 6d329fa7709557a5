"""Pearson's chi-square goodness-of-fit test for the sampling tests (scipy is not a dependency).

The tests draw with fixed seeds, so each outcome is fixed; ALPHA says how unlikely a correct
sampler is to exceed the critical value for a given seed. A biased sampler's statistic grows
linearly with the number of draws, so with the tests' sample sizes it lands far above it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import torch

ALPHA = 1e-4
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one (the usual rule)


def critical_value(df: int, alpha: float = ALPHA) -> float:
    """The chi-square quantile of df degrees of freedom that a correct sampler exceeds with
    probability alpha: the x where the upper tail Q(df / 2, x / 2) (torch.special.gammaincc, the
    regularised upper incomplete gamma) equals alpha, by bisection."""
    lo, hi = 0.0, 10.0 * df + 100.0
    k = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if torch.special.gammaincc(k, torch.tensor(mid / 2, dtype=torch.float64)).item() > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def chi_square(counts: Counter, probs: dict[Hashable, float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against the probabilities of every
    possible outcome. An outcome absent from probs (probability 0) makes the statistic infinite."""
    n = sum(counts.values())
    if any(key not in probs for key in counts):
        return float("inf"), 1
    cells: list[tuple[float, int]] = []
    pooled_expected, pooled_observed = 0.0, 0
    for key, p in probs.items():
        if n * p < MIN_EXPECTED:
            pooled_expected += n * p
            pooled_observed += counts.get(key, 0)
        else:
            cells.append((n * p, counts.get(key, 0)))
    if pooled_expected >= MIN_EXPECTED or not cells:
        cells.append((pooled_expected, pooled_observed))
    elif pooled_expected > 0 or pooled_observed:  # still too rare for a cell: joins the smallest one
        i = min(range(len(cells)), key=lambda j: cells[j][0])
        cells[i] = (cells[i][0] + pooled_expected, cells[i][1] + pooled_observed)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return stat, len(cells) - 1
