"""Communication per step and how much of it compute hides.

Mesh axes are laid out innermost first, tp -> cp -> pp -> dp (Megatron-LM's and Llama 3's order), so a
tensor-parallel group is ``tp`` adjacent ranks (inside a node), pipeline neighbours are ``tp*cp`` ranks
apart and data-parallel peers ``tp*cp*pp`` apart (with expert parallelism, ``tp -> cp -> ep -> pp -> edp``:
see ``Strategy``). Collective times come from ``topology.collectives``.

- Tensor parallelism: one activation all-reduce per column/row pair forward and one backward (Megatron-LM;
  sequence parallelism turns each into an all-gather plus a reduce-scatter of the same total), one more
  forward under full recomputation; on the critical path.
- Data parallelism per ZeRO stage, over the stage's local parameters: 0 all-reduces fp32 gradients (the profile's
  ``gradient_bytes``) once
  per step; 1 reduce-scatters them and all-gathers updated parameters; 2 reduce-scatters after every
  micro-batch; 3 (FSDP) gathers parameters before forward and backward of every micro-batch and
  reduce-scatters gradients after it. Gradient reduction overlaps backward except its last bucket
  (~1/blocks); FSDP gathers are prefetched behind the previous block's compute. Ranks that share CPU cores
  (``DeviceSpec.solo_speedup > 1``) overlap nothing: gloo moves the bytes on the cores the compute is using; nor
  does a framework that reduces after the backward (``ImplementationProfile.dp_overlap``: Megatron-LM of 2021-2022).
  ZeRO collectives are scaled by FSDP2's measured slowdown where profiled, and ZeRO-3's by the framework's
  (``sharded_comm_slowdown``, ``cost_models.profiles``: DeepSpeed's 2021 ZeRO-3, not PyTorch FSDP).
  Each gather and each reduce-scatter is one collective per FSDP unit, not one of the stage's whole parameters:
  FSDP2 all-gathers and reduce-scatters every ``fully_shard`` group on its own (``sharded_units``), so a stage of
  ``b`` blocks pays the collectives' latency ``b + 1`` times per pass (measured on 4 gloo ranks: ZeRO-3's
  per-micro-batch gathers of 5 units cost ~0.3 s a step more than ZeRO-2's one gather, where one collective of the
  stage's bytes priced 0.09 s; benchmarks/results/per-layer-truth-*).
- Tensor parallelism on a device with a measured per-linear overhead at that degree: the collectives' fixed
  costs are in that overhead (``compute.framework_overhead_s``); here only what their bytes add.
- Pipeline: one activation send forward and one gradient send backward per micro-batch and chunk (Megatron-LM of
  2021-2022 without sequence parallelism: ``1/tp`` of it per rank, all-gathered on arrival; ``pp_scatter_gather``).
- Expert and context parallelism (``cost_models.sparse``): gradients of dense weights are reduced over the
  ``dp * cp`` ranks holding them, of routed experts over ``(dp / ep) * cp``; the all-to-alls and the K/V
  ring are costed there.
"""

from __future__ import annotations

from tessera.cost_models.memory_state import compute_dtype_bytes, kept_local_params, local_params, root_params
from tessera.cost_models.partition import StageTotals
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.cost_models.stage_views import op_level_selective
from tessera.cost_models.sparse import (
    gradient_families, group_all_gather_s, group_all_reduce_s, group_reduce_scatter_s,
)
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology.cluster import Cluster, DeviceSpec
from tessera.topology.collectives import all_gather_time, all_reduce_time, p2p_time, reduce_scatter_time


