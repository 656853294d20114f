"""``estimate``: one strategy in, predicted step time, throughput and per-device memory out.

The step is the pipeline's time for all micro-batches on its slowest stage (compute, recomputation,
exposed tensor-parallel, point-to-point, expert all-to-all and context-parallel ring communication
(``cost_models.sparse``), plus the schedule's bubble; on ranks sharing CPU cores, bounded by the mean stage's
work instead: ``cost_models.pipeline.pipeline_time_s``), then the exposed data-parallel communication, what the
collectives it hides slow the compute beside them (``contention_s``), the optimizer update and the stragglers.
Memory is checked on every stage; the worst one is reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from tessera.cost_models.communication import (
    dp_comm_s, dp_traffic_lower_bound_s, exposed_dp_comm_s, pp_comm_s, sharded_comm_slowdown, tp_comm_s,
)
from tessera.cost_models.compute import (
    GPU_CALIBRATION, Calibration, achievable_flops, attention_core_rate, bf16_or, compute_lower_bound_s,
    device_calibration, optimizer_step_s, recomputed_flops, stage_compute_s,
)
from tessera.cost_models.memory import as_run, loss_as_run, stage_memory
from tessera.cost_models.memory_state import local_params
from tessera.cost_models.estimate_notes import estimate_notes
from tessera.cost_models.module_recompute import with_recomputed_modules
from tessera.cost_models.offload import exposed_offload_s
from tessera.cost_models.partition import (
    StageTotals, block_policies, cached_stage_totals, kept_blocks, split_blocks, stage_totals,
)
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.cost_models.pipeline import in_flight_micro_batches, pipeline_slots_lower_bound, pipeline_time_s
from tessera.cost_models.sparse import (
    check_sparse_and_long, cp_comm_s, ep_comm_s, ep_stride, exposed_ep_comm_s, sharded_params, unpartnered_share,
)
from tessera.cost_models.types import Estimate, Strategy, TrainingConfig
from tessera.errors import ConfigError
from tessera.topology.cluster import Cluster, DeviceSpec
from tessera.topology.hardware import LOCAL_CPU
from tessera.topology.collectives import all_reduce_time, all_to_all_time


@dataclass(frozen=True)
class StageTime:
    """Seconds one micro-batch spends on one stage, by part."""

    forward: float
    backward: float
    recompute: float
    tp_comm: float
    pp_comm: float
    ep_comm: float = 0.0  # the part of the expert dispatch/combine all-to-alls on the critical path
    ep_comm_total: float = 0.0  # the whole all-to-alls, hidden or not (for the per-kind totals)
    cp_comm: float = 0.0  # the part of the K/V ring the attention cores do not hide
    cp_comm_total: float = 0.0  # the whole K/V ring, hidden or not (for the per-kind totals)
    offload: float = 0.0  # activation offload copies the compute does not hide (``cost_models.offload``)

    @property
    def total(self) -> float:
        return (self.forward + self.backward + self.recompute + self.tp_comm + self.pp_comm + self.ep_comm
                + self.cp_comm + self.offload)

    def parts(self) -> dict[str, float]:
        """The parts by name (what a pipeline timeline draws)."""
        parts = {"forward": self.forward, "backward": self.backward, "recompute": self.recompute,
                 "tp_comm": self.tp_comm, "pp_comm": self.pp_comm}
        if self.ep_comm or self.cp_comm:
            parts.update(ep_comm=self.ep_comm, cp_comm=self.cp_comm)
        if self.offload:
            parts["offload"] = self.offload
        return parts


def estimate(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION, profile: ImplementationProfile = TESSERA,
) -> Estimate:
    """Predict one optimizer step of ``strategy`` on ``cluster`` for a model described by ``layers``.

    ``calibration`` overrides the fitted compute-efficiency curve (calibration uses it); ``profile`` is the
    framework that runs the step (``cost_models.profiles``; Tessera's runtime by default).
    """
    facts, micro_batches, (stages, distinct, kinds), memory = _checked_stages_and_memory(
        layers, cluster, training, strategy, profile=profile)
    costs = _distinct_stage_costs(distinct, cluster, training, strategy, micro_batches=micro_batches,
                                  calibration=calibration, profile=profile)
    per_stage = [costs[kind] for kind in kinds]
    times = [cost[0] for cost in per_stage]
    dp = [cost[1] for cost in per_stage]
    slowest = max(range(len(stages)), key=lambda i: times[i].total)
    pipeline = pipeline_time_s(strategy, micro_batches=micro_batches, stage_times_s=[t.total for t in times],
                               solo_speedup=cluster.device.solo_speedup)
    bubble = pipeline - micro_batches * times[slowest].total  # < 0 where idle ranks' cores speed up the slowest
    exposed_dp = [cost[2] for cost in per_stage]
    contended = [cost[3] for cost in per_stage]
    waits = max(range(len(stages)), key=lambda i: exposed_dp[i] + contended[i])  # the stage the step waits for
    optimizer = max(optimizer_step_s(_optimizer_params(stage, strategy), cluster.device, master_bytes=profile.master_bytes,
                                     moment_bytes=profile.moment_bytes) for stage in distinct)
    straggling = straggler_s(pipeline, cluster, calibration=calibration)
    step = pipeline + exposed_dp[waits] + contended[waits] + optimizer + straggling
    worst = max(range(len(stages)), key=lambda i: sum(memory[i].values()))
    model_flops = facts.flops_per_sequence * training.global_batch
    hardware_flops = model_flops + sum(recomputed_flops(stage, profile) for stage in stages) * training.global_batch
    peak_rate = cluster.num_devices * mfu_peak_flops(cluster.device, training.precision)
    t = times[slowest]
    return Estimate(
        step_time_s=step,
        compute_time_s=micro_batches * (t.forward + t.backward),
        recompute_time_s=micro_batches * t.recompute,
        optimizer_time_s=optimizer,
        exposed_comm_time_s=micro_batches * (t.tp_comm + t.pp_comm + t.ep_comm + t.cp_comm) + exposed_dp[waits],
        bubble_time_s=bubble,
        straggler_time_s=straggling,
        contention_time_s=contended[waits],
        offload_time_s=micro_batches * t.offload,
        comm_time_by_kind_s=_comm_by_kind(t, dp[slowest], micro_batches),
        memory_by_category_bytes=memory[worst],
        peak_memory_bytes=sum(memory[worst].values()),
        stage_peak_memory_bytes=tuple(sum(m.values()) for m in memory),
        stage_memory_by_category_bytes=tuple(memory),
        stage_time_per_micro_batch_s=tuple(time.parts() for time in times),
        micro_batches=micro_batches,
        memory_budget_bytes=cluster.device.memory_bytes,
        num_devices=cluster.num_devices,
        tokens_per_s=training.tokens_per_step / step,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops,
        mfu=model_flops / (step * peak_rate),
        hfu=hardware_flops / (step * peak_rate),
        notes=estimate_notes(layers, cluster.device, training, strategy, profile, calibration, straggling=straggling,
                             head_widths=stages[slowest].attention_head_widths),
    )


def mfu_peak_flops(device: DeviceSpec, precision: str) -> float:
    """The peak FLOP/s MFU divides by: ``precision``'s, and under fp8 the larger of the FP8 and bf16 peaks (an FP8
    run also runs bf16 matmuls, so MFU is not well defined -- torchtitan's performance page declines to report it;
    the larger peak keeps it at most 100%: the FP8 peak on GPUs, the bf16 one on CPU ranks, whose FP8 is slower)."""
    if precision == "fp8":
        return max(device.peak_flops("fp8"), device.peak_flops("bf16"))
    return device.peak_flops(precision)


def peak_memory_bytes(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, profile: ImplementationProfile = TESSERA,
) -> int:
    """``estimate(...).peak_memory_bytes``, the same number, without the step time (a third of the work)."""
    memory = _checked_stages_and_memory(layers, cluster, training, strategy, profile=profile)[3]
    return max(sum(m.values()) for m in memory)


def _checked_stages_and_memory(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, profile: ImplementationProfile,
) -> tuple[ModelFacts, int, StageSplit, list[dict[str, int]]]:
    """What ``estimate`` starts from: the checks, then the model's facts, the micro-batches per step, the stages
    and each stage's memory."""
    facts = model_facts(layers)
    check_supported(layers, cluster, strategy, heads=facts.heads)
    if strategy.ep > 1 or strategy.cp > 1:
        check_sparse_and_long(layers, training, strategy)
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    split = stage_split(layers, strategy, facts=facts)
    memory = _stage_memories(split.stages, split.kinds, training, strategy, micro_batches=micro_batches,
                             on_cpu=cluster.device.name == LOCAL_CPU, profile=profile)
    return facts, micro_batches, split, memory


