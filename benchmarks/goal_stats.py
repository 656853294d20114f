"""How far the held-out errors of ``benchmarks/published.py`` are from the accuracy goals of issue #19, and how
precisely a sample of that size measures them.

The median's confidence interval is distribution-free: the k-th smallest and k-th largest of ``n`` errors bracket
the population median with probability ``1 - 2 P(Binomial(n, 1/2) < k)``, whatever the errors' distribution
(the order-statistic interval; e.g. Conover, 'Practical Nonparametric Statistics', 3rd ed., Sec. 3.2). No
resampling, so the line it prints is the same on every run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MEDIAN_GOAL = 0.04
WORST_GOAL = 0.15
"""Issue #19's 'Done when': held-out median |error| at most 4%, worst at most 15%."""


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The narrowest order-statistic interval that holds the median of the population ``values`` were drawn from with
    at least ``confidence`` (the whole range when the sample is too small for that)."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} must be between 0 and 1 (e.g. 0.95)")
    ordered, n = sorted(values), len(values)
    below = 0.0  # P(Binomial(n, 1/2) < k), grown one k at a time
    k = 0
    while k < n // 2 and 1.0 - 2.0 * (below + math.comb(n, k) / 2.0**n) >= confidence:
        below += math.comb(n, k) / 2.0**n
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def rows_short_of_median_goal(errors: Sequence[float], goal: float = MEDIAN_GOAL) -> int:
    """How many more of ``errors`` (absolute, as fractions) would have to come within ``goal`` for their median to be
    within it: a median of ``n`` values is at most ``goal`` once ``n // 2 + 1`` of them are."""
    within = sum(error <= goal for error in errors)
    return max(0, len(errors) // 2 + 1 - within)


def goal_summary(errors: Sequence[float]) -> str:
    """One summary line: the held-out median with its 95% interval, the rows it is short of the median goal, and the
    rows beyond the worst-row goal."""
    low, high = median_interval(errors)
    beyond = sum(error > WORST_GOAL for error in errors)
    short = rows_short_of_median_goal(errors)
    return (f"- held out against the goals ({MEDIAN_GOAL:.0%} median, {WORST_GOAL:.0%} worst): median 95% interval "
            f"{low:.2%} to {high:.2%} over {len(errors)} runs (order statistics); {short} more within {MEDIAN_GOAL:.0%} "
            f"would meet the median goal; {beyond} beyond {WORST_GOAL:.0%}")