def tp_comm_s(
    stage: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy,
    *, profile: ImplementationProfile = TESSERA,
) -> float:
    """Tensor-parallel all-reduce seconds of one micro-batch on ``stage`` (forward, backward, recompute); under
    ``tp_overlap``, the backward's are hidden too only where the framework overlaps them
    (``ImplementationProfile.tp_overlap_backward``)."""
    if strategy.tp == 1:
        return 0.0
    rerun = _selective_rerun_share(stage, strategy, profile)
    forward_passes = 1 + stage.full_recompute_blocks / max(stage.blocks, 1) + rerun  # the forward and its recomputation
    count = max(stage.tp_allreduce_count, 1)
    nbytes = stage.tp_allreduce_bytes * strategy.micro_batch / strategy.cp / count
    # A profiled per-linear overhead at this degree already holds the collectives' fixed costs (measured on a
    # block too small to move bytes, ``compute.framework_overhead_s``): only what the bytes add is left here.
    measured = strategy.tp in cluster.device.linear_overhead_s
    fixed = _latency_s(cluster, group_size=strategy.tp) if measured else 0.0
    per_pass = count * (all_reduce_time(cluster, nbytes, group_size=strategy.tp) - fixed)
    if not strategy.tp_overlap:
        return (forward_passes + 1) * per_pass
    # Overlapped: each collective is split into tp ring steps, each hidden behind the partial matmul of
    # the previous one; only one step in tp stays on the critical path (Wang et al., ASPLOS'23).
    backward = per_pass / strategy.tp if profile.tp_overlap_backward else per_pass
    return forward_passes * per_pass / strategy.tp + backward


def _selective_rerun_share(stage: StageTotals, strategy: Strategy, profile: ImplementationProfile) -> float:
    """The share of a forward pass's tensor-parallel collectives that op-level selective recomputation runs again
    (``profiles.selective_policy`` ``op``: torchtitan's save list keeps ``reduce_scatter_tensor`` outputs and no other
    collective's, and a compiled region's collectives marked for recomputation are recomputed,
    ``torch/_functorch/partitioners.py`` ``force_save_collectives``): under sequence parallelism the all-gather half of
    each pair, which the backward needs for the weight gradients; without it the all-reduces, whose sums the
    recomputed norms read. Tessera's runtime keeps every collective's output (the ``matmuls`` policy)."""
    if not op_level_selective(stage, profile.selective_policy):
        return 0.0
    half = strategy.sp and not strategy.sp_regather
    return (0.5 if half else 1.0) * stage.op_selective_blocks / max(stage.blocks, 1)


def _latency_s(cluster: Cluster, *, group_size: int) -> float:
    """An all-reduce's time at zero bytes: its time at 1 byte less the slope from 1 to 2 bytes (the time is
    latency plus an affine cost per byte; at 0 bytes ``all_reduce_time`` returns 0, nothing to send)."""
    one, two = (all_reduce_time(cluster, float(n), group_size=group_size) for n in (1, 2))
    return 2 * one - two


def pp_comm_s(stage: StageTotals, cluster: Cluster, strategy: Strategy, *,
              profile: ImplementationProfile = TESSERA) -> float:
    """Point-to-point seconds per micro-batch: activations forward, gradients backward, per chunk; under the
    profile's ``pp_scatter_gather`` (tensor parallelism without sequence parallelism) each rank sends its ``1/tp``
    share and the receiver all-gathers the whole over its tensor-parallel group."""
    if strategy.pp == 1:
        return 0.0
    nbytes = stage.boundary_bytes * strategy.micro_batch / strategy.cp / (strategy.tp if strategy.sp else 1)
    scattered = profile.pp_scatter_gather and strategy.tp > 1 and not strategy.sp
    sent = nbytes / strategy.tp if scattered else nbytes
    gather = all_gather_time(cluster, nbytes, group_size=strategy.tp) if scattered else 0.0
    # Pipeline neighbours are tp*cp*ep ranks apart (Strategy's layout: ep sits inside pp; folded experts: no ep axis).
    send = p2p_time(cluster, sent, distance=strategy.tp * strategy.cp * strategy.layout_ep)
    return 2 * strategy.virtual_stages * (send + gather)


def sharded_comm_slowdown(device: DeviceSpec, strategy: Strategy, *, profile: ImplementationProfile = TESSERA) -> float:
    """Factor on the ZeRO collectives of ``strategy``: FSDP2's measured one on a profiled device (Tessera's
    runtime runs ZeRO-1 to 3 on FSDP2), else the framework's for ZeRO-3 (``profiles``) and none for 1 and 2."""
    if strategy.zero == 0:
        return 1.0
    if device.fsdp_comm_slowdown is not None and profile.name == TESSERA.name:  # by name: a variant of it too
        return device.fsdp_comm_slowdown
    return profile.zero3_comm_slowdown if strategy.zero == 3 else 1.0