def straggler_s(busy_s: float, cluster: Cluster, *, calibration: Calibration) -> float:
    """Seconds a step waits for its slowest rank: each rank's ``busy_s`` varies by ``jitter`` (relative standard
    deviation) and every step synchronises all ``n`` ranks, so it lasts the expected maximum of ``n`` draws,
    about ``busy_s * jitter * sqrt(2 ln n)`` more than one rank's mean (the Gumbel limit of a normal maximum)."""
    jitter = device_calibration(cluster.device, calibration).jitter
    if jitter <= 0 or cluster.num_devices < 2:
        return 0.0
    return busy_s * jitter * math.sqrt(2 * math.log(cluster.num_devices))


def step_time_lower_bound(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION, whole: StageTotals | None = None,
    profile: ImplementationProfile = TESSERA,
) -> float:
    """Seconds that ``estimate(...).step_time_s`` never goes below (as ``profile`` runs it), at a small fraction of its
    cost. The expert all-to-alls are counted only where ``profile`` runs them per expert and in line (Tessera's runtime
    does): overlapped or sent once per node they cost less than the bound would count.

    Compute and the expert all-to-alls, spread perfectly over the stages, for the micro-batches plus the
    schedule's bubble (fewer slots on ranks sharing cores: ``pipeline_slots_lower_bound``). The pipeline's time
    is at least those slots times the mean of the ``pp`` stages' times, and each
    part of that mean is bounded from below: compute by ``compute_lower_bound_s``, the expert all-to-alls by
    ``_ep_comm_lower_bound_s``, the tensor-parallel all-reduces by ``_tp_comm_lower_bound_s`` (all summed over
    stages); then what the data-parallel traffic adds at least, exposed or contending (``dp_lower_bound_s``); the
    estimate adds the rest of the communication, the optimizer and stage imbalance, all non-negative. ``whole`` is
    the model summed as one stage under the strategy's recomputation (pass it in when bounding many strategies).
    """
    whole = whole or stage_totals(layers, 0, block_policies(layers, strategy))
    per_micro_batch = compute_lower_bound_s(whole, cluster.device, training, strategy, calibration=calibration,
                                            profile=profile)
    if profile.ep_dispatch == "per-expert" and not profile.ep_overlap:  # the bound prices each copy, in line
        per_micro_batch += _ep_comm_lower_bound_s(layers, cluster, strategy, whole) / strategy.pp
    per_micro_batch += _tp_comm_lower_bound_s(whole, cluster, strategy) / strategy.pp
    micro_batches = strategy.gradient_accumulation(training.global_batch)
    slots = pipeline_slots_lower_bound(strategy, micro_batches=micro_batches, solo_speedup=cluster.device.solo_speedup)
    return slots * per_micro_batch + dp_lower_bound_s(whole, cluster, training, strategy, calibration=calibration)


