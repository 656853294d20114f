"""Facts about a plan that reports and comparisons state alike: formatted numbers (seconds to 3 decimals, GiB to
2, tokens/s to units), where each mesh axis lives, the step time split into terms, and the launch line.

Where the step time goes (:func:`step_terms`): compute, recompute, exposed communication per kind,
bubble, optimizer, stragglers and exposed activation offload, which sum to ``Estimate.step_time_s``. The estimate states exposed communication
as one number; it is split by kind as the cost model accrues it: tensor-parallel and pipeline transfers sit on the
critical path in full, the context-parallel K/V ring by the part attention does not hide (the slowest stage's
``cp_comm``), the expert all-to-alls by the part another micro-batch's compute does not hide where the framework
overlaps them (the slowest stage's ``ep_comm``; in full otherwise), and what is left is data-parallel communication,
shared among its kinds in proportion to their totals.

How far to trust the step time (``Plan.error_band``, :func:`band_sentence`): the error band of the plan's regime on held-out published
runs (``cost_models.error_bands``), and which runners-up are within the cost model's error of the plan (the gap band:
published pairs of one workload in two configurations).

Mesh axes are laid out innermost first, tp -> cp -> ep -> pp -> dp, the dp axis standing for the ``dp / ep``
replicas of each expert group when ``ep > 1`` (``Strategy``'s convention), so :func:`mesh_layout` says which
axes live inside a node and which cross nodes.
"""

from __future__ import annotations

import shlex
from typing import NamedTuple

from tessera.cost_models.error_bands import ErrorBand, gap_band, within_gap_error
from tessera.cost_models.types import Estimate, Strategy
from tessera.errors import TesseraError
from tessera.planner.plan import Plan
from tessera.topology import load_cluster

GiB = 2**30
MESH_ORDER = ("tp", "cp", "ep", "pp", "dp")
AXIS_UNITS = {"tp": "tp rank", "cp": "cp rank", "ep": "ep rank", "pp": "stage", "dp": "dp rank", "edp": "ep group"}
DP_KIND_PREFIXES = ("dp_", "zero_", "fsdp_")
RENDEZVOUS_PORT = 29500


def seconds(value: float) -> str:
    """``151.337 s``: how every report prints a time."""
    return f"{value:.3f} s"


def gib(value: float) -> str:
    """``61.90``: bytes as GiB, as every report prints memory."""
    return f"{value / GiB:.2f}"


def tokens(value: float) -> str:
    """``55,430``: tokens per second as every report prints them."""
    return f"{value:,.0f}"


def mesh_layout(strategy: Strategy, *, devices_per_node: int) -> list[str]:
    """Where each mesh axis lives, innermost first: ``["tp=8 inside each node", "pp=4 across 4 nodes ..."]``.

    With expert parallelism the data-parallel axis is ``ep`` (inside ``pp``) times ``edp = dp / ep`` outside it
    (``Strategy``'s layout)."""
    lines, inner = [], 1
    for axis in MESH_ORDER:
        degree = strategy.expert_dp if axis == "dp" else getattr(strategy, axis)
        name = "edp" if axis == "dp" and strategy.ep > 1 else axis
        if degree > 1:
            lines.append(_axis_placement(name, degree, inner=inner, per_node=devices_per_node))
            inner *= degree
    return lines or ["one device: nothing is split"]