def gathered_weight_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, params: float,
    *, profile: ImplementationProfile = TESSERA,
) -> float:
    """Bytes an all-gather of ``params`` local parameters of ``stage`` moves: the compute dtype, or 1 byte for
    the blocks' parameters where the framework all-gathers FP8 weights (``gathers_fp8_weights``; the root's stay
    bf16)."""
    width = compute_dtype_bytes(training)
    if not profile.gathers_fp8_weights(training, strategy):
        return params * width
    local = local_params(stage, strategy)
    blocks_share = (local - root_params(stage, strategy)) / local if local else 0.0
    return params * (blocks_share * 1 + (1 - blocks_share) * width)


def dp_comm_s(
    stage: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy, *, micro_batches: int,
    sharded_slowdown: float = 1.0, profile: ImplementationProfile = TESSERA,
) -> dict[str, float]:
    """Data-parallel collective seconds per step by kind, before overlap (ZeRO's scaled by ``sharded_slowdown``,
    see ``sharded_comm_slowdown``)."""
    if strategy.cp > 1 or strategy.ep > 1:
        return _grouped_dp_comm_s(stage, cluster, training, strategy, micro_batches=micro_batches,
                                  sharded_slowdown=sharded_slowdown, profile=profile)
    if strategy.dp == 1:
        return {}
    params = local_params(stage, strategy)
    group = {"group_size": strategy.dp, "stride": strategy.tp * strategy.cp * strategy.pp}
    grads = params * profile.gradient_bytes
    weights = gathered_weight_bytes(stage, training, strategy, params, profile=profile)
    s = sharded_slowdown
    if strategy.zero == 0:
        return {"dp_allreduce": all_reduce_time(cluster, grads, **group)}
    gathers, scatters = sharded_collective_counts(strategy, micro_batches=micro_batches)
    gathers = effective_gathers(stage, strategy, gathers=gathers, micro_batches=micro_batches)
    kinds = ("zero_allgather", "zero_reducescatter") if strategy.zero < 3 else ("fsdp_allgather", "fsdp_reducescatter")
    units = sharded_units(stage)
    comm = {kinds[1]: s * scatters * units * reduce_scatter_time(cluster, grads / units, **group),
            kinds[0]: s * gathers * units * all_gather_time(cluster, weights / units, **group)}
    return split_unprefetched_gathers(comm, strategy, profile=profile, micro_batches=micro_batches)


def dp_traffic_lower_bound_s(whole: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy, *,
                             micro_batches: int) -> float:
    """Data-parallel collective seconds per step of the mean pipeline stage at least (``whole``: the model as one
    stage), before any framework's slowdown, whatever a profile or the per-block choices make of it: the fewest
    collectives a step runs (ZeRO-3 blocks that keep their gathered weights skip the backward's gathers) and the
    fewest bytes (bf16 gradients, FP8 weight gathers under fp8), at each collective's per-byte rate alone. A
    collective's time is concave in its bytes and zero at none (``topology.collectives``: a minimum of affine pieces
    per level), so never below that rate times its bytes, and the stages' bytes sum to the model's. Without context
    or expert parallelism (0 there: their gradient groups are not bounded here)."""
    if strategy.dp == 1 or strategy.cp > 1 or strategy.ep > 1:
        return 0.0
    group = {"group_size": strategy.dp, "stride": strategy.tp * strategy.cp * strategy.pp}
    params = local_params(whole, strategy)
    grads = 2 * params
    if strategy.zero == 0:
        return _per_byte_s(all_reduce_time, cluster, group) * grads / strategy.pp
    weights = params * (1 if training.precision == "fp8" else compute_dtype_bytes(training))
    gathers, scatters = sharded_collective_counts(strategy, micro_batches=micro_batches)
    if strategy.zero == 3:  # blocks keeping their gathered weights gather once per step (pp) or micro-batch
        gathers = min(gathers, 1 if strategy.pp > 1 else micro_batches)
    return (scatters * _per_byte_s(reduce_scatter_time, cluster, group) * grads
            + gathers * _per_byte_s(all_gather_time, cluster, group) * weights) / strategy.pp


