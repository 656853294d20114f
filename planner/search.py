"""Search: enumerate strategies (``planner.space``), estimate the promising ones, keep the fastest that fits.

Candidates are visited in order of a cheap step-time lower bound (compute spread perfectly over the
pipeline, ``cost_models.estimate.step_time_lower_bound``); once the bound reaches the fastest fitting
estimate found so far, no later candidate can win and the enumeration stops. The most promising outer
candidates are then refined by the integer program (``planner.refine``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tessera.cost_models import Estimate, Strategy, TrainingConfig, estimate
from tessera.cost_models.estimate import peak_memory_bytes, step_time_lower_bound
from tessera.cost_models.layer_costs import layer_costs
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.partition import block_policies, kept_blocks, split_chunks, stage_totals
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.errors import ConfigError, InfeasiblePlanError
from tessera.planner.degrees import degree_alternatives
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.plan import Candidate, Plan, PlannedLayer, SolverStats
from tessera.planner.refine import RUNTIME_BLOCK_OPTIONS, BlockOptions, RefineStats, refine
from tessera.planner.space import (
    check_context_pins, check_expert_pins, check_layer_pins, check_pins, mesh_shapes, model_features, strategies,
)
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU
from tessera.topology.validation import quoted

GiB = 2**30
RUNNERS_UP = 5
RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2, "offload": 3}
"""Time order: recomputing more never runs faster. Uniform ``offload`` comes only pinned (the space offers it per
block), so its place only keeps a pinned search from failing on it."""
GATHERED_COPY_BYTES = 2  # ZeRO-1/2's gathered parameters at the narrowest compute dtype (``memory.parameter_bytes``)
Progress = Callable[[int, int], None]


@dataclass
class Priced:
    """Step-time lower bounds and estimates already computed for one model, cluster and training setup: the
    searches one ``search`` runs (pinned to each other expert-parallel degree, each unavailable axis) meet
    many of the same strategies."""

    bounds: dict[Strategy, float] = field(default_factory=dict)
    estimates: dict[Strategy, Estimate] = field(default_factory=dict)


def rank_candidates(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, pins: Mapping[str, object] | None = None,
    progress: Progress | None = None, prune: bool = True, reached: dict[str, float] | None = None,
    priced: Priced | None = None, only_best: bool = False, profile: ImplementationProfile = TESSERA, keep: int = 1,
    contenders: set[Strategy] | None = None,
) -> list[tuple[Strategy, Estimate]]:
    """Every strategy under ``pins`` with its estimate, fastest first (ties: leaner, then by name), as the framework
    ``profile`` runs it (``cost_models.profiles``; Tessera's runtime by default; ``priced`` must be for it too),
    within that framework's limits only (:func:`model_limits`).

    Never estimated, because they cannot fit: a mesh shape and ZeRO stage whose model state alone overflows
    the device, and micro-batches larger than one at which no recomputation policy fit (activations only
    grow with the micro-batch, except under GPipe). With ``prune`` (the default) also those that cannot
    win: candidates whose step-time lower bound reaches the ``keep``-th fastest fitting estimate found so far (1:
    the fastest; more keeps the runners-up exact; ``contenders`` collects those estimated while their bound was
    below the fastest so far, what ``keep=1`` estimates), and a
    recomputation policy costlier than one that already fits with every other choice equal (recomputing
    more only adds time). ``prune=False`` estimates every candidate that may fit (a study of the whole
    space, such as the local-truth benchmark). ``reached["bound"]`` is set to the lower bound the enumeration
    stopped at: every candidate of the space whose estimate is below it was estimated (``inf``: all were).
    ``priced`` holds bounds and estimates of earlier calls on the same graph, cluster and training, reused here.
    ``only_best``: only the fastest fitting candidate is wanted, or the leanest when none fits (a search pinned to
    one degree); candidates whose peak memory (``peak_memory_bytes``, without the step time) is over the device and
    above the leanest estimated so far can be neither, and are left out of the result.
    """
    if keep < 1:
        raise ValueError(f"keep must be 1 or more (the fastest fitting candidates kept exact), got {keep}")
    pins = dict(pins or {})
    unavailable = model_limits(graph, profile)
    check_pins(pins, cluster, unavailable=unavailable, exclusive=profile.refused_together,
               runtime=profile.model_limits)
    layers = list(graph.layers)
    check_expert_pins(pins, {layer.experts for layer in layers if layer.experts})
    check_context_pins(pins, training)
    check_layer_pins(pins, layers)
    params = _dense_and_expert_params(layers)
    no_fit_at: dict[tuple, int] = {}
    fits_at: set[tuple] = set()
    cheapest_fit: dict[tuple, int] = {}  # outer choices -> cost rank of the cheapest recomputation that fits
    scored, overflowing = [], []
    priced = Priced() if priced is None else priced
    space = strategies(layers, cluster, training, pins, unavailable=unavailable, exclusive=profile.refused_together,
                       runtime=profile.model_limits)
    candidates = _by_lower_bound(layers, cluster, training, list(space), known=priced.bounds, profile=profile)
    incumbent = float("inf")  # the keep-th fastest fitting step so far
    fastest: list[float] = []  # the keep fastest fitting steps so far, negated (a max-heap)
    fastest_fit = float("inf")
    leanest = float("inf")  # lowest peak memory estimated so far (``only_best``)
    for done, (bound, strategy) in enumerate(candidates, 1):
        if progress is not None and (done % 256 == 0 or done == len(candidates)):
            progress(done, len(candidates))
        if prune and bound >= incumbent:  # sorted by bound: no later candidate can be faster either
            if reached is not None:
                reached["bound"] = bound
            break
        key = (strategy.dp, strategy.tp, strategy.pp, strategy.cp, strategy.ep, strategy.zero, strategy.sp,
               strategy.schedule, strategy.virtual_stages)
        if _state_bytes_lower_bound(params, strategy, profile) > cluster.device.memory_bytes:
            overflowing.append(strategy)
            continue
        if strategy.schedule != "gpipe" and no_fit_at.get(key, strategy.micro_batch) < strategy.micro_batch:
            continue
        if prune and cheapest_fit.get((*key, strategy.micro_batch), len(RECOMPUTE_COST)) < RECOMPUTE_COST[strategy.recompute]:
            continue
        est = priced.estimates.get(strategy)
        if est is None and not (only_best and _neither_fits_nor_leanest(layers, cluster, training, strategy, leanest,
                                                                         profile=profile)):
            est = priced.estimates[strategy] = estimate(layers, cluster, training, strategy, profile=profile)
        if est is not None:
            scored.append((strategy, est))
            if contenders is not None and bound < fastest_fit:
                contenders.add(strategy)
            leanest = min(leanest, est.peak_memory_bytes)
        if est is not None and est.fits:
            (heapq.heappushpop if len(fastest) == keep else heapq.heappush)(fastest, -est.step_time_s)
            incumbent = -fastest[0] if len(fastest) == keep else incumbent
            fastest_fit = min(fastest_fit, est.step_time_s)
            fits_at.add((*key, strategy.micro_batch))
            cheapest_fit.setdefault((*key, strategy.micro_batch), RECOMPUTE_COST[strategy.recompute])
            no_fit_at.pop(key, None)
        elif (*key, strategy.micro_batch) not in fits_at and strategy.recompute == "full":
            no_fit_at.setdefault(key, strategy.micro_batch)  # (a candidate left out under only_best does not fit)
    if progress is not None:
        progress(len(candidates), len(candidates))
    if overflowing and not fits_at:  # nothing fits: estimate the leanest pruned ones so the diagnosis is exact
        least = min((_state_bytes_lower_bound(params, s, profile), s.micro_batch) for s in overflowing)
        leanest_overflowing = [(s, estimate(layers, cluster, training, s, profile=profile)) for s in overflowing
                               if (_state_bytes_lower_bound(params, s, profile), s.micro_batch) == least][:64]
        scored += leanest_overflowing
        if contenders is not None:
            contenders.update(s for s, _ in leanest_overflowing)
    scored.sort(key=_rank)
    if not scored:
        raise ConfigError(
            f"no strategy matches {quoted(pins) if pins else 'the request'} on {cluster.name} with global batch "
            f"{training.global_batch}: dp must divide the batch, tp the heads, pp the blocks"
            + ("; ep must divide dp (and the experts), or dp * tp with etp=1" if int(pins.get("ep", 1)) > 1 else "")
            + ("; PyTorch's interleaved and zero-bubble schedules run a multiple of max(1, micro-batches // pp) "
               "micro-batches" if pins.get("schedule") in ("interleaved", "zero-bubble") else "")
        )
    return scored


def _neither_fits_nor_leanest(
    layers: list[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy, leanest: float,
    *, profile: ImplementationProfile,
) -> bool:
    """Whether ``strategy``'s peak memory is over the device and above ``leanest``: it cannot be a search's fastest
    fitting candidate, nor its leanest."""
    peak = peak_memory_bytes(layers, cluster, training, strategy, profile=profile)
    return peak > cluster.device.memory_bytes and peak > leanest


def _by_lower_bound(
    layers: list[LayerStats], cluster: Cluster, training: TrainingConfig, candidates: list[Strategy],
    *, known: dict[Strategy, float], profile: ImplementationProfile = TESSERA,
) -> list[tuple[float, Strategy]]:
    """Candidates with their step-time lower bound as ``profile`` runs them, lowest first (stable: the space's order
    breaks ties); ``known`` bounds are reused and new ones added to it."""
    wholes: dict[object, object] = {}  # the whole model's totals under each block recomputation
    bounded = []
    for s in candidates:
        bound = known.get(s)
        if bound is None:
            key = s.block_recompute or s.recompute
            if key not in wholes:
                wholes[key] = stage_totals(layers, 0, block_policies(layers, s))
            bound = known[s] = step_time_lower_bound(layers, cluster, training, s, whole=wholes[key], profile=profile)
        bounded.append((bound, s))
    return sorted(bounded, key=lambda pair: pair[0])


def _dense_and_expert_params(layers: list[LayerStats]) -> tuple[int, int]:
    """The model's parameters split into dense ones and routed experts (which expert parallelism divides)."""
    expert = sum(layer.expert_param_count for layer in layers)
    return sum(layer.param_count for layer in layers) - expert, expert


def _state_bytes_lower_bound(params: tuple[int, int], strategy: Strategy, profile: ImplementationProfile) -> float:
    """Model state per device that ``cost_models.memory`` never prices below, at ``profile``'s dtypes (fp32 in mixed
    precision), spread perfectly over tp*pp (experts also over ep) and over the ranks holding the same weights
    (dp*cp for dense, (dp/ep)*cp for experts): :func:`_state_bytes_per_param`."""
    dense, expert = params
    return (dense * _state_bytes_per_param(strategy, strategy.dp * strategy.cp, profile)
            + expert * _state_bytes_per_param(strategy, strategy.expert_dp * strategy.cp, profile) / strategy.ep
            ) / (strategy.tp * strategy.pp)


def _state_bytes_per_param(strategy: Strategy, group: int, profile: ImplementationProfile) -> float:
    """Bytes per parameter a step's higher memory mark holds at least. ZeRO-0 keeps the masters, gradients and
    moments whole. ZeRO-1 to 3 (FSDP2) shard all three over ``group``; ZeRO-1/2 also keep the gathered compute-dtype
    parameters from forward to backward (2 bytes at least), while their gradients are whole only when micro-batches
    accumulate: the backward's mark holds the copy, the step end's the sharded gradients, so the larger counts."""
    state = profile.master_bytes + 2 * profile.moment_bytes
    if strategy.zero == 0:
        return state + profile.gradient_bytes
    sharded = state / group
    if strategy.zero == 3:
        return sharded + profile.gradient_bytes / group
    return sharded + max(GATHERED_COPY_BYTES, profile.gradient_bytes / group)


def _rank(pair: tuple[Strategy, Estimate]) -> tuple:
    """Fastest first; at the same predicted step, the least recomputation (priced as hidden, it still runs), then the
    least memory."""
    strategy, estimate = pair
    return estimate.step_time_s, estimate.recompute_time_s, estimate.peak_memory_bytes, strategy.to_string()


def best_candidate(scored: list[tuple[Strategy, Estimate]]) -> tuple[Strategy, Estimate]:
    """The fastest candidate that fits, or the fastest of all when none fits (its estimate says so)."""
    return next((pair for pair in scored if pair[1].fits), scored[0])


def fitting_or_leanest(scored: list[tuple[Strategy, Estimate]]) -> tuple[Strategy, Estimate]:
    """The fastest candidate that fits, or the leanest when none fits: how far a pinned strategy is over the
    device at best (``tessera evaluate`` and ``tessera compare`` fill a partial strategy so)."""
    best = best_candidate(scored)
    return best if best[1].fits else min(scored, key=lambda pair: pair[1].peak_memory_bytes)


def search(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, pins: Mapping[str, object] | None = None,
    top: int = RUNNERS_UP, progress: Progress | None = None, block_options: BlockOptions = RUNTIME_BLOCK_OPTIONS,
) -> Plan:
    """Return the fastest strategy that fits; ``pins`` fixes any strategy fields (``{"tp": 8}``).

    ``progress(done, total)`` is called as candidates are estimated (the CLI draws a bar with it).
    ``block_options``: the per-block choices beyond recomputation the integer program may make (offload, ZeRO-3
    blocks keeping their gathered weights); by default those the runtime runs (``refine.RUNTIME_BLOCK_OPTIONS``).
    """
    start = time.perf_counter()
    reached = {"bound": float("inf")}
    priced = Priced()
    contenders: set[Strategy] = set()  # what the integer program refines: the candidates that could beat the best
    scored = rank_candidates(graph, cluster, training, pins=pins, progress=progress, reached=reached, priced=priced,
                             keep=top + 1, contenders=contenders)  # the plan and its runners-up exact
    stats = RefineStats()
    uniform = best_candidate(scored)
    if not _per_layer_pinned(pins or {}):
        refined = refine(list(graph.layers), cluster, training, [pair for pair in scored if pair[0] in contenders],
                         policies=_policies(graph, pins or {}), stats=stats, block_options=block_options)
        scored = sorted(refined + scored, key=_rank)
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
        layers=planned_layers(graph, best, cluster=cluster, training=training),
        alternatives=runners_up(scored, best_estimate, top=top),
        degree_alternatives=degree_alternatives(
            scored, best, best_estimate,
            rerank=lambda extra: rank_candidates(graph, cluster, training, pins={**(pins or {}), **extra}, priced=priced,
                                                 only_best=True),
            admitted=_admitted_degrees(graph, cluster, training, pins or {}), exact_below_s=reached["bound"],
        ),
        unavailable_axes=graph.unavailable_axes,
        token_inputs=graph.token_inputs,
        unavailable_gains=unavailable_gains(graph, cluster, training, pins=pins or {}, best=best_estimate, priced=priced),
        candidates_evaluated=len(scored),
        search_time_s=time.perf_counter() - start,
        solver=SolverStats(
            ilp_solved=stats.solved, ilp_pruned=stats.pruned, ilp_infeasible=stats.infeasible,
            ilp_time_s=stats.solver_time_s, worst_gap=stats.worst_gap, ilp_improvements=len(stats.improved),
        ),
        uniform=uniform_candidate(uniform, best_estimate),
    )


