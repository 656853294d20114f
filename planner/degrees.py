"""Why the expert- and context-parallel degrees: the best strategy the search estimated at every other degree.

The runners-up of ``search.runners_up`` are the next-fastest strategies overall; they often share the chosen
``ep`` and ``cp`` and so say nothing about those choices. Here, for each axis (``ep`` for a model with routed
experts, ``cp`` when the search tried context parallelism), the fastest fitting estimate at every other degree
is kept, with a verdict (``compare.why_it_lost`` adds the step-time term that differs most). The search stops
estimating once its step-time lower bound reaches the best plan, so a degree may have been reached only by
candidates that do not fit, or not at all (``admitted``: every degree the search space holds), and the best
estimated at a degree is the best there only below the bound the search stopped at (``exact_below_s``). For
any other degree a search pinned to it (``rerank``) finds its best fitting strategy (the faster of the two is
kept), or else the leanest one is reported with how far over memory it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tessera.cost_models import Estimate, Strategy
from tessera.errors import TesseraError
from tessera.planner.plan import Candidate

GiB = 2**30
AXES = ("ep", "cp")


Rerank = Callable[[Mapping[str, object]], list[tuple[Strategy, Estimate]]]
"""Ranked candidates of the same search with extra pins (``{"cp": 16}``)."""


def degree_alternatives(
    scored: Sequence[tuple[Strategy, Estimate]], best: Strategy, best_estimate: Estimate, *, rerank: Rerank | None = None,
    admitted: Mapping[str, Sequence[int]] | None = None, exact_below_s: float = float("inf"),
) -> tuple[Candidate, ...]:
    """Per axis in ``AXES``, the best candidate at every degree the search reached or the space ``admitted``
    (axis -> degrees), other than ``best``'s."""
    found: list[Candidate] = []
    for axis in AXES:
        chosen = getattr(best, axis)
        degrees = {getattr(s, axis) for s, _ in scored} | ({1} if chosen > 1 else set())  # always: why not without it
        degrees |= set((admitted or {}).get(axis, ()))
        for degree in sorted(degrees - {chosen}):
            pair = _best_at(scored, axis, degree)
            if (pair is None or not pair[1].fits or pair[1].step_time_s >= exact_below_s) and rerank is not None:
                pinned = _best_pinned(rerank, axis, degree)
                if pinned is not None and pinned[1].fits and pair is not None and pair[1].fits:
                    pinned = min(pinned, pair, key=lambda p: p[1].step_time_s)
                pair = pinned or pair
            if pair is not None:
                verdict = _verdict(axis, degree, pair[1], best_estimate)
                found.append(Candidate(strategy=pair[0], estimate=pair[1], verdict=verdict))
    return tuple(found)


def _best_pinned(rerank: Rerank, axis: str, degree: int) -> tuple[Strategy, Estimate] | None:
    """The fastest fitting strategy at ``degree`` (else the leanest), from a search pinned to it."""
    try:
        ranked = rerank({axis: degree})
    except TesseraError:
        return None
    return next((pair for pair in ranked if pair[1].fits), min(ranked, key=lambda p: p[1].peak_memory_bytes, default=None))


def _best_at(scored: Sequence[tuple[Strategy, Estimate]], axis: str, degree: int) -> tuple[Strategy, Estimate] | None:
    at = [pair for pair in scored if getattr(pair[0], axis) == degree]
    fitting = [pair for pair in at if pair[1].fits]
    if fitting:
        return min(fitting, key=lambda pair: pair[1].step_time_s)
    return min(at, key=lambda pair: pair[1].peak_memory_bytes, default=None)


def _verdict(axis: str, degree: int, candidate: Estimate, best: Estimate) -> str:
    if not candidate.fits:
        over = (candidate.peak_memory_bytes - candidate.memory_budget_bytes) / GiB
        return f"{axis}={degree}: best does not fit, {over:.1f} GiB over"
    return f"{axis}={degree}: {candidate.step_time_s / best.step_time_s - 1:+.1%} step time"