def dp_lower_bound_s(whole: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy, *,
                     calibration: Calibration = GPU_CALIBRATION) -> float:
    """Seconds the data-parallel traffic adds to a step at least, however much of it is hidden (with the same
    ``calibration`` as the estimates it bounds). The waiting stage's part is ``max(e, u + k (T - e))`` (``contention_s``:
    exposed ``e``, unhideable ``u >= 0``, traffic ``T`` and ``k`` the contention share over the framework's slowdown
    ``s >= 1``), never below ``k T / (1 + k)``, so never below ``share / (1 + share)`` of the traffic at the ring's
    speed, ``T / s``; and that traffic is at least the mean stage's lower bound
    (``communication.dp_traffic_lower_bound_s``)."""
    share = device_calibration(cluster.device, calibration).overlap_contention
    if not share:
        return 0.0
    traffic = dp_traffic_lower_bound_s(whole, cluster, training, strategy,
                                       micro_batches=strategy.gradient_accumulation(training.global_batch))
    return share / (1 + share) * traffic


def _ep_comm_lower_bound_s(
    layers: Sequence[LayerStats], cluster: Cluster, strategy: Strategy, whole: StageTotals
) -> float:
    """Expert all-to-all seconds of one micro-batch summed over the pipeline stages, never above what
    ``estimate`` charges them (``sparse.ep_comm_s``).

    Stage ``i`` with ``m_i`` MoE layers, dispatch payload ``D_i`` and fully recomputed payload ``R_i <= D_i`` is
    charged ``m_i * a2a(D_i / m_i * b / (cp tp)) * (4 + 2 R_i / D_i)``. The all-to-all time never falls as its
    bytes grow (latency plus bytes over bandwidth) and ``D_i / m_i`` is a mean of per-layer payloads, so it is at
    least ``d_min``, the smallest MoE layer's: the sum is at least ``4 M a2a(d_min b / (cp tp))`` for the model's
    ``M`` MoE layers, and ``6 M a2a(...)`` when every MoE layer is fully recomputed (``R = D`` in sum, hence in
    every stage). A factor ``1 - 1e-9`` keeps the bound below the estimate through rounding.
    """
    if strategy.ep == 1 or not whole.moe_layers:
        return 0.0
    d_min = model_facts(layers).smallest_dispatch_bytes
    one = all_to_all_time(cluster, d_min * strategy.micro_batch / (strategy.cp * strategy.tp),
                          group_size=strategy.ep, stride=ep_stride(strategy))
    passes = 6 if whole.dispatch_bytes and whole.recompute_dispatch_bytes >= whole.dispatch_bytes else 4
    return (1 - 1e-9) * passes * whole.moe_layers * one


