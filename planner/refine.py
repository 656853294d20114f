"""Refine the best outer candidates with the integer programs (``planner.ilp``, ``planner.ilp_mixed``).

The enumeration gives every outer candidate (mesh shape, ZeRO stage, micro-batch, schedule) a uniform
recomputation policy and evenly split stages. For the most promising outer candidates the integer
program then picks per-block choices and stage sizes; a lower bound on the pace prunes candidates
that cannot beat the incumbent before any solve. Every solution is re-checked with ``estimate``.

Two programs: the tabulated one of ``planner.ilp`` (identical blocks, recomputation only; for a model whose
blocks differ it plans with the heaviest; interleaved chunks even) always runs, so a plan is never worse than
it; where the blocks are of several kinds, the schedule interleaves chunks (the mixed program sizes them: the
embedding's and the head's chunks lighter), or per-block options beyond recomputation are on (``BlockOptions``:
activation offload, ZeRO-3 blocks that keep their gathered weights), ``planner.ilp_mixed`` also runs and the
faster fitting solution wins. The mixed program is skipped for an outer candidate that nothing fits (no uniform policy, no
table solution): measuring its coefficients is the refinement's largest cost, and a deep MoE model's most
promising candidates are often such (DeepSeek-V3 on 2048 GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.cost_models import Estimate, Strategy, TrainingConfig, estimate
from tessera.cost_models.estimate import dp_lower_bound_s, step_time_lower_bound
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.partition import block_policies, cached_stage_totals
from tessera.cost_models.pipeline import bubble_micro_batches
from tessera.cost_models.types import Recompute, runtime_conflict, strategy_features
from tessera.planner.ilp import StageCoefficients, coefficients, optimal_pace_s, solve, stage_tables
from tessera.planner.ilp_mixed import (
    StageMeasure, block_kinds, kind_coefficients, option_name, pace_lower_bound_s, solve_mixed, split_option,
)
from tessera.planner.lighten import lighten
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU

MAX_SOLVES = 16
MAX_INFEASIBLE = 128
"""Outer candidates refined at most: ``MAX_SOLVES`` whose integer program ran (or was pruned by its bound), and
beside them up to ``MAX_INFEASIBLE`` that nothing fits, uniform or mixed (cheap: the program proves it at once).
Counted apart because at tight budgets the fastest candidates are often ones nothing fits, which would otherwise
use up the solves before a candidate that can fit is reached; the keys refined are a superset of those the first
``MAX_SOLVES`` alone would reach, in the same order, so the plan is never slower for it."""
BUDGET_RETRIES = 2


@dataclass(frozen=True)
class BlockOptions:
    """Per-block choices the search may propose beside recomputation (each needs its runtime part)."""

    offload: bool = False
    """Activation offload to host memory (``Recompute`` ``"offload"``)."""
    keep_gathered: bool = False
    """Under ZeRO-3, blocks that keep their gathered weights from forward to backward (``Strategy.block_reshard``)."""


RUNTIME_BLOCK_OPTIONS = BlockOptions(offload=True, keep_gathered=True)
"""The per-block options the planner proposes by default: those Tessera's runtime runs (a fact about the
runtime, not a setting): both, since ``runtime.offload`` and per-module FSDP2 resharding
(``runtime.data_parallel``) apply them."""
NO_BLOCK_OPTIONS = BlockOptions()
"""Recomputation per block only (the planner before per-block offload and resharding)."""
ALL_BLOCK_OPTIONS = BlockOptions(offload=True, keep_gathered=True)
"""Every per-block option the cost model knows (studies, benchmarks)."""


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
    return strategy.model_copy(update={"recompute": "none", "block_recompute": (), "chunk_blocks": (),
                                       "block_reshard": ()})


def refine(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig,
    scored: list[tuple[Strategy, Estimate]], *, policies: Sequence[Recompute], stats: RefineStats,
    block_options: BlockOptions = RUNTIME_BLOCK_OPTIONS,
) -> list[tuple[Strategy, Estimate]]:
    """Integer-program refinements of the most promising outer candidates (those that beat nothing are dropped)."""
    several_kinds = len(block_kinds(layers)[1]) > 1
    incumbent = next((e.step_time_s for _, e in scored if e.fits), float("inf"))
    seen, refined, spent, hopeless = set(), [], 0, 0
    fitting = {outer_key(s) for s, e in scored if e.fits}  # outer candidates some uniform policy fits
    for strategy, _ in scored:
        key = outer_key(strategy)
        if key in seen or key.pp * key.virtual_stages > sum(l.kind == "block" for l in layers):
            continue
        seen.add(key)
        if spent >= MAX_SOLVES or hopeless >= MAX_INFEASIBLE:
            break
        infeasible_before = stats.infeasible
        # Zero-bubble splits the backward; the runtime cannot recompute under it, so only stage sizes are chosen.
        allowed = ["none"] if key.schedule == "zero-bubble" else [
            p for p in policies if p != "selective" or runtime_conflict(strategy_features(key) | {"selective"}) is None]
        found = _refine_one(layers, cluster, training, key, policies=allowed, incumbent=incumbent, stats=stats)
        incumbent = _keep_if_better(found, incumbent, refined, stats)
        if not found and key not in fitting and stats.infeasible > infeasible_before:
            hopeless += 1  # nothing fits it: the mixed program below does not run either
            continue
        spent += 1
        options = block_option_names(key, cluster, allowed, block_options)
        # The mixed program where it can add something: blocks of several kinds or more options than the table's,
        # on an outer candidate that fits at all (with a uniform policy, or as the table program found).
        # Blocks of several kinds are first planned on the table's options alone, so that switching more options on
        # never gives a slower plan through the linear model's approximations.
        # Interleaved chunks are even in the table program: the mixed one chooses their sizes, for alike blocks too.
        uneven = several_kinds or key.virtual_stages > 1
        for names in _mixed_option_sets(allowed, options, several_kinds=uneven) if key in fitting or found else ():
            found = _refine_mixed(layers, cluster, training, key, options=names, incumbent=incumbent, stats=stats)
            incumbent = _keep_if_better(found, incumbent, refined, stats)
    return refined


def _mixed_option_sets(allowed: list[str], options: list[str], *, several_kinds: bool) -> list[list[str]]:
    """The option sets the mixed program runs with: the table's and then all of them for blocks of several kinds,
    all of them for alike blocks when there are more than the table's (none otherwise)."""
    if several_kinds:
        return [allowed] + ([options] if len(options) > len(allowed) else [])
    return [options] if len(options) > len(allowed) else []


