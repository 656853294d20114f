"""Search: enumerate strategies (``planner.space``), estimate each, keep the fastest that fits in memory.

Exhaustive over the space for now; the planner issue adds lower-bound pruning and the integer program
for per-layer recomputation and stage boundaries.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from tessera.cost_models import Estimate, Strategy, TrainingConfig, estimate
from tessera.cost_models.partition import split_chunks
from tessera.errors import ConfigError, InfeasiblePlanError
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.plan import Candidate, Plan, PlannedLayer
from tessera.planner.space import check_pins, strategies
from tessera.topology.cluster import Cluster

GiB = 2**30
RUNNERS_UP = 5


def rank_candidates(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, pins: Mapping[str, object] | None = None
) -> list[tuple[Strategy, Estimate]]:
    """Every strategy under ``pins`` with its estimate, fastest first (ties: leaner, then by name)."""
    pins = dict(pins or {})
    check_pins(pins, cluster)
    layers = list(graph.layers)
    scored = sorted(
        ((s, estimate(layers, cluster, training, s)) for s in strategies(layers, cluster, training, pins)),
        key=lambda pair: (pair[1].step_time_s, pair[1].peak_memory_bytes, pair[0].to_string()),
    )
    if not scored:
        raise ConfigError(
            f"no strategy matches {pins or 'the request'} on {cluster.name} with global batch "
            f"{training.global_batch}: dp must divide the batch, tp the heads, pp the blocks"
        )
    return scored


def best_candidate(scored: list[tuple[Strategy, Estimate]]) -> tuple[Strategy, Estimate]:
    """The fastest candidate that fits, or the fastest of all when none fits (its estimate says so)."""
    return next((pair for pair in scored if pair[1].fits), scored[0])


def search(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, pins: Mapping[str, object] | None = None,
    top: int = RUNNERS_UP,
) -> Plan:
    """Return the fastest strategy that fits; ``pins`` fixes any strategy fields (``{"tp": 8}``)."""
    start = time.perf_counter()
    scored = rank_candidates(graph, cluster, training, pins=pins)
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
        layers=planned_layers(graph, best),
        alternatives=runners_up(scored, best_estimate, top=top),
        candidates_evaluated=len(scored),
        search_time_s=time.perf_counter() - start,
    )


def planned_layers(graph: LayerGraph, strategy: Strategy) -> tuple[PlannedLayer, ...]:
    """Per-layer decisions: recomputation of blocks and the pipeline chunk of every layer."""
    return tuple(
        PlannedLayer(fqn=layer.fqn, kind=layer.kind, chunk=chunk,
                     recompute=strategy.recompute if layer.kind == "block" else "none")
        for chunk, layers in enumerate(split_chunks(graph.layers, strategy))
        for layer in layers
    )


def runners_up(scored: list[tuple[Strategy, Estimate]], best: Estimate, *, top: int = RUNNERS_UP) -> tuple[Candidate, ...]:
    """The next-best distinct strategies, each with the reason it lost."""
    # Fitting strategies first (fastest first), then the ones that do not fit (leanest first).
    losers = sorted(
        ((s, e) for s, e in scored if e is not best),
        key=lambda pair: (not pair[1].fits, pair[1].step_time_s if pair[1].fits else pair[1].peak_memory_bytes),
    )
    return tuple(Candidate(strategy=s, estimate=e, verdict=_verdict(e, best)) for s, e in losers[:top])


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