def _tp_comm_lower_bound_s(whole: StageTotals, cluster: Cluster, strategy: Strategy) -> float:
    """Tensor-parallel all-reduce seconds of one micro-batch summed over the pipeline stages, never above what
    ``estimate`` charges them (``communication.tp_comm_s``).

    Stage ``i`` is charged ``passes_i * n_i * AR(B_i / n_i)`` with ``passes_i >= 2``, ``n_i`` all-reduces of
    ``B_i`` bytes in all. ``AR`` (``topology.collectives.all_reduce_time``) is a sum over link levels of minima
    of affine functions of the bytes with non-negative coefficients (latency plus bytes over bandwidth), so
    ``AR(x) >= S x`` with ``S`` its asymptotic slope, ``AR(X) / X`` for a huge ``X``: the sum is at least
    ``2 S sum_i B_i``, which is ``2 S`` times the whole model's bytes (``B`` adds up over stages). A factor
    ``1 - 1e-9`` covers rounding and the ``1e-30``-relative latency left in the slope.
    """
    if strategy.tp == 1 or whole.tp_allreduce_bytes <= 0:
        return 0.0
    huge = 1e30
    slope = all_reduce_time(cluster, huge, group_size=strategy.tp) / huge
    seconds = 2 * slope * whole.tp_allreduce_bytes * strategy.micro_batch / strategy.cp
    return (1 - 1e-9) * (seconds / strategy.tp if strategy.tp_overlap else seconds)


def _distinct_stage_costs(
    stages: Sequence[StageTotals], cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, micro_batches: int, calibration: Calibration, profile: ImplementationProfile,
) -> list[tuple[StageTime, dict[str, float], float, float]]:
    """Per distinct stage: its time, its data-parallel traffic, the part of that traffic left exposed after
    overlap, and the seconds per step its compute loses to the collectives it hides (``contention_s``)."""
    slowdown = sharded_comm_slowdown(cluster.device, strategy, profile=profile)
    # ranks sharing cores communicate with their compute's cores; some frameworks reduce after the backward (profiles)
    overlap = cluster.device.solo_speedup == 1.0 and (profile.dp_overlap or strategy.zero == 3)
    costs = []
    for stage in stages:
        t = stage_time(stage, cluster, training, strategy, calibration=calibration, profile=profile)
        comm = dp_comm_s(stage, cluster, training, strategy, micro_batches=micro_batches, sharded_slowdown=slowdown,
                         profile=profile)
        exposed = exposed_dp_comm_s(comm, strategy, forward_s=t.forward, backward_s=t.backward,
                                    micro_batches=micro_batches, blocks=stage.blocks, overlap=overlap,
                                    recompute_s=t.recompute)
        unhideable = exposed_dp_comm_s(comm, strategy, forward_s=math.inf, backward_s=math.inf,
                                       micro_batches=micro_batches, blocks=stage.blocks, overlap=overlap)
        hidden = (sum(comm.values()) - exposed) / slowdown if overlap else 0.0
        costs.append((t, comm, exposed, contention_s(exposed, unhideable, hidden, cluster.device,
                                                     calibration=calibration)))
    return costs


