"""Lighten an integer program's answer with the exact estimate: less recomputation where it still fits.

The programs plan memory with a linear model (``planner.ilp`` with the heaviest block for every block,
``planner.ilp_mixed`` with per-kind slopes from one and two blocks), which can overstate what a mix of blocks
holds; their answer then recomputes more than the device needs. Starting from a solution that fits, each run of
consecutive alike blocks (same kind, same policy) is offered a lighter policy for as many of its last blocks as
still fit, found by bisection on the exact ``estimate`` (time falls and memory rises as blocks are lightened, so
the largest count that fits is the run's best); the fastest such move is taken, and again, until none is faster.
Later blocks are lightened first: under a pipeline the first stage holds the most micro-batches in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models import Estimate, Strategy, TrainingConfig, estimate
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import Recompute
from tessera.planner.ilp_mixed import block_kinds
from tessera.topology.cluster import Cluster

LIGHTER: dict[str, tuple[Recompute, ...]] = {"full": ("none", "selective"), "selective": ("none",), "offload": ("none",)}
"""The policies that save a block's recomputation (or its copies to host memory), lightest first."""
MAX_MOVES = 8
"""Moves taken at most per solution (each one is a run lightened as far as it fits)."""


def lighten(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, found: tuple[Strategy, Estimate], *,
    policies: Sequence[str],
) -> tuple[Strategy, Estimate]:
    """``found`` (a fitting solution) with blocks moved to lighter ``policies`` while it fits and is faster."""
    kinds = block_kinds(layers)[0]
    for _ in range(MAX_MOVES):
        better = _best_move(layers, cluster, training, found, kinds=kinds, policies=policies)
        if better is None:
            break
        found = better
    return found


def _best_move(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, found: tuple[Strategy, Estimate], *,
    kinds: list[int], policies: Sequence[str],
) -> tuple[Strategy, Estimate] | None:
    """The fastest fitting solution one run's lightening gives, or None where none beats ``found``."""
    strategy, best = found
    chosen = None
    current = [strategy.recompute_of_block(i) for i in range(len(kinds))]
    for run in _alike_runs(current, kinds):
        for lighter in (p for p in LIGHTER.get(current[run[0]], ()) if p in policies):
            moved = _lightest_fitting(layers, cluster, training, strategy, current=current, run=run, lighter=lighter)
            if moved and moved[1].step_time_s < best.step_time_s:
                chosen, best = moved, moved[1]
    return chosen


def _alike_runs(policies: list[str], kinds: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of consecutive blocks with the same policy and kind."""
    runs, start = [], 0
    for i in range(1, len(policies) + 1):
        if i == len(policies) or (policies[i], kinds[i]) != (policies[start], kinds[start]):
            runs.append((start, i))
            start = i
    return runs


def _lightest_fitting(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy, *,
    current: list[str], run: tuple[int, int], lighter: Recompute,
) -> tuple[Strategy, Estimate] | None:
    """The ``run``'s (``[start, end)`` of ``current``) last ``k`` blocks on ``lighter`` for the largest ``k`` that
    fits (bisection), or None."""
    start, end = run
    low, high, fitting = 1, end - start, None
    while low <= high:
        k = (low + high) // 2
        candidate = with_block_policies(strategy, [*current[:end - k], *[lighter] * k, *current[end:]])
        est = estimate(layers, cluster, training, candidate)
        if est.fits:
            fitting, low = (candidate, est), k + 1
        else:
            high = k - 1
    return fitting


def with_block_policies(strategy: Strategy, policies: Sequence[str]) -> Strategy:
    """``strategy`` with these per-block policies: a uniform ``recompute`` where they are all the same."""
    if len(set(policies)) == 1:
        return strategy.model_copy(update={"recompute": policies[0], "block_recompute": ()})
    return strategy.model_copy(update={"block_recompute": tuple(policies)})