def _per_byte_s(collective, cluster: Cluster, group: dict[str, int]) -> float:
    """The collective's asymptotic seconds per byte over ``group``: the slope of its time far beyond every piece's
    crossover (where it is affine), shaded by 1e-9 for rounding."""
    big = float(2**50)
    return (collective(cluster, 2 * big, **group) - collective(cluster, big, **group)) / big * (1 - 1e-9)


def sharded_units(stage: StageTotals, *, experts: bool = False) -> int:
    """FSDP units of ``stage`` that each all-gather and reduce-scatter in collectives of their own: every block and
    the root (embeddings, final norm, head) where the stage holds any of it (``runtime.data_parallel.apply_fsdp``:
    ``fully_shard`` per block, then on the root); with ``experts``, the routed experts' units, one per MoE layer
    (``runtime.expert_parallel.expert_units``; a layer's local experts wrapped one by one are more, not counted).

    The stage's parameters are priced as this many equal collectives: with a collective's time affine in its bytes
    (latency plus bytes over bandwidth), ``units * t(bytes / units)`` is the sum of the units' own times.
    """
    if experts:
        return max(stage.moe_layers, 1)
    root = 1 if stage.root_sharded_params or stage.root_replicated_params else 0
    return max(stage.blocks + root, 1)


UNPREFETCHED = "fsdp_allgather_backward"
"""The kind of ZeRO-3's backward all-gathers a ``backward_prefetch="post"`` framework leaves exposed."""


def split_unprefetched_gathers(
    comm: dict[str, float], strategy: Strategy, *, profile: ImplementationProfile, micro_batches: int,
) -> dict[str, float]:
    """``comm`` with the backward's share of ZeRO-3's all-gathers as its own kind ``UNPREFETCHED`` where the
    framework issues them only after the later block's gradients (``profiles``: ``BACKWARD_POST``): of the
    ``2 * micro_batches`` gathers per step without pipelining, one per micro-batch is a backward's."""
    gather = comm.get("fsdp_allgather", 0.0)
    if profile.backward_prefetch != "post" or strategy.zero != 3 or strategy.pp > 1 or not gather:
        return comm
    gathers, _ = sharded_collective_counts(strategy, micro_batches=micro_batches)
    backward = gather * min(micro_batches / gathers, 1.0)
    return {**comm, "fsdp_allgather": gather - backward, UNPREFETCHED: backward}


def sharded_collective_counts(strategy: Strategy, *, micro_batches: int) -> tuple[int, int]:
    """(parameter all-gathers, gradient reduce-scatters) per step of ZeRO-1/2/3 as the runtime runs them.

    ZeRO-1/2 gather once per step; ZeRO-1 reduce-scatters once, ZeRO-2 after every micro-batch; ZeRO-3 gathers
    each block for its forward and again for its backward and reduce-scatters every micro-batch. Under
    pipelining, ``PipelineStage`` turns FSDP2's gradient sync and resharding after backward off for all but
    the last micro-batch: one reduce-scatter per step, and ZeRO-3's parameters stay gathered from a backward
    to the next forward, so with 1F1B's order (forwards, then alternating, then backwards) the warm-up
    forwards and every backward but the cool-down's gather: ``micro_batches + 1`` gathers per step. A step run as
    ``pipeline_passes`` schedule calls syncs and reshards at the end of each: that many reduce-scatters, and as
    many extra gathers.
    """
    if strategy.pp > 1:
        passes = strategy.pipeline_passes
        return (micro_batches + passes if strategy.zero == 3 else passes), passes
    if strategy.zero == 3:
        return 2 * micro_batches, micro_batches
    return 1, (micro_batches if strategy.zero == 2 else 1)


def effective_gathers(stage: StageTotals, strategy: Strategy, *, gathers: int, micro_batches: int) -> float:
    """ZeRO-3 all-gathers per step of the stage's weights, where some blocks keep their gathered weights from
    forward to backward (``Strategy.block_reshard``): those skip the backward's re-gather, so their share of
    the weights is gathered once per micro-batch (without pipelining) or once per step (``PipelineStage``
    already keeps them gathered between a backward and the next forward, until the schedule call's last backward
    reshards them: once per ``pipeline_passes``)."""
    kept = kept_local_params(stage, strategy) if strategy.zero == 3 else 0.0
    if not kept:
        return gathers
    share = min(1.0, kept / local_params(stage, strategy))
    kept_gathers = strategy.pipeline_passes if strategy.pp > 1 else micro_batches
    return gathers - (gathers - kept_gathers) * share