def contention_s(exposed_s: float, unhideable_s: float, hidden_s: float, device: DeviceSpec, *,
                 calibration: Calibration) -> float:
    """Seconds per step the compute loses beside the data-parallel collectives it hides, beyond the ``exposed_s``
    the step already waits for them. Each hidden second (``hidden_s``, at the ring's speed: a framework's slowdown
    on them, DeepSpeed's 2021 ZeRO-3, is time its kernels wait, not bandwidth they take) slows the compute beside it
    by ``Calibration.overlap_contention``; the slowed compute still runs inside the collectives' window, so the step's
    data-parallel part is ``max(exposed, unhideable + slowing)``, ``unhideable_s`` being what stays exposed however
    long the compute (each pass's first gather and last reduce-scatter): compute-bound, the whole slowing counts;
    bandwidth-bound, the exposed traffic absorbs it."""
    slowing = device_calibration(device, calibration).overlap_contention * max(hidden_s, 0.0)
    return max(0.0, unhideable_s + slowing - exposed_s)


def _stage_memories(
    stages: Sequence[StageTotals], kinds: Sequence[int], training: TrainingConfig, strategy: Strategy, *,
    micro_batches: int, on_cpu: bool, profile: ImplementationProfile,
) -> list[dict[str, int]]:
    """``stage_memory`` of every stage; ``kinds[i]`` numbers the distinct stages. A stage's memory depends on its
    index only through the micro-batches it holds in flight, so equal stages holding as many share one."""
    computed: dict[tuple[int, float], dict[str, int]] = {}
    memory = []
    for stage, kind in zip(stages, kinds):
        key = (kind, in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches))
        if key not in computed:
            computed[key] = stage_memory(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu,
                                         profile=profile)
        memory.append(dict(computed[key]))
    return memory


def stage_time(
    stage: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION, profile: ImplementationProfile = TESSERA,
) -> StageTime:
    """Seconds one micro-batch spends on ``stage`` (``profile``: whose implementation overlaps its TP traffic)."""
    stage = loss_as_run(stage, strategy, profile)  # a fused loss kernel makes fewer passes over the logits
    forward, backward, recompute = stage_compute_s(stage, cluster.device, training, strategy, calibration=calibration,
                                                   profile=profile)
    offload = exposed_offload_s(stage, cluster.device, strategy, forward_s=forward, backward_s=backward,
                                overlapped=profile.offload_copies_overlap)
    boundary = as_run(stage, training, strategy, profile)  # what it sends on: fp32 under autocast
    time = StageTime(forward, backward, recompute, tp_comm_s(stage, cluster, training, strategy, profile=profile),
                     pp_comm_s(boundary, cluster, strategy, profile=profile), offload=offload)
    if strategy.ep == 1 and strategy.cp == 1:
        return time
    rate = achievable_flops(cluster.device, bf16_or(training.precision), width=stage.hidden_size / strategy.tp,
                            calibration=calibration)
    attention = attention_core_rate(cluster.device, training, rate, calibration=calibration,  # what hides the ring
                                    kernels=profile.kernels_at(strategy.cp), seq_len=training.seq_len / strategy.cp,
                                    cp=strategy.cp, ring_slowed=profile.cp_ring_slowdown,
                                    head_widths=stage.attention_head_widths)
    cp_total, cp_exposed = cp_comm_s(stage, cluster, strategy, flops_per_s=attention, profile=profile)
    ep_total = ep_comm_s(stage, cluster, strategy, dispatch=profile.ep_dispatch, routing=profile.ep_routing)
    ep_exposed = ep_total if not profile.ep_overlap else exposed_ep_comm_s(  # beside another micro-batch's compute
        ep_total, forward, backward + recompute,
        contention=device_calibration(cluster.device, calibration).overlap_contention,
        unpartnered=unpartnered_share(strategy, strategy.gradient_accumulation(training.global_batch)))
    return replace(time, ep_comm=ep_exposed, ep_comm_total=ep_total, cp_comm=cp_exposed, cp_comm_total=cp_total)


def check_supported(
    layers: Sequence[LayerStats], cluster: Cluster, strategy: Strategy, *, heads: frozenset[int] | None = None,
) -> None:
    """Raise unless the strategy uses only what this cost model implements and fits the cluster and model
    (``heads``: the layers' attention head counts, when the caller has them)."""
    if strategy.world_size != cluster.num_devices:
        raise ConfigError(
            f"strategy {strategy.to_string()} uses {strategy.world_size} ranks but cluster {cluster.name} has "
            f"{cluster.num_devices} devices; make dp*tp*pp*cp = {cluster.num_devices} (ep is part of dp)"
        )
    heads = model_facts(layers).heads if heads is None else heads
    if any(h % strategy.tp for h in heads):
        raise ConfigError(f"tp={strategy.tp} does not divide the attention heads (query and key/value) "
                          f"{sorted(heads)}; pick a divisor")