def _axis_placement(axis: str, degree: int, *, inner: int, per_node: int) -> str:
    span, unit = inner * degree, AXIS_UNITS[axis]
    if per_node % span == 0:
        return f"{axis}={degree} inside each node"
    nodes = -(-span // per_node)
    if span % per_node:  # its groups do not tile nodes (Cluster.level_spanned)
        return f"{axis}={degree} in groups that straddle node boundaries (priced across nodes)"
    if per_node % inner and inner % per_node:  # an inner axis straddles: no whole count per node
        return f"{axis}={degree} across {nodes} nodes"
    if inner >= per_node:
        per_unit = inner // per_node
        return f"{axis}={degree} across {nodes} nodes ({'one node' if per_unit == 1 else f'{per_unit} nodes'} per {unit})"
    return f"{axis}={degree} across {nodes} nodes ({per_node // inner} {unit}s per node)"


class ClusterLayout(NamedTuple):
    """The plan's cluster as reports describe it: ``nodes`` of ``per_node`` devices (its innermost link level, which
    ``mesh_layout`` places axes in) on ``hosts`` of ``per_host`` (what ``torchrun`` starts: a GB200 NVL72 rack is one
    node of 72 on 18 hosts of 4, ``Cluster.devices_per_host``)."""

    nodes: int
    per_node: int
    hosts: int
    per_host: int


def cluster_layout(plan: Plan) -> ClusterLayout:
    """The plan's ``ClusterLayout``; one node and host of every device when its cluster cannot be loaded."""
    try:
        cluster = load_cluster(plan.cluster)
    except (TesseraError, OSError):
        return ClusterLayout(1, plan.estimate.num_devices, 1, plan.estimate.num_devices)
    return ClusterLayout(cluster.num_nodes, cluster.devices_per_node, cluster.num_hosts, cluster.host_size)


def exposed_comm_by_kind(e: Estimate) -> dict[str, float]:
    """``Estimate.exposed_comm_time_s`` split by communication kind (see the module docstring)."""
    left, exposed = e.exposed_comm_time_s, {}
    for kind, total in e.comm_time_by_kind_s.items():
        if not kind.startswith(DP_KIND_PREFIXES):
            hidden_by = {"cp_ring": "cp_comm", "ep_alltoall": "ep_comm"}.get(kind)
            exposed[kind] = min(_exposed_on_slowest_stage_s(e, kind, hidden_by) if hidden_by else total, left)
            left -= exposed[kind]
    dp = {kind: total for kind, total in e.comm_time_by_kind_s.items() if kind.startswith(DP_KIND_PREFIXES)}
    for kind, total in dp.items():
        exposed[kind] = left * total / sum(dp.values())
    if not dp and left > 1e-12:
        exposed["other"] = left
    return exposed


def _exposed_on_slowest_stage_s(e: Estimate, kind: str, part: str) -> float:
    """The part of ``kind`` compute does not hide, per step: the slowest stage's exposed ``part`` (the K/V ring
    beside the attention, ``cp_comm``; the expert all-to-alls beside another micro-batch, ``ep_comm``)."""
    if not e.stage_time_per_micro_batch_s:
        return e.comm_time_by_kind_s.get(kind, 0.0)
    slowest = max(e.stage_time_per_micro_batch_s, key=lambda parts: sum(parts.values()))
    return e.micro_batches * slowest.get(part, 0.0)


def step_terms(e: Estimate) -> dict[str, float]:
    """Where the step time goes, in seconds; the terms sum to ``e.step_time_s``."""
    terms = {"compute": e.compute_time_s, "recompute": e.recompute_time_s}
    terms |= {f"exposed {kind}": value for kind, value in exposed_comm_by_kind(e).items()}
    terms |= {"bubble": e.bubble_time_s, "optimizer": e.optimizer_time_s, "stragglers": e.straggler_time_s}
    terms |= {"overlap contention": e.contention_time_s} if e.contention_time_s else {}
    return terms | ({"exposed offload": e.offload_time_s} if e.offload_time_s else {})


def runners_up_inside_band(plan: Plan, band: ErrorBand) -> list[int]:
    """Ranks (the plan is 1) of the alternatives that may really be as fast as the plan: their predicted gap to it
    is inside the gap band (``error_bands.gap_band``: published pairs of one workload in two configurations), or,
    without one, inside the plan's own ``band``."""
    gaps = gap_band() or band
    return [rank for rank, c in enumerate(plan.alternatives, start=2)
            if within_gap_error(plan.estimate.step_time_s, c.estimate.step_time_s, gaps)]


def band_sentence(plan: Plan) -> str | None:
    """``Likely step time: 12.3 to 14.0 s (...); runners-up 2 and 3 are inside the error of a predicted gap.``,
    or None without a band."""
    band = plan.error_band()
    if band is None:
        return None
    inside = runners_up_inside_band(plan, band)
    text = f"Likely step time: {band.describe(plan.estimate.step_time_s)}."
    if inside:
        ranks = ", ".join(map(str, inside))
        gaps = gap_band()
        basis = (f"the published gap between two configurations of one workload came within {gaps.high - 1:.0%} of "
                 f"the predicted one in 80% of {gaps.runs} pairs with a held-out run" if gaps else "inside the plan's band")
        text += (f" Runner{'s' if len(inside) > 1 else ''}-up {ranks} {'are' if len(inside) > 1 else 'is'} predicted "
                 f"that close to the plan ({basis}): the ranking between them and the plan is within the cost "
                 "model's error.")
    return text


def launch_command(*, nodes: int, devices_per_node: int, plan_path: str = "plan.json") -> str:
    """The torchrun line that starts the plan's ranks on ``nodes`` hosts of ``devices_per_node`` each
    (``ClusterLayout.hosts``; run it on every host), every word shell-quoted so a path such as ``rep; touch X #`` stays one
    argument; ``$HEAD_NODE`` is left for the shell to expand."""
    head = shlex.join(["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(devices_per_node)])
    rendezvous = ("--standalone" if nodes == 1
                  else f'--rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:{RENDEZVOUS_PORT}"')
    return f"{head} {rendezvous} {shlex.join(['train.py', '--plan', str(plan_path)])}"


PER_LAYER_HEADER = ("layers", "kind", "stage", "sharding", "activation policy", "memory GiB/device", "ms per micro-batch")
"""Columns of :func:`per_layer_rows`."""


def layer_sharding(strategy: Strategy, layer) -> str:
    """How one planned layer is split: tensor (vocabulary) and expert parallelism, the ZeRO stage, resharding."""
    if layer.kind == "loss":
        return "-"
    parts = []
    if strategy.tp > 1 and layer.kind in ("block", "embedding", "head"):
        parts.append(f"tp={strategy.tp}" + (" vocab-parallel" if layer.kind != "block" else "") + (" +sp" * strategy.sp))
    if strategy.ep > 1 and layer.block_kind in ("moe", "local-moe"):
        parts.append(f"experts ep={strategy.ep}" + (f" etp={strategy.expert_tp}" if strategy.etp is not None else ""))
    if strategy.zero == 3:
        keeps = layer.kind == "block" and not layer.reshard
        parts.append("ZeRO-3, keeps gathered weights" if keeps else "ZeRO-3, reshards")
    elif strategy.zero:
        parts.append(f"ZeRO-{strategy.zero}")
    return ", ".join(parts) or "replicated"


def per_layer_rows(plan: Plan) -> list[tuple[str, ...]]:
    """The per-layer table (``PER_LAYER_HEADER``): consecutive layers with the same choices and costs share a row
    (``blocks.3 .. blocks.60 (58)``), so a deep model stays readable."""
    rows: list[list] = []
    for layer in plan.layers:
        cells = (layer.block_kind or layer.kind, str(layer.chunk % plan.strategy.pp), layer_sharding(plan.strategy, layer),
                 layer.recompute if layer.kind == "block" else "-", gib(layer.memory_bytes), f"{layer.time_s * 1e3:.2f}")
        if rows and rows[-1][1] == cells:
            rows[-1][0].append(layer.fqn)
        else:
            rows.append([[layer.fqn], cells])
    return [(_fqn_run(fqns), *cells) for fqns, cells in rows]


def _fqn_run(fqns: list[str]) -> str:
    return fqns[0] if len(fqns) == 1 else f"{fqns[0]} .. {fqns[-1]} ({len(fqns)})"


def uniform_comparison(plan: Plan) -> str:
    """One sentence: what the best uniform plan would have cost against the chosen per-layer plan."""
    if plan.uniform is None:
        return "The plan is uniform: one activation policy for every block and even stages were the best the search found."
    u = plan.uniform
    return (f"The best uniform plan (one activation policy for every block, even stages, every block resharding), "
            f"`{u.strategy.to_string()}`, takes {seconds(u.estimate.step_time_s)} per step against the plan's "
            f"{seconds(plan.estimate.step_time_s)}: {u.verdict} ({u.estimate.step_time_s / plan.estimate.step_time_s:.2f}x).")