def uniform_candidate(uniform: tuple[Strategy, Estimate], best: Estimate) -> Candidate | None:
    """The best uniform strategy, with what the per-layer plan gains over it; None when the plan is uniform
    or no uniform strategy fits."""
    strategy, est = uniform
    if est is best or not est.fits:
        return None
    gain = est.step_time_s / best.step_time_s - 1
    return Candidate(strategy=strategy, estimate=est, verdict=f"the per-layer plan is {gain:.1%} faster")


def model_limits(graph: LayerGraph, profile: ImplementationProfile) -> Mapping[str, str]:
    """What ``profile``'s framework cannot apply to this model: Tessera's runtime's limits (``graph.unavailable_axes``)
    for Tessera's runtime; none for another framework, which runs its own code (its limits are its profile's)."""
    return graph.unavailable_axes if profile.model_limits else {}


def unavailable_gains(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, pins: Mapping[str, object], best: Estimate,
    priced: Priced | None = None,
) -> tuple[Candidate, ...]:
    """For each unavailable axis, the fastest uniform strategy (no integer program) using it, were the runtime to
    apply it to the model: what that axis would gain over the plan. Axes whose best strategy does not use them
    are left out."""
    found = []
    for axis in graph.unavailable_axes:
        rest = {other: why for other, why in graph.unavailable_axes.items() if other != axis}
        try:
            scored = rank_candidates(graph.model_copy(update={"unavailable_axes": rest}), cluster, training, pins=pins,
                                     priced=priced, only_best=True)
        except ConfigError:
            continue
        strategy, est = best_candidate(scored)
        if set(axis.split("+")) <= model_features(strategy, training) and est.fits:
            gain = 1 - est.step_time_s / best.step_time_s
            verdict = f"{axis} would gain {gain:.1%}" if gain > 0 else f"{axis} would gain nothing"
            found.append(Candidate(strategy=strategy, estimate=est, verdict=verdict))
    return tuple(found)