def _grouped_dp_comm_s(
    stage: StageTotals, cluster: Cluster, training: TrainingConfig, strategy: Strategy, *, micro_batches: int,
    sharded_slowdown: float, profile: ImplementationProfile,
) -> dict[str, float]:
    """``dp_comm_s`` with context or expert parallelism: dense gradients over the dp * cp ranks, expert ones over
    edp * cp, each group reduced hierarchically over its two mesh axes (``cost_models.sparse``)."""
    totals: dict[str, float] = {}
    for index, (params, axes) in enumerate(gradient_families(stage, strategy)):
        if not axes:
            continue
        grads, s = params * profile.gradient_bytes, sharded_slowdown
        units = sharded_units(stage, experts=index == 1)  # gradient_families: dense first, then routed experts
        weights = gathered_weight_bytes(stage, training, strategy, params, profile=profile)
        if strategy.zero == 0:
            kinds = {"dp_allreduce": group_all_reduce_s(cluster, grads, axes)}
        else:
            gathers, scatters = sharded_collective_counts(strategy, micro_batches=micro_batches)
            gathers = effective_gathers(stage, strategy, gathers=gathers, micro_batches=micro_batches)
            prefix = "zero" if strategy.zero < 3 else "fsdp"
            kinds = {f"{prefix}_reducescatter": s * scatters * units * group_reduce_scatter_s(cluster, grads / units, axes),
                     f"{prefix}_allgather": s * gathers * units * group_all_gather_s(cluster, weights / units, axes)}
        for kind, seconds in kinds.items():
            totals[kind] = totals.get(kind, 0.0) + seconds
    return split_unprefetched_gathers(totals, strategy, profile=profile, micro_batches=micro_batches)


def exposed_dp_comm_s(
    comm: dict[str, float], strategy: Strategy, *, forward_s: float, backward_s: float, micro_batches: int, blocks: int,
    overlap: bool = True, recompute_s: float = 0.0,
) -> float:
    """Data-parallel communication left on the critical path after overlap with compute (all of it without
    ``overlap``: ranks that share CPU cores move the bytes with the cores their compute is using, and a framework
    that reduces after the backward, ``ImplementationProfile.dp_overlap``, runs them between steps).

    ZeRO-3 (FSDP): each block's all-gather is issued while the block before it computes (prefetch) and each
    block's reduce-scatter runs while the block after it computes its backward, on their own streams, so the
    collectives hide behind the micro-batches' compute, recomputation included; what stays exposed is what the
    compute cannot cover (a bandwidth-bound step) or, at least, each pass's first gather and last
    reduce-scatter (one block's, ``1 / blocks`` of the traffic: nothing computes before or after them).
    Tensor-parallel and pipeline communication do not hide it (they are on the critical path themselves).
    A framework that issues the backward's gathers late (``UNPREFETCHED``) leaves them all exposed.
    ZeRO-0 to 2: gradient reduction overlaps the backward (the last micro-batch's, or every one's under
    ZeRO-2) except its last bucket; the parameter all-gather of ZeRO-1/2 overlaps the next step's first forward.
    """
    if not overlap:
        return sum(comm.values())
    tail = 1 / max(blocks, 1)
    if strategy.zero == 3:
        unprefetched = comm.get(UNPREFETCHED, 0.0)  # each block's backward waits for its own gather
        total = sum(comm.values()) - unprefetched
        return unprefetched + max(total - micro_batches * (forward_s + backward_s + recompute_s), total * tail)
    reduce = comm.get("dp_allreduce", 0.0) + comm.get("zero_reducescatter", 0.0)
    hidden_by = backward_s * (micro_batches if strategy.zero == 2 else 1)
    gather = comm.get("zero_allgather", 0.0)  # overlaps the next step's first forward
    return max(reduce - hidden_by, reduce * tail) + max(gather - forward_s, gather * tail)