def _keep_if_better(found, incumbent: float, refined: list, stats: RefineStats) -> float:
    """Record ``found`` when it fits and beats ``incumbent``; the new incumbent."""
    if found and found[1].fits and found[1].step_time_s < incumbent:
        refined.append(found)
        stats.improved.append(found[0].to_string())
        return found[1].step_time_s
    return incumbent


def block_option_names(
    key: Strategy, cluster: Cluster, policies: Sequence[Recompute], block_options: BlockOptions
) -> list[str]:
    """The per-block options of the mixed program for ``key``: the recomputation policies, offload, and their
    ``+keep`` variants under ZeRO-3, each only where switched on and the runtime composes it with ``key``.
    Offload is not offered where the device's memory is the host's (a CPU rank) or under zero-bubble."""
    features = strategy_features(key)
    activation = list(policies)
    if (block_options.offload and key.schedule != "zero-bubble" and cluster.device.name != LOCAL_CPU
            and runtime_conflict(features | {"offload"}) is None):
        activation.append("offload")
    names = [option_name(p, reshard=True) for p in activation]
    if block_options.keep_gathered and key.zero == 3 and runtime_conflict(features | {"block-reshard"}) is None:
        names += [option_name(p, reshard=False) for p in activation]
    return names


def _refine_mixed(layers, cluster, training, key: Strategy, *, options, incumbent: float, stats: RefineStats):
    """The mixed program (``planner.ilp_mixed``) for one outer candidate, re-checked by ``estimate``."""
    whole = _whole(layers, key)
    if step_time_lower_bound(layers, cluster, training, key, whole=whole) >= incumbent:  # before any coefficient
        stats.pruned += 1
        return None
    kinds, _ = block_kinds(layers)
    measure = StageMeasure(cluster, training, key)
    slots = _slots(key, training, cluster)
    floor = dp_lower_bound_s(whole, cluster, training, key)
    if slots * pace_lower_bound_s(layers, key, options=options, measure=measure) + floor >= incumbent:
        stats.pruned += 1
        return None
    coeffs = kind_coefficients(layers, cluster, training, key, options=options, measure=measure)
    chunk_stages = [c % key.pp for c in range(key.pp * key.virtual_stages)]
    micro_batches = key.gradient_accumulation(training.global_batch)

    def solve_at(budget: float, _first: bool):
        result = solve_mixed(coeffs, kinds=kinds, budget_bytes=budget, slots=slots, micro_batches=micro_batches,
                             chunk_stages=chunk_stages, zero3=key.zero == 3,
                             step_limit_s=incumbent if incumbent < float("inf") else None)
        return result and (result, materialise_options(key, result.options, chunk_blocks=result.chunk_blocks))

    return _solve_and_check(layers, cluster, training, solve_at, stats=stats,
                            policies=sorted({split_option(o)[0] for o in options}))


