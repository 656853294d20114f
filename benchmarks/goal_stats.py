"""How far the held-out errors of ``benchmarks/published.py`` are from the accuracy goals of issue #19, and how
precisely a sample of that size measures them.

The median's confidence interval is distribution-free: the k-th smallest and k-th largest of ``n`` errors bracket
the population median with probability ``1 - 2 P(Binomial(n, 1/2) < k)``, whatever the errors' distribution
(the order-statistic interval; e.g. Conover, 'Practical Nonparametric Statistics', 3rd ed., Sec. 3.2). No
resampling, so the line it prints is the same on every run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

MEDIAN_GOAL = 0.04
WORST_GOAL = 0.15
"""Issue #19's 'Done when': held-out median |error| at most 4%, worst at most 15%."""


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The narrowest order-statistic interval that holds the median of the population ``values`` were drawn from with
    at least ``confidence`` (the whole range when the sample is too small for that: ``interval_coverage`` says how
    much it holds then)."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} must be between 0 and 1 (e.g. 0.95)")
    ordered, k = sorted(values), interval_rank(len(values), confidence)
    return ordered[k - 1], ordered[len(values) - k]


def interval_rank(n: int, confidence: float = 0.95) -> int:
    """The largest ``k`` whose k-th smallest and k-th largest of ``n`` values bracket the median with at least
    ``confidence`` (1, the whole range, when none does)."""
    total, below, k = 2**n, 1, 1  # below: ways of fewer than k + 1 draws under the median, summed as k grows
    while k < n // 2 and 1.0 - 2 * (below + math.comb(n, k)) / total >= confidence:
        below += math.comb(n, k)
        k += 1
    return k


def interval_coverage(n: int, k: int) -> float:
    """How often the k-th smallest and k-th largest of ``n`` draws bracket the population median:
    ``1 - 2 P(Binomial(n, 1/2) < k)`` (integers throughout, so any ``n``)."""
    below = sum(math.comb(n, i) for i in range(k))
    return 1.0 - 2 * below / 2**n


def rows_short_of_median_goal(errors: Sequence[float], goal: float = MEDIAN_GOAL) -> int:
    """How many more of ``errors`` (absolute, as fractions) coming within ``goal`` guarantee that their median is: 0 when
    it is already; else ``n // 2 + 1`` within it, which puts both middle values there (for an even ``n`` fewer may
    do, depending on how far the rows move)."""
    if statistics.median(errors) <= goal:
        return 0
    within = sum(error <= goal for error in errors)
    return max(0, len(errors) // 2 + 1 - within)


def goal_summary(errors: Sequence[float]) -> str:
    """One summary line: the held-out median with its 95% interval, the rows it is short of the median goal, and the
    rows beyond the worst-row goal."""
    low, high = median_interval(errors)
    coverage = interval_coverage(len(errors), interval_rank(len(errors)))
    beyond = sum(error > WORST_GOAL for error in errors)
    short = rows_short_of_median_goal(errors)
    return (f"- held out against the goals ({MEDIAN_GOAL:.0%} median, {WORST_GOAL:.0%} worst): the median's "
            f"{coverage:.1%} interval {low:.2%} to {high:.2%} over {len(errors)} runs (order statistics); {short} more "
            f"within {MEDIAN_GOAL:.0%} would meet the median goal; {beyond} beyond {WORST_GOAL:.0%}")