class ModelFacts(NamedTuple):
    """What ``estimate`` needs of the whole model that no strategy changes."""

    heads: frozenset[int]
    """Query and key/value head counts of the layers that have attention (tp must divide each)."""
    flops_per_sequence: float
    """Forward + backward FLOPs of one sequence (no recomputation)."""
    smallest_dispatch_bytes: float | None
    """The smallest MoE layer's dispatch payload per sequence (``top_k * capacity * output``); None without experts."""
    splits: dict[tuple, StageSplit]
    """The model's stage splits met so far, by what they depend on (``stage_split``)."""


class StageSplit(NamedTuple):
    """A strategy's pipeline stages: their totals, the distinct ones (equal stages are priced once), and for each
    stage the position of its equal in ``distinct``."""

    stages: tuple[StageTotals, ...]
    distinct: tuple[StageTotals, ...]
    kinds: tuple[int, ...]


SPLITS_LIMIT = 4096


def stage_split(layers: Sequence[LayerStats], strategy: Strategy, *, facts: ModelFacts | None = None) -> StageSplit:
    """The stages ``strategy`` splits the model into, each summed under its blocks' policies and the pieces it
    recomputes by name: memoised per model by the fields they depend on (pipeline shape, recomputation, ZeRO-3
    resharding), which thousands of the search's candidates share."""
    facts = model_facts(layers) if facts is None else facts
    key = (strategy.pp, strategy.virtual_stages, strategy.chunk_blocks, strategy.recompute, strategy.block_recompute,
           strategy.zero == 3, strategy.block_reshard, strategy.recompute_modules)
    split = facts.splits.get(key)
    if split is None:
        layers = with_recomputed_modules(layers, strategy.recompute_modules)
        policies, kept = block_policies(layers, strategy), kept_blocks(layers, strategy)
        stages = [cached_stage_totals(s, i, policies, kept=kept) for i, s in enumerate(split_blocks(layers, strategy))]
        distinct: dict[StageTotals, int] = {}  # a StageTotals hashes its ~45 fields: done once per split
        kinds = tuple(distinct.setdefault(stage, len(distinct)) for stage in stages)
        if len(facts.splits) >= SPLITS_LIMIT:
            facts.splits.clear()
        split = facts.splits[key] = StageSplit(tuple(stages), tuple(distinct), kinds)
    return split


_FACTS: dict[tuple[int, ...], tuple[tuple[LayerStats, ...], ModelFacts]] = {}
_FACTS_LIMIT = 64


def model_facts(layers: Sequence[LayerStats]) -> ModelFacts:
    """The model's :class:`ModelFacts`, memoised by the identity of its layer objects: a search estimates
    thousands of strategies of one model, and summing its (possibly hundreds of) layers each time showed."""
    key = tuple(map(id, layers))
    hit = _FACTS.get(key)
    if hit is not None:  # the entry holds the layers, so their ids cannot have been reused
        return hit[1]
    dispatch = [layer.top_k * layer.expert_capacity_factor * layer.output_bytes for layer in layers if layer.experts]
    facts = ModelFacts(
        heads=frozenset(h for layer in layers for h in (layer.attention_heads, layer.kv_heads) if h),
        flops_per_sequence=sum(layer.forward_flops + layer.backward_flops for layer in layers),
        smallest_dispatch_bytes=min(dispatch) if dispatch else None,
        splits={},
    )
    if len(_FACTS) >= _FACTS_LIMIT:
        _FACTS.clear()
    _FACTS[key] = (tuple(layers), facts)
    return facts


def _optimizer_params(stage: StageTotals, strategy: Strategy) -> float:
    if strategy.ep == 1 and strategy.cp == 1:
        return local_params(stage, strategy) / (strategy.dp if strategy.zero >= 1 else 1)
    return sharded_params(stage, strategy, from_zero=1)  # dense over dp * cp, experts over edp * cp


def _comm_by_kind(t: StageTime, dp: dict[str, float], micro_batches: int) -> dict[str, float]:
    kinds = {"tp_allreduce": micro_batches * t.tp_comm, "pp_p2p": micro_batches * t.pp_comm,
             "ep_alltoall": micro_batches * t.ep_comm_total, "cp_ring": micro_batches * t.cp_comm_total, **dp}
    return {kind: seconds for kind, seconds in kinds.items() if seconds > 0}
