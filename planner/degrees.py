"""Why the expert- and context-parallel degrees: the best strategy the search estimated at every other degree.

The runners-up of ``search.runners_up`` are the next-fastest strategies overall; they often share the chosen
``ep`` and ``cp`` and so say nothing about those choices. Here, for each axis (``ep`` for a model with routed
experts, ``cp`` when the search tried context parallelism), the fastest fitting estimate at every other degree
is kept (the leanest one when none of that degree fits), with a verdict naming the step-time terms that
differ most (``explain.why_it_lost`` words them). A degree the search never estimated was pruned by the
step-time lower bound: its compute alone could not beat the plan's step.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models import Estimate, Strategy
from tessera.planner.plan import Candidate

GiB = 2**30
AXES = ("ep", "cp")


def degree_alternatives(scored: Sequence[tuple[Strategy, Estimate]], best: Strategy, best_estimate: Estimate) -> tuple[Candidate, ...]:
    """Per axis in ``AXES`` that the search varied, the best candidate at every degree other than ``best``'s."""
    found: list[Candidate] = []
    for axis in AXES:
        degrees = {getattr(s, axis) for s, _ in scored}
        if len(degrees) < 2 and getattr(best, axis) == 1:
            continue
        for degree in sorted(degrees - {getattr(best, axis)}):
            pair = _best_at(scored, axis, degree)
            found.append(Candidate(strategy=pair[0], estimate=pair[1], verdict=_verdict(axis, degree, pair[1], best_estimate)))
    return tuple(found)


def _best_at(scored: Sequence[tuple[Strategy, Estimate]], axis: str, degree: int) -> tuple[Strategy, Estimate]:
    at = [pair for pair in scored if getattr(pair[0], axis) == degree]
    fitting = [pair for pair in at if pair[1].fits]
    if fitting:
        return min(fitting, key=lambda pair: pair[1].step_time_s)
    return min(at, key=lambda pair: pair[1].peak_memory_bytes)


def _verdict(axis: str, degree: int, candidate: Estimate, best: Estimate) -> str:
    if not candidate.fits:
        over = (candidate.peak_memory_bytes - candidate.memory_budget_bytes) / GiB
        return f"{axis}={degree}: best does not fit, {over:.1f} GiB over"
    return f"{axis}={degree}: {candidate.step_time_s / best.step_time_s - 1:+.1%} step time"
