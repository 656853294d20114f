"""Search: enumerate strategies, estimate each, keep the fastest that fits in memory.

This is the thin slice: the data-parallel axis only (DDP or FSDP2), micro-batch size and full
recomputation of blocks. The planner issue adds tp/pp/cp/ep, the integer program and pruning.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from tessera.cost_models import Estimate, Strategy, TrainingConfig, estimate
from tessera.errors import ConfigError, InfeasiblePlanError
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.plan import Candidate, Plan, PlannedLayer
from tessera.topology.cluster import Cluster

GiB = 2**30
MAX_MICRO_BATCH = 64
RUNNERS_UP = 5


def candidate_strategies(cluster: Cluster, training: TrainingConfig) -> Iterator[Strategy]:
    """Every data-parallel strategy for this cluster and batch, in a fixed order."""
    dp = cluster.num_devices
    if training.global_batch % dp:
        raise ConfigError(
            f"global batch {training.global_batch} is not divisible by the {dp} data-parallel ranks of "
            f"{cluster.name}; use a global batch that is a multiple of {dp}"
        )
    per_rank = training.global_batch // dp
    for zero in (0, 3):
        for micro_batch in (m for m in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % m == 0):
            for recompute in ("none", "full"):
                yield Strategy(dp=dp, zero=zero, micro_batch=micro_batch, recompute=recompute)


def search(graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, fixed: Strategy | None = None) -> Plan:
    """Return the fastest strategy that fits; ``fixed`` evaluates one given strategy instead."""
    start = time.perf_counter()
    strategies = [fixed] if fixed is not None else list(candidate_strategies(cluster, training))
    scored = sorted(
        ((s, estimate(graph.layers, cluster, training, s)) for s in strategies),
        key=lambda pair: (pair[1].step_time_s, pair[1].peak_memory_bytes, pair[0].to_string()),
    )
    fitting = [pair for pair in scored if pair[1].fits]
    if not fitting:
        raise InfeasiblePlanError(diagnose_infeasible(scored, cluster))
    best, best_estimate = fitting[0]
    return Plan(
        model_name=graph.model_name,
        param_count=graph.param_count,
        cluster=cluster.name,
        device_name=cluster.device.name,
        training=training,
        strategy=best,
        estimate=best_estimate,
        layers=tuple(
            PlannedLayer(fqn=layer.fqn, kind=layer.kind, recompute=best.recompute if layer.kind == "block" else "none")
            for layer in graph.layers
        ),
        alternatives=runners_up(scored, best_estimate),
        candidates_evaluated=len(scored),
        search_time_s=time.perf_counter() - start,
    )


def runners_up(scored: list[tuple[Strategy, Estimate]], best: Estimate) -> tuple[Candidate, ...]:
    """The next-best distinct strategies, each with the reason it lost."""
    # Fitting strategies first (fastest first), then the ones that do not fit (leanest first).
    losers = sorted(
        ((s, e) for s, e in scored if e is not best),
        key=lambda pair: (not pair[1].fits, pair[1].step_time_s if pair[1].fits else pair[1].peak_memory_bytes),
    )
    return tuple(Candidate(strategy=s, estimate=e, verdict=_verdict(e, best)) for s, e in losers[:RUNNERS_UP])


def _verdict(candidate: Estimate, best: Estimate) -> str:
    if not candidate.fits:
        over = (candidate.peak_memory_bytes - candidate.memory_budget_bytes) / GiB
        return f"does not fit: {over:.1f} GiB over"
    slower = candidate.step_time_s / best.step_time_s - 1
    return f"{slower:.1%} slower"


def diagnose_infeasible(scored: list[tuple[Strategy, Estimate]], cluster: Cluster) -> str:
    """Say how far the leanest strategy is from fitting and what would make it fit."""
    strategy, leanest = min(scored, key=lambda pair: pair[1].peak_memory_bytes)
    need, have = leanest.peak_memory_bytes / GiB, leanest.memory_budget_bytes / GiB
    biggest = max(leanest.memory_by_category_bytes.items(), key=lambda item: item[1])
    return (
        f"no strategy fits in {have:.1f} GiB per device on {cluster.name}: the leanest "
        f"({strategy.to_string()}) needs {need:.1f} GiB, {need - have:.1f} GiB over; its largest share is "
        f"{biggest[0]} ({biggest[1] / GiB:.1f} GiB). Add devices (more nodes shard FSDP state further), "
        "shorten the sequence, or wait for tensor/pipeline parallelism (planner issue)"
    )