def _admitted_degrees(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object]
) -> dict[str, set[int]]:
    """Expert- and context-parallel degrees of the search space, reached by the pruned search or not."""
    shapes = list(mesh_shapes(list(graph.layers), cluster, training, pins, unavailable=graph.unavailable_axes))
    return {"ep": {shape[4] for shape in shapes}, "cp": {shape[3] for shape in shapes}}


def _per_layer_pinned(pins: Mapping[str, object]) -> bool:
    """The user fixed recomputation or stage sizes themselves: keep them, no integer program."""
    return any(key in pins for key in ("recompute", "block_recompute", "chunk_blocks", "block_reshard"))


def _policies(graph: LayerGraph, pins: Mapping[str, object]) -> list[str]:
    if "recompute" in graph.unavailable_axes:  # the runtime cannot recompute this model's blocks (BatchNorm)
        return ["none"]
    measured_selective = any(layer.saved_bytes_selective is not None for layer in graph.layers)
    return ["none", "full"] + (["selective"] if measured_selective else [])


def planned_layers(
    graph: LayerGraph, strategy: Strategy, *, cluster: Cluster | None = None, training: TrainingConfig | None = None,
) -> tuple[PlannedLayer, ...]:
    """Per-layer decisions: each block's activation policy and resharding, every layer's pipeline chunk, and,
    given the cluster and training, what each layer costs (``cost_models.layer_costs``)."""
    policies = block_policies(graph.layers, strategy)
    kept = kept_blocks(graph.layers, strategy)
    costs = layer_costs(graph.layers, cluster, training, strategy) if cluster and training else {}
    return tuple(
        PlannedLayer(fqn=layer.fqn, kind=layer.kind, chunk=chunk, recompute=policies.get(layer.fqn, "none"),
                     block_kind=layer.block_kind, reshard=layer.fqn not in kept,
                     memory_bytes=costs.get(layer.fqn, (0, 0.0))[0], time_s=costs.get(layer.fqn, (0, 0.0))[1])
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
    """Say how far the leanest strategy is from fitting, what binds, and which knob would make it fit."""
    strategy, leanest = min(scored, key=lambda pair: pair[1].peak_memory_bytes)
    need, have = leanest.peak_memory_bytes / GiB, leanest.memory_budget_bytes / GiB
    biggest = max(leanest.memory_by_category_bytes.items(), key=lambda item: item[1])
    return (
        f"no strategy fits in {_gib(have * GiB)} GiB per device on {cluster.name}: the leanest "
        f"({strategy.to_string()}) needs {_gib(need * GiB)} GiB per device, {_gib((need - have) * GiB)} GiB over; its "
        f"largest share is {biggest[0]} ({_gib(biggest[1])} GiB). {_knob(strategy, leanest, cluster)}"
    )


def _gib(nbytes: float) -> str:
    """``1,051.3`` or ``0.0058``: GiB to a tenth, and a tiny amount (a rank of a many-rank CPU run) to 2 digits."""
    value = nbytes / GiB
    return f"{value:,.1f}" if value >= 0.1 else f"{value:.2g}"


def _knob(strategy: Strategy, leanest: Estimate, cluster: Cluster) -> str:
    """The change most likely to make the leanest strategy fit."""
    state = sum(leanest.memory_by_category_bytes[k] for k in ("parameters", "gradients", "optimizer"))
    if state >= leanest.memory_budget_bytes * 0.8:
        needs = f"Model state alone needs {_gib(state)} GiB per device"
        if strategy.zero < 3 and strategy.dp * strategy.cp > 1:  # a pin kept it from sharding (the space has ZeRO-3)
            return (f"{needs} under zero={strategy.zero}: ZeRO-3 would shard it (pin zero=3 or leave zero out, where the "
                    "model allows it), or split the model with tp or pp.")
        if cluster.device.name == LOCAL_CPU:  # more ranks only split this machine's memory further
            return (f"{needs}, and this machine's memory gives each of its {cluster.num_devices} ranks "
                    f"{_gib(leanest.memory_budget_bytes)} GiB: plan a smaller model, or use a machine with more memory.")
        factor = state / (leanest.memory_budget_bytes * 0.6)
        nodes = -(-cluster.num_nodes * factor // 1)
        return f"{needs}: use about {int(nodes)} nodes ({factor:.1f}x the devices) so sharding divides it further."
    return "Activations dominate: shorten the sequence, lower the global batch per device, or add devices."
