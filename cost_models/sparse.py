r"""Expert parallelism (sparse models) and context parallelism (long sequences): their traffic and state.

The mesh convention is ``Strategy``'s: ``world = dp * tp * pp * cp``; ``ep`` is carved out of ``dp``
(``dp = edp * ep``), laid out innermost first ``tp -> cp -> ep -> pp -> edp``. So an expert-parallel group is
``ep`` ranks ``tp * cp`` apart, a context-parallel ring ``cp`` ranks ``tp`` apart, and ranks that hold the same
weights are ``dp * cp`` (dense: the cp and ep axes, contiguous, then edp) or ``edp * cp`` (experts). Notation below: ``b`` micro-batch sequences,
``s`` tokens per sequence, ``h`` hidden size, ``k`` experts per token, ``f`` the load (capacity) factor the
experts were measured at, ``B`` bytes per element of the activations.

**Expert parallelism** (GShard, Lepikhin et al. 2020, arXiv:2006.16668, Sec. 2.2; Megatron-Core's all-to-all
token dispatcher). Each MoE layer sends every local token's hidden state to its ``k`` experts and brings the
outputs back: a *dispatch* and a *combine* all-to-all in the forward, and the same two (transposed) in the
backward; a fully recomputed layer runs its forward pair again. Per device and layer, one all-to-all carries

    N_ep = b * (s / cp) * k * f * h * B / tp

(the tokens of this rank's sequence shard; with tensor parallelism each tp rank dispatches ``1/tp`` of them,
as Megatron-Core does under sequence parallelism, and the others arrive by the tp all-gather the block's
tensor parallelism already pays). Routing is assumed uniform, so ``N_ep / ep`` goes to each peer:
``topology.collectives.all_to_all_time`` places the group (``ep`` ranks ``tp * cp`` apart) on the hierarchy: an ep
group of 8 with tp = cp = 1 stays on NVLink; with tp = 2 it spans two nodes and most of its traffic crosses the
network. The all-to-alls are on the critical path where the framework runs them in line (Megatron-Core's default,
Tessera's runtime); a framework that runs them beside another micro-batch's compute (Megatron-Core's
``overlap_moe_expert_parallel_comm``; DeepSeek-V3's DualPipe, arXiv:2412.19437 Sec. 3.2.1) leaves exposed only what
that compute does not cover (``ImplementationProfile.ep_overlap``, :func:`exposed_ep_comm_s`). A dispatcher that
sends a token once per other node holding one of its experts and fans it out over NVLink there (DeepEP; Megatron-Core's
``flex`` dispatcher) sends fewer bytes between nodes (``ep_dispatch``, :func:`per_node_share`). Expert compute per
device does not change with ``ep``: each rank's ``E/ep`` experts receive ``k f b s / ep`` slots from each of ``ep`` peers, i.e. the same
``k f b s`` slots the rank would process without expert parallelism (at the balanced load the capture measured).

**Expert tensor parallelism and folding** (``Strategy.etp``; Megatron-Core's ``expert_tensor_parallel_size`` and
"MoE parallel folding", Liu et al. 2025, arXiv:2504.14960). Each expert is split over ``etp`` ranks (``tp`` by
default), so a device holds ``E / ep`` experts at ``1 / etp`` of their width: expert weights and their state
divide by ``etp * ep``, the ``edp = dp * tp / (etp * ep)`` ranks holding the same expert shard reduce its
gradients. With ``etp < tp`` the rest of the tensor-parallel axis joins expert parallelism: the folded ep group is
``ep`` ranks ``etp`` apart (inside the tensor-parallel group first, so an ep group of ``tp / etp`` stays on
NVLink), each device still dispatches its ``1/tp`` share of the tokens, and expert compute per device is unchanged
(``N k / tp`` rows at full width over ``etp = 1`` instead of ``N k`` rows at ``1/tp`` of it). The runtime runs
``etp = tp`` and the folded ``etp = 1`` (``runtime.mesh.expert_grid``; what it refuses: ``cost_models.folding``);
``1 < etp < tp`` is priced for evaluating published configurations. Folded without sp, each MoE layer also
all-reduces its combined output over tp (forward) and its input gradient (backward): ``_folded_combine_s``.

**Context parallelism** (ring attention, Liu et al. 2023, arXiv:2310.01889; Megatron-LM / Transformer Engine's
``cp`` with zig-zag chunks; Llama 3, arXiv:2407.21783 Sec. 3.3.2). A rank holds ``s / cp`` tokens (chunks ``i``
and ``2cp-1-i`` of ``2cp``, which balances causal attention: every rank computes the same number of unmasked
score blocks, so compute divides evenly by ``cp`` as ``compute.py`` assumes). Per attention layer the forward
passes the local keys and values around the ring, ``cp - 1`` steps of

    N_kv = b * (s / cp) * 2 * kv_heads * head_dim * B / min(tp, kv_heads)

bytes to the next rank (tensor parallelism splits the kv heads; beyond ``kv_heads`` ranks they are
replicated); the backward passes K/V again with their gradients (``2 N_kv`` per step); a recomputed
attention core (selective or full) repeats the forward ring. Each step overlaps the attention of the chunk
pair already received: ``core_flops * b / (cp^2 * tp)`` FLOPs forward and 2.5x that backward (the flash
backward, ``planner.kernels``); only ``max(0, t_step - t_attention_step)`` is exposed. Activations are divided
by ``cp`` (``memory.activation_bytes``); the backward holds the K/V blocks sent and received, their fp32 gradient
accumulators sent and received, and an fp32 query-gradient accumulator (``ring_and_dispatch_buffer_bytes``). That is the ring of Tessera's runtime and Transformer Engine; PyTorch's ring
attention as torchtitan runs it all-gathers each layer's K/V instead, hidden by one block's attention only, and
carries them repeated to every query head (``ImplementationProfile.cp_rotation``, ``cp_kv_repeated``;
``_all_gathered_kv_s``).

**Gradients and ZeRO.** Dense gradients are reduced over the ``dp * cp`` ranks holding the same weights, expert
gradients over the ``edp * cp`` ranks holding the same experts (Megatron-Core's expert data-parallel group);
ZeRO shards each kind of state over its own group. A group spanning two mesh axes is reduced hierarchically,
inner axis first (``group_*_time``): reduce-scatter ``N`` over the inner axis then the ``N / n_inner`` shard
over the outer; all-reduce = inner reduce-scatter + outer all-reduce of the shard + inner all-gather.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.partition import StageTotals
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.errors import ConfigError
from tessera.topology.cluster import Cluster
from tessera.topology.collectives import (
    all_gather_time, all_reduce_time, all_to_all_time, p2p_time, reduce_scatter_time,
)

Axes = tuple[tuple[int, int], ...]
"""A group spanning mesh axes: ``(size, stride)`` per axis, innermost first; size-1 axes left out."""

FLASH_BACKWARD_RATIO = 2.5  # flash-attention backward FLOPs / forward (planner.kernels: recomputed scores)
FP32_RATIO = 2  # an fp32 accumulator over the bf16 activations it accumulates (on the safe side for fp32 runs)
DISPATCH_BUFFERS = 2  # an all-to-all's send and receive buffers, one layer at a time


# ----------------------------------------------------------------------------------------------- state


def local_param_split(stage: StageTotals, strategy: Strategy) -> tuple[float, float]:
    """``(dense, expert)`` parameters of ``stage`` on one device: tp divides the sharded ones, ep the experts."""
    return _families(stage, strategy).split


def expert_shards(strategy: Strategy) -> int:
    """Devices one layer's routed experts are split over: ``ep`` whole-expert groups, each expert over ``etp``."""
    return strategy.expert_tp * strategy.ep