def _solve_and_check(layers, cluster, training, solve_at, *, stats: RefineStats, policies: Sequence[str]):
    """Solve at the device budget, re-check with ``estimate``, and where the linear model was optimistic
    tighten the budget by the overshoot and solve again (``BUDGET_RETRIES`` times); a solution that fits is then
    lightened where the linear model was pessimistic (``planner.lighten``, within ``policies``).
    ``solve_at(budget, first)`` returns (the solver's result, its strategy) or None when infeasible."""
    budget = float(cluster.device.memory_bytes)
    for attempt in range(BUDGET_RETRIES + 1):
        solved = solve_at(budget, attempt == 0)
        if not solved:
            stats.infeasible += 1
            return None
        result, strategy = solved
        stats.solved += 1
        stats.solver_time_s += result.wall_time_s
        stats.worst_gap = max(stats.worst_gap, result.gap)
        est = estimate(layers, cluster, training, strategy)
        if est.fits:
            return lighten(layers, cluster, training, (strategy, est), policies=policies)
        budget -= est.peak_memory_bytes - est.memory_budget_bytes
    return None


def materialise_options(key: Strategy, options: Sequence[str], *, chunk_blocks: Sequence[int]) -> Strategy:
    """Turn each block's option (model order) into a Strategy: per-block policies and resharding, the blocks of
    each pipeline chunk (uniform fields where a choice is the same for every block, chunks as even as possible)."""
    policies = tuple(split_option(o)[0] for o in options)
    reshard = tuple(split_option(o)[1] for o in options)
    update: dict[str, object] = {}
    if len(set(policies)) == 1:
        update["recompute"] = policies[0]
    else:
        update["block_recompute"] = policies
    if key.zero == 3 and not all(reshard):
        update["block_reshard"] = reshard
    blocks, chunks = len(options), key.pp * key.virtual_stages
    if tuple(chunk_blocks) != tuple(blocks // chunks + (c < blocks % chunks) for c in range(chunks)):
        update["chunk_blocks"] = tuple(chunk_blocks)
    return key.model_copy(update=update)


def _refine_one(layers, cluster, training, key: Strategy, *, policies, incumbent: float, stats: RefineStats):
    coeffs = coefficients(layers, cluster, training, key, policies=policies)
    blocks = sum(layer.kind == "block" for layer in layers)
    to_beat = incumbent - dp_lower_bound_s(_whole(layers, key), cluster, training, key)  # the pace's share, at most
    if _lower_bound_step(coeffs, key, training, cluster, blocks=blocks) >= to_beat:
        stats.pruned += 1
        return None
    fixed = _even_stage_shares(blocks, key) if key.virtual_stages > 1 else None
    budget = float(cluster.device.memory_bytes)
    tables = stage_tables(coeffs, blocks=blocks, budget_bytes=budget)  # shared by the bound and the first solve
    pace = optimal_pace_s(coeffs, blocks=blocks, budget_bytes=budget, fixed_blocks=fixed, tables=tables)
    if pace is not None and _slots(key, training, cluster) * pace >= to_beat:  # even the optimum cannot win: skip the solve
        stats.pruned += 1
        return None

    def solve_at(at: float, first: bool):  # a retry tightens the budget: its tables differ
        result = solve(coeffs, blocks=blocks, budget_bytes=at, fixed_blocks=fixed, tables=tables if first else None)
        return result and (result, materialise(key, result.blocks, blocks=blocks))

    return _solve_and_check(layers, cluster, training, solve_at, stats=stats, policies=policies)


def _whole(layers, key: Strategy):
    """The model summed as one stage under ``key``'s policies: what the step-time bounds and the data-parallel floor
    (``estimate.dp_lower_bound_s``, which holds whatever a refinement's policies, stage sizes and kept weights)
    start from."""
    return cached_stage_totals(layers, 0, block_policies(layers, key))


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
