"""Refine the best outer candidates with the integer program (``planner.ilp``).

The enumeration gives every outer candidate (mesh shape, ZeRO stage, micro-batch, schedule) a uniform
recomputation policy and evenly split stages. For the most promising outer candidates the integer
program then picks per-block recomputation and stage sizes; a lower bound on the pace prunes candidates
that cannot beat the incumbent before any solve. Every solution is re-checked with ``estimate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.cost_models import Estimate, Strategy, TrainingConfig, estimate
from tessera.cost_models.pipeline import bubble_micro_batches
from tessera.cost_models.types import LayerStats, Recompute, runtime_conflict, strategy_features
from tessera.planner.ilp import StageCoefficients, coefficients, optimal_pace_s, solve, stage_tables
from tessera.topology.cluster import Cluster

MAX_SOLVES = 16
BUDGET_RETRIES = 2


@dataclass
class RefineStats:
    """What the refinement did: solved, pruned by bound, infeasible; solver time; worst optimality gap."""

    solved: int = 0
    pruned: int = 0
    infeasible: int = 0
    solver_time_s: float = 0.0
    worst_gap: float = 0.0
    improved: list[str] = field(default_factory=list)


def outer_key(strategy: Strategy) -> Strategy:
    """The strategy with its per-layer choices reset: what identifies an outer candidate."""
    return strategy.model_copy(update={"recompute": "none", "block_recompute": (), "chunk_blocks": ()})


def refine(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig,
    scored: list[tuple[Strategy, Estimate]], *, policies: Sequence[Recompute], stats: RefineStats,
) -> list[tuple[Strategy, Estimate]]:
    """Integer-program refinements of the most promising outer candidates (those that beat nothing are dropped)."""
    incumbent = next((e.step_time_s for _, e in scored if e.fits), float("inf"))
    seen, refined = set(), []
    for strategy, _ in scored:
        key = outer_key(strategy)
        if key in seen or key.pp * key.virtual_stages > sum(l.kind == "block" for l in layers):
            continue
        seen.add(key)
        if len(seen) > MAX_SOLVES:
            break
        # Zero-bubble splits the backward; the runtime cannot recompute under it, so only stage sizes are chosen.
        allowed = ["none"] if key.schedule == "zero-bubble" else [
            p for p in policies if p != "selective" or runtime_conflict(strategy_features(key) | {"selective"}) is None]
        found = _refine_one(layers, cluster, training, key, policies=allowed, incumbent=incumbent, stats=stats)
        if found and found[1].fits and found[1].step_time_s < incumbent:
            incumbent = found[1].step_time_s
            refined.append(found)
            stats.improved.append(found[0].to_string())
    return refined


def _refine_one(layers, cluster, training, key: Strategy, *, policies, incumbent: float, stats: RefineStats):
    coeffs = coefficients(layers, cluster, training, key, policies=policies)
    blocks = sum(layer.kind == "block" for layer in layers)
    if _lower_bound_step(coeffs, key, training, cluster, blocks=blocks) >= incumbent:
        stats.pruned += 1
        return None
    fixed = _even_stage_shares(blocks, key) if key.virtual_stages > 1 else None
    budget = float(cluster.device.memory_bytes)
    tables = stage_tables(coeffs, blocks=blocks, budget_bytes=budget)  # shared by the bound and the first solve
    pace = optimal_pace_s(coeffs, blocks=blocks, budget_bytes=budget, fixed_blocks=fixed, tables=tables)
    if pace is not None and _slots(key, training, cluster) * pace >= incumbent:  # even the optimum cannot win: skip the solve
        stats.pruned += 1
        return None
    for _ in range(BUDGET_RETRIES + 1):
        result = solve(coeffs, blocks=blocks, budget_bytes=budget, fixed_blocks=fixed, tables=tables)
        tables = None  # a retry tightens the budget: its tables differ
        if result is None:
            stats.infeasible += 1
            return None
        stats.solved += 1
        stats.solver_time_s += result.wall_time_s
        stats.worst_gap = max(stats.worst_gap, result.gap)
        strategy = materialise(key, result.blocks, blocks=blocks)
        est = estimate(layers, cluster, training, strategy)
        if est.fits:
            return strategy, est
        budget -= est.peak_memory_bytes - est.memory_budget_bytes  # the linear model was optimistic: tighten
    return None


def _lower_bound_step(coeffs: Sequence[StageCoefficients], key: Strategy, training: TrainingConfig, cluster: Cluster, *,
                      blocks: int) -> float:
    """Pace bound with the cheapest policy and perfectly balanced stages, times the schedule's slots (and, on
    ranks sharing cores, the work bound: every micro-batch on a mean stage)."""
    cheapest = [min(st.time_per_block_s.values()) for st in coeffs]
    balanced = (sum(st.base_time_s for st in coeffs) + blocks * min(cheapest)) / len(coeffs)
    one_block = max(st.base_time_s + c for st, c in zip(coeffs, cheapest))
    work = key.gradient_accumulation(training.global_batch) * balanced
    return max(work, _slots(key, training, cluster) * max(balanced, one_block))


def _slots(key: Strategy, training: TrainingConfig, cluster: Cluster) -> float:
    """Slowest-stage micro-batch times per step at least: the micro-batches plus the schedule's bubble, run up
    to ``solo_speedup`` times faster where ranks share cores (``cost_models.pipeline.pipeline_time_s``)."""
    slots = key.gradient_accumulation(training.global_batch) + bubble_micro_batches(key)
    return slots / cluster.device.solo_speedup


def _even_stage_shares(blocks: int, strategy: Strategy) -> list[int]:
    chunks = strategy.pp * strategy.virtual_stages
    sizes = [blocks // chunks + (c < blocks % chunks) for c in range(chunks)]
    return [sum(sizes[s::strategy.pp]) for s in range(strategy.pp)]


def materialise(key: Strategy, per_stage: Sequence[dict[str, int]], *, blocks: int) -> Strategy:
    """Turn per-stage policy counts into a Strategy (uniform when it is uniform)."""
    queues = [[p for p in ("full", "selective", "none") for _ in range(counts.get(p, 0))] for counts in per_stage]
    if key.virtual_stages == 1:
        chunk_blocks = tuple(len(q) for q in queues)
        order = [p for q in queues for p in q]
    else:
        chunk_blocks = ()
        chunks = key.pp * key.virtual_stages
        sizes = [blocks // chunks + (c < blocks % chunks) for c in range(chunks)]
        order = [queues[c % key.pp].pop(0) for c in range(chunks) for _ in range(sizes[c])]
    even = tuple(blocks // key.pp + (s < blocks % key.pp) for s in range(key.pp))
    update: dict[str, object] = {}
    if len(set(order)) == 1:
        update["recompute"] = order[0]
    else:
        update["block_recompute"] = tuple(order)
    if chunk_blocks and chunk_blocks != even:
        update["chunk_blocks"] = chunk_blocks
    return key.model_copy(update=update)