def dense_group(strategy: Strategy) -> Axes:
    """Ranks holding the same dense weights: cp and ep, contiguous (cp * ep ranks tp apart), then edp
    (stride tp*cp*ep*pp). Without ep, or with folded experts (``Strategy.layout_ep`` 1): the cp ring and the dp
    axis (stride tp*cp*pp)."""
    ep = strategy.layout_ep
    outer_stride = strategy.tp * strategy.cp * ep * strategy.pp
    return _axes((strategy.cp * ep, strategy.tp), (strategy.dp // ep, outer_stride))


def expert_group(strategy: Strategy) -> Axes:
    """Ranks holding the same expert shard: the cp ring (stride tp) and the edp axis (stride etp*cp*ep*pp: with
    folding, ``tp / etp`` of the ep ranks lie inside the tensor-parallel group)."""
    stride = strategy.expert_tp * strategy.cp * strategy.ep * strategy.pp
    return _axes((strategy.cp, strategy.tp), (strategy.expert_dp, stride))


def gradient_families(stage: StageTotals, strategy: Strategy) -> tuple[tuple[float, Axes], ...]:
    """``(local parameters, group)`` per kind of weight whose gradients are reduced together (and whose ZeRO
    state is sharded together): dense, then routed experts. Families with no parameters are left out."""
    return _families(stage, strategy).families


def group_size(axes: Axes) -> int:
    """Ranks in a group."""
    size = 1
    for n, _ in axes:
        size *= n
    return size


def sharded_params(stage: StageTotals, strategy: Strategy, *, from_zero: int) -> float:
    """Local parameters' worth of one kind of state per device: divided by each family's group when the
    ZeRO stage is at least ``from_zero`` (1: optimizer moments, 2: gradients, 3: parameters)."""
    return _families(stage, strategy).sharded[from_zero]


class _Families(NamedTuple):
    families: tuple[tuple[float, Axes], ...]
    split: tuple[float, float]  # local_param_split
    sharded: tuple[float, float, float, float]  # sharded_params by from_zero (0 to 3)


_FAMILIES: dict[tuple, _Families] = {}
_FAMILIES_LIMIT = 65536
_LAST_FAMILIES: tuple = (None, None, None)


def _families(stage: StageTotals, strategy: Strategy) -> _Families:
    """The gradient families of ``stage`` under ``strategy`` and what follows from them, memoised by the numbers they
    depend on (a search prices the same stages under thousands of strategies that share their degrees), and the
    last answer by identity (a memory estimate asks about ten times in a row)."""
    global _LAST_FAMILIES
    last = _LAST_FAMILIES
    if last[0] is stage and last[1] is strategy:
        return last[2]
    key = (stage.sharded_params, stage.expert_params, stage.replicated_params,
           strategy.tp, strategy.etp, strategy.cp, strategy.ep, strategy.pp, strategy.dp, strategy.zero)
    hit = _FAMILIES.get(key)
    if hit is None:
        dense = (stage.sharded_params - stage.expert_params) / strategy.tp + stage.replicated_params
        expert = stage.expert_params / expert_shards(strategy)
        families = ((dense, dense_group(strategy)),) + (((expert, expert_group(strategy)),) if expert else ())
        sizes = [group_size(axes) for _, axes in families]
        sharded = tuple(_sharded(families, sizes, divided=strategy.zero >= from_zero) for from_zero in range(4))
        hit = _Families(families, (dense, expert), sharded)
        if len(_FAMILIES) >= _FAMILIES_LIMIT:
            _FAMILIES.clear()
        _FAMILIES[key] = hit
    _LAST_FAMILIES = (stage, strategy, hit)
    return hit


def _sharded(families: tuple[tuple[float, Axes], ...], sizes: list[int], *, divided: bool) -> float:
    total = 0
    for (params, _), size in zip(families, sizes):
        total += params / (size if divided else 1)
    return total


def largest_gathered_params(stage: StageTotals, strategy: Strategy) -> float:
    """Parameters of the stage's largest layer as FSDP gathers them on one device (experts stay ep-sharded)."""
    dense = stage.largest_layer_params - stage.largest_layer_expert_params
    return dense / strategy.tp + stage.largest_layer_expert_params / expert_shards(strategy)


def ring_and_dispatch_buffer_bytes(stage: StageTotals, strategy: Strategy,
                                   profile: ImplementationProfile = TESSERA) -> float:
    """Transient communication buffers of the cp exchange and the ep all-to-all on one device. The cp exchange's, at
    the backward: the K/V blocks sent and received and the fp32 dK/dV accumulators sent and received (under an
    all-gather rotation, the whole sequence's K/V gathered instead, and the dK/dV accumulated, sent and received),
    and the fp32 dQ accumulator (``_all_gathered_kv_s``; ``runtime.context_parallel.RingAttention``)."""
    total = 0.0
    if strategy.cp > 1 and stage.attention_layers:
        step = _kv_step_bytes(stage, strategy, repeated=profile.cp_kv_repeated)
        queries = _kv_step_bytes(stage, strategy, repeated=True) / 2  # one layer's query shard: K or V per query head
        exchanged = strategy.cp * step + 3 * FP32_RATIO * step if profile.cp_rotation == "allgather" else (
            2 * step + 2 * FP32_RATIO * step)
        total += exchanged + FP32_RATIO * queries
    if strategy.ep > 1 and stage.moe_layers:
        total += DISPATCH_BUFFERS * _dispatch_bytes_per_layer(stage, strategy)
    return total


# ----------------------------------------------------------------------------------------------- expert parallelism


def ep_comm_s(stage: StageTotals, cluster: Cluster, strategy: Strategy, *, dispatch: str = "per-expert",
              routing: str = "uniform") -> float:
    """Dispatch and combine all-to-all seconds of one micro-batch on one device of ``stage``, crossing nodes as
    ``dispatch`` does (``ImplementationProfile.ep_dispatch``) for tokens routed as ``routing`` says (``ep_routing``)."""
    if strategy.ep == 1 or not stage.moe_layers:
        return 0.0
    share = per_node_share(stage, cluster, strategy, routing=routing) if dispatch == "per-node" else None
    one = all_to_all_time(cluster, _dispatch_bytes_per_layer(stage, strategy), group_size=strategy.ep,
                          stride=ep_stride(strategy), per_node_share=share)
    recomputed = stage.recompute_dispatch_bytes / stage.dispatch_bytes if stage.dispatch_bytes else 0.0
    exchange = stage.moe_layers * one * (4 + 2 * recomputed)  # fwd dispatch+combine, bwd both, recomputed fwd again
    return exchange + _folded_combine_s(stage, cluster, strategy) * (2 + recomputed)


def per_node_share(stage: StageTotals, cluster: Cluster, strategy: Strategy, *, routing: str = "uniform") -> float:
    """The bytes a per-node dispatch sends beyond a node over what a per-expert one sends there.

    The ep group spans ``N`` nodes, each holding ``E / N`` of a layer's ``E`` experts (in order: node ``i`` the
    ``i``-th block of them); a token picks ``k``. Per expert, it crosses to other nodes ``k (N - 1) / N`` times on
    average; once per node, as often as another node holds one of its ``k``. Routed uniformly (the balanced load the
    experts are measured at), that is ``(N - 1) (1 - C(E - E/N, k) / C(E, k))`` times; routed to ``k`` consecutive
    experts (``routing="consecutive"``), ``(N - 1) / N`` times the nodes those span. 1 (no saving priced) for a group
    inside one node, a stage without the counts, or experts that do not divide evenly among the nodes. A stage whose
    MoE layers differ is taken at its fewest experts and most experts per token."""
    members = max(1, min(strategy.ep, cluster.devices_per_node // ep_stride(strategy)))
    nodes, experts, k = math.ceil(strategy.ep / members), stage.experts, stage.top_k
    if nodes <= 1 or not experts or not k or experts % nodes:
        return 1.0
    if routing == "consecutive":
        return _consecutive_nodes(experts, nodes, k) / k
    missed = math.comb(experts - experts // nodes, k) / math.comb(experts, k)  # a given other node holds none
    return (nodes - 1) * (1 - missed) / (k * (nodes - 1) / nodes)


@functools.cache  # every candidate strategy of a search asks again
def _consecutive_nodes(experts: int, nodes: int, k: int) -> float:
    """Nodes a token's ``k`` consecutive experts span on average, its first one ``k t`` modulo ``experts``."""
    per_node, starts = experts // nodes, range(0, experts * k, k)
    return sum(len({(start + j) % experts // per_node for j in range(k)}) for start in starts) / len(starts)


def exposed_ep_comm_s(all_to_alls_s: float, forward_s: float, backward_s: float, *, contention: float,
                      unpartnered: float = 0.0) -> float:
    """What a micro-batch's all-to-alls add to its time, on average, when they run beside another micro-batch's
    compute (``ImplementationProfile.ep_overlap``; Megatron-Core pairs one micro-batch's forward with another's
    backward, layer by layer): the forward's half beside the partner's backward (``backward_s``, its recomputation
    included), the backward's half beside the partner's forward (``forward_s``); what that compute does not cover,
    and the ``contention`` share (``Calibration.overlap_contention``) of what it does, which runs slower beside the
    NCCL kernels; all of it for the ``unpartnered`` share of the micro-batches (:func:`unpartnered_share`)."""
    half = all_to_alls_s / 2
    hidden = min(half, backward_s) + min(half, forward_s)
    overlapped = all_to_alls_s - hidden + contention * hidden
    return (1 - unpartnered) * overlapped + unpartnered * all_to_alls_s


def unpartnered_share(strategy: Strategy, micro_batches: int) -> float:
    """The share of a step's micro-batches whose all-to-alls have no other micro-batch's compute beside them: the
    1F1B schedule's ``pp - 1`` warm-up forwards and cool-down backwards and the step's first forward and last
    backward, ``pp`` micro-batches' worth of the step's ``micro_batches`` (all of them when there are fewer). An
    interleaved schedule's longer warm-up, counted in chunks, is not added."""
    return min(1.0, strategy.pp / micro_batches) if micro_batches else 1.0


def _folded_combine_s(stage: StageTotals, cluster: Cluster, strategy: Strategy) -> float:
    """Folded experts without sp: every tp rank holds all tokens and dispatches its ``1/tp`` share, so each MoE
    layer's combined ``(N, H)`` output is all-reduced over tp in the forward, and its input gradient in the
    backward (``runtime.experts_exchange.TokenShard``). With sp the tokens are already split over tp."""
    if strategy.expert_tp == strategy.tp or strategy.sp:
        return 0.0
    nbytes = stage.boundary_bytes * strategy.micro_batch / strategy.cp  # one layer's output, as a stage's boundary
    return stage.moe_layers * all_reduce_time(cluster, nbytes, group_size=strategy.tp)


def ep_stride(strategy: Strategy) -> int:
    """Rank distance between expert-parallel peers: ``tp * cp``, or ``etp`` when folded into the tp axis."""
    return strategy.tp * strategy.cp if strategy.expert_tp == strategy.tp else strategy.expert_tp


def _dispatch_bytes_per_layer(stage: StageTotals, strategy: Strategy) -> float:
    return stage.dispatch_bytes / stage.moe_layers * strategy.micro_batch / (strategy.cp * strategy.tp)


# ----------------------------------------------------------------------------------------------- context parallelism


def cp_comm_s(stage: StageTotals, cluster: Cluster, strategy: Strategy, *, flops_per_s: float,
              profile: ImplementationProfile = TESSERA) -> tuple[float, float]:
    """``(total, exposed)`` K/V exchange seconds of one micro-batch on one device of ``stage``, as ``profile`` moves
    them (``cp_rotation``); ``flops_per_s`` is the rate the attention cores that hide it run at."""
    if strategy.cp == 1 or not stage.attention_layers:
        return 0.0, 0.0
    layers, cp, tp = stage.attention_layers, strategy.cp, strategy.tp
    step_bytes = _kv_step_bytes(stage, strategy, repeated=profile.cp_kv_repeated)
    attention = stage.attention_core_flops / layers * strategy.micro_batch / (cp**2 * tp * flops_per_s)
    # torchtitan's op-level selective policy keeps the attention cores' outputs: only its full blocks re-run the exchange
    rerun = stage.full_recompute_kv_bytes if profile.selective_policy == "op" else stage.recompute_kv_bytes
    recomputed = rerun / stage.kv_bytes if stage.kv_bytes else 0.0
    if profile.cp_rotation == "allgather":
        return _all_gathered_kv_s(cluster, strategy, step_bytes, attention, recomputed, layers)
    forward = p2p_time(cluster, step_bytes, group_size=cp, stride=tp)
    backward = p2p_time(cluster, 2 * step_bytes, group_size=cp, stride=tp)
    total = layers * (cp - 1) * (forward * (1 + recomputed) + backward)
    exposed = layers * (cp - 1) * (
        max(0.0, forward - attention) * (1 + recomputed) + max(0.0, backward - FLASH_BACKWARD_RATIO * attention)
    )
    return total, exposed


def _all_gathered_kv_s(cluster: Cluster, strategy: Strategy, step_bytes: float, attention: float, recomputed: float,
                       layers: int) -> tuple[float, float]:
    """PyTorch's ring attention under its ``ALL_GATHER`` rotation (``torch.distributed.tensor.experimental``
    ``_context_parallel/_attention.py``): each forward all-gathers the layer's K/V from every cp rank, issued before
    the first block's attention and waited for after it, so only that block hides it; the backward gathers them
    again the same way and passes the fp32 dK/dV accumulators (twice the bf16 K/V's bytes) one step along a ring after
    every block, each hidden by the next block's backward, the last one by nothing."""
    cp, tp = strategy.cp, strategy.tp
    gather = all_gather_time(cluster, cp * step_bytes, group_size=cp, stride=tp)
    gradients = p2p_time(cluster, 2 * step_bytes, group_size=cp, stride=tp)
    backward = FLASH_BACKWARD_RATIO * attention
    total = layers * (gather * (2 + recomputed) + cp * gradients)
    exposed = layers * (max(0.0, gather - attention) * (1 + recomputed) + max(0.0, gather - backward)
                        + (cp - 1) * max(0.0, gradients - backward) + gradients)
    return total, exposed


def _kv_step_bytes(stage: StageTotals, strategy: Strategy, *, repeated: bool = False) -> float:
    """K/V bytes of one rank's sequence shard, for one attention layer: what one ring step sends. Tensor parallelism
    splits the kv heads (beyond ``kv_heads`` ranks they are replicated); K/V ``repeated`` to every query head split
    as the query heads do."""
    per_layer = (stage.kv_repeated_bytes if repeated else stage.kv_bytes) / stage.attention_layers
    heads_split = strategy.tp if repeated else min(strategy.tp, stage.kv_heads or strategy.tp)
    return per_layer * strategy.micro_batch / (strategy.cp * heads_split)


# ----------------------------------------------------------------------------------------------- groups on two axes


def group_reduce_scatter_s(cluster: Cluster, nbytes: float, axes: Axes) -> float:
    """Reduce-scatter ``nbytes`` over a group on ``axes``: inner axis first, then the shard over the next."""
    return _axis_by_axis_s(reduce_scatter_time, cluster, nbytes, axes)


def group_all_gather_s(cluster: Cluster, nbytes: float, axes: Axes) -> float:
    """All-gather into an ``nbytes`` buffer over a group on ``axes`` (the mirror image of the reduce-scatter)."""
    return _axis_by_axis_s(all_gather_time, cluster, nbytes, axes)


def _axis_by_axis_s(collective, cluster: Cluster, nbytes: float, axes: Axes) -> float:
    """One collective per axis, inner first, each on the share the previous axis left (``nbytes / n``)."""
    total, data = 0.0, nbytes
    for n, stride in axes:
        total += collective(cluster, data, group_size=n, stride=stride)
        data /= n
    return total


def group_all_reduce_s(cluster: Cluster, nbytes: float, axes: Axes) -> float:
    """All-reduce ``nbytes``: reduce-scatter over the inner axes, all-reduce the shard on the outermost, gather back."""
    if not axes:
        return 0.0
    *inner, (n, stride) = axes
    inner_s = group_reduce_scatter_s(cluster, nbytes, tuple(inner)) + group_all_gather_s(cluster, nbytes, tuple(inner))
    return inner_s + all_reduce_time(cluster, nbytes / group_size(tuple(inner)), group_size=n, stride=stride)


def _axes(*pairs: tuple[int, int]) -> Axes:
    return tuple((n, stride) for n, stride in pairs if n > 1)


# ----------------------------------------------------------------------------------------------- rules


def check_sparse_and_long(layers: Sequence[LayerStats], training: TrainingConfig, strategy: Strategy) -> None:
    """Raise unless ``ep`` divides every MoE layer's experts and ``cp`` splits the sequence into ``2 cp`` chunks."""
    if strategy.ep > 1:
        experts = {layer.experts for layer in layers if layer.experts}
        if not experts:
            raise ConfigError(f"ep={strategy.ep} needs a model with routed experts; this one has none: use ep=1")
        if any(e % strategy.ep for e in experts):
            raise ConfigError(f"ep={strategy.ep} does not divide the experts per layer {sorted(experts)}; pick a divisor")
    if strategy.cp > 1 and training.seq_len % (2 * strategy.cp):
        raise ConfigError(
            f"cp={strategy.cp} splits each sequence into 2*cp = {2 * strategy.cp} zig-zag chunks, which must divide "
            f"seq_len={training.seq_len}; pick a cp with 2*cp dividing it"
        )
