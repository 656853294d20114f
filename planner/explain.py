"""Explain a plan: the strategy report (Markdown, self-contained HTML) and plan-versus-baseline comparisons.

A report is built once as a list of sections made of neutral blocks (paragraphs, bullet lists, tables,
figures, code; ``explain_plots``), then rendered: Markdown writes each figure as a PNG beside the ``.md``
and links it; HTML embeds every figure as a base64 PNG and carries its own CSS, so the file opens
offline. Both show the same numbers, formatted by the same helpers (seconds to 3 decimals, GiB to 2,
tokens/s to units).

Where the step time goes (:func:`step_terms`): compute, recompute, exposed communication per kind,
bubble and optimizer, which sum to ``Estimate.step_time_s``. The estimate states exposed communication
as one number; it is split by kind as the cost model accrues it: tensor-, expert-parallel and pipeline
transfers sit on the critical path in full, the context-parallel K/V ring by the part attention does not hide
(the slowest stage's ``cp_comm``), and what is left is data-parallel communication, shared among its kinds in
proportion to their totals.

Mesh axes are laid out innermost first, tp -> cp -> ep -> pp -> dp, the dp axis standing for the ``dp / ep``
replicas of each expert group when ``ep > 1`` (``Strategy``'s convention), so :func:`mesh_layout` says which
axes live inside a node and which cross nodes. Why the expert- and context-parallel degrees were chosen:
the section built from ``Plan.degree_alternatives`` (``planner.degrees``).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tessera.cost_models import estimate as estimate_strategy
from tessera.cost_models.types import Estimate, LayerStats, Strategy, TrainingConfig
from tessera.errors import ConfigError, TesseraError
from tessera.files import check_writable_file, write_text_atomically
from tessera.planner import explain_plots as plots
from tessera.planner.explain_plots import Block, Bullets, Code, Figure, Section, Table, render_html, render_markdown
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.plan import Plan, format_count
from tessera.planner.search import best_candidate, rank_candidates
from tessera.planner.space import check_layer_pins
from tessera.topology import load_cluster
from tessera.topology.cluster import Cluster

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
GiB = 2**30
MESH_ORDER = ("tp", "cp", "ep", "pp", "dp")
AXIS_UNITS = {"tp": "tp rank", "cp": "cp rank", "ep": "ep rank", "pp": "stage", "dp": "dp rank", "edp": "ep group"}
DP_KIND_PREFIXES = ("dp_", "zero_", "fsdp_")
RENDEZVOUS_PORT = 29500


# ---------------------------------------------------------------------------------------------- facts


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
    if span <= per_node:
        return f"{axis}={degree} inside each node"
    nodes = -(-span // per_node)
    if inner >= per_node:
        per_unit = inner // per_node
        return f"{axis}={degree} across {nodes} nodes ({'one node' if per_unit == 1 else f'{per_unit} nodes'} per {unit})"
    return f"{axis}={degree} across {nodes} nodes ({per_node // inner} {unit}s per node)"


def cluster_layout(plan: Plan) -> tuple[int, int]:
    """(nodes, devices per node) of the plan's cluster; one node of every device when it cannot be loaded."""
    try:
        cluster = load_cluster(plan.cluster)
    except (TesseraError, OSError):
        return 1, plan.estimate.num_devices
    return cluster.num_nodes, cluster.devices_per_node


def exposed_comm_by_kind(e: Estimate) -> dict[str, float]:
    """``Estimate.exposed_comm_time_s`` split by communication kind (see the module docstring)."""
    left, exposed = e.exposed_comm_time_s, {}
    for kind, total in e.comm_time_by_kind_s.items():
        if not kind.startswith(DP_KIND_PREFIXES):
            exposed[kind] = min(_exposed_cp_ring_s(e) if kind == "cp_ring" else total, left)
            left -= exposed[kind]
    dp = {kind: total for kind, total in e.comm_time_by_kind_s.items() if kind.startswith(DP_KIND_PREFIXES)}
    for kind, total in dp.items():
        exposed[kind] = left * total / sum(dp.values())
    if not dp and left > 1e-12:
        exposed["other"] = left
    return exposed


def _exposed_cp_ring_s(e: Estimate) -> float:
    """The part of the K/V ring attention does not hide, per step: the slowest stage's ``cp_comm`` share."""
    if not e.stage_time_per_micro_batch_s:
        return e.comm_time_by_kind_s.get("cp_ring", 0.0)
    slowest = max(e.stage_time_per_micro_batch_s, key=lambda parts: sum(parts.values()))
    return e.micro_batches * slowest.get("cp_comm", 0.0)


def step_terms(e: Estimate) -> dict[str, float]:
    """Where the step time goes, in seconds; the terms sum to ``e.step_time_s``."""
    terms = {"compute": e.compute_time_s, "recompute": e.recompute_time_s}
    terms |= {f"exposed {kind}": value for kind, value in exposed_comm_by_kind(e).items()}
    return terms | {"bubble": e.bubble_time_s, "optimizer": e.optimizer_time_s}


def launch_command(*, nodes: int, devices_per_node: int, plan_path: str = "plan.json") -> str:
    """The torchrun line that starts the plan's ranks (run it on every node), every word shell-quoted so a path
    such as ``rep; touch X #`` stays one argument; ``$HEAD_NODE`` is left for the shell to expand."""
    head = shlex.join(["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(devices_per_node)])
    rendezvous = ("--standalone" if nodes == 1
                  else f'--rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:{RENDEZVOUS_PORT}"')
    return f"{head} {rendezvous} {shlex.join(['train.py', '--plan', str(plan_path)])}"


# ---------------------------------------------------------------------------------------- comparison


class TermChange(BaseModel):
    """How one term of the step time differs between a baseline and the plan."""

    model_config = FROZEN

    term: str
    """Step-time term (``compute``, ``bubble``, ``exposed tp_allreduce``...)."""
    plan_s: float
    """Seconds per step the plan spends on it."""
    baseline_s: float
    """Seconds per step the baseline spends on it."""
    delta_s: float
    """``baseline_s - plan_s``: positive where the baseline is slower."""


class BaselineComparison(BaseModel):
    """One hand-tuned configuration evaluated on the plan's cost model, against the plan."""

    model_config = FROZEN

    requested: str
    """The baseline as the user wrote it (fields left out were filled by the planner)."""
    strategy: Strategy | None = None
    """The complete strategy evaluated; None when the baseline cannot run at all."""
    estimate: Estimate | None = None
    """Its predicted cost; None when it cannot run at all."""
    error: str | None = None
    """Why the baseline cannot run (e.g. dp does not divide the global batch); None when it was evaluated."""
    throughput_ratio: float | None = None
    """Plan tokens/s divided by baseline tokens/s (above 1: the plan is faster)."""
    term_changes: tuple[TermChange, ...] = ()
    """Every step-time term, largest absolute change first."""
    memory_delta_bytes: int = 0
    """Baseline peak memory per device minus the plan's."""
    over_budget_bytes: int = 0
    """How far the baseline's peak exceeds device memory (0 when it fits)."""
    reason: str
    """The difference in one sentence: the term that changed most, memory, and fit."""

    @property
    def fits(self) -> bool:
        """Whether the baseline runs and fits in device memory."""
        return self.estimate is not None and self.estimate.fits


class Comparison(BaseModel):
    """Tessera's plan next to hand-tuned baselines on the same model, cluster and cost model."""

    model_config = FROZEN

    model_name: str
    """Model preset or class."""
    cluster: str
    """Cluster spec."""
    training: TrainingConfig
    """Global batch, sequence length and precision."""
    plan_strategy: Strategy
    """The strategy Tessera chose."""
    plan_estimate: Estimate
    """Its predicted cost."""
    candidates_evaluated: int
    """Strategies the search estimated."""
    search_time_s: float
    """Wall time the search took."""
    baselines: tuple[BaselineComparison, ...]
    """Each baseline, in the order given."""


def compare_to_baseline(plan: Estimate, *, requested: str, strategy: Strategy, estimate: Estimate) -> BaselineComparison:
    """How ``estimate`` (a baseline) differs from the plan's estimate, and why."""
    mine, theirs = step_terms(plan), step_terms(estimate)
    changes = sorted(
        (TermChange(term=t, plan_s=mine.get(t, 0.0), baseline_s=theirs.get(t, 0.0), delta_s=theirs.get(t, 0.0) - mine.get(t, 0.0))
         for t in dict.fromkeys([*mine, *theirs])),
        key=lambda change: -abs(change.delta_s),
    )
    ratio = plan.tokens_per_s / estimate.tokens_per_s
    over = max(0, estimate.peak_memory_bytes - estimate.memory_budget_bytes)
    result = BaselineComparison(
        requested=requested, strategy=strategy, estimate=estimate, throughput_ratio=ratio, term_changes=tuple(changes),
        memory_delta_bytes=estimate.peak_memory_bytes - plan.peak_memory_bytes, over_budget_bytes=over, reason="",
    )
    return result.model_copy(update={"reason": _baseline_reason(result, plan)})


def evaluate_baseline(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, *, requested: str, pins: Mapping[str, object],
    plan: Estimate,
) -> BaselineComparison:
    """Evaluate one baseline as ``tessera.evaluate`` does (fields left out are the planner's best) and compare it.

    When no completion of the baseline fits, its leanest completion is the one compared, so the comparison
    says by how much it misses at best; when the search prunes every completion (model state alone
    overflows the device), that leanest completion is estimated directly.
    """
    note = " (no completion fits: its leanest is shown)"
    try:
        check_layer_pins(pins, list(graph.layers))  # per-block pins that cannot fit the model have no completion
    except ConfigError as exc:
        return baseline_error(requested, str(exc))
    try:
        scored = rank_candidates(graph, cluster, training, pins=pins)
        strategy, estimate = best_candidate(scored)
        if not estimate.fits:
            strategy, estimate = min(scored, key=lambda pair: pair[1].peak_memory_bytes)
    except ConfigError:
        try:
            strategy, estimate = leanest_completion(graph.layers, cluster, training, pins)
        except TesseraError as exc:
            return baseline_error(requested, str(exc))
    except TesseraError as exc:
        return baseline_error(requested, str(exc))
    result = compare_to_baseline(plan, requested=requested, strategy=strategy, estimate=estimate)
    return result if estimate.fits else result.model_copy(update={"reason": result.reason + note})


def leanest_completion(
    layers: Sequence[LayerStats], cluster: Cluster, training: TrainingConfig, pins: Mapping[str, object]
) -> tuple[Strategy, Estimate]:
    """The pinned fields with the leanest choice for every other one (micro-batch 1, full recomputation,
    ZeRO-3, sequence parallelism; dp takes the devices left), estimated."""
    fields: dict[str, object] = {"micro_batch": 1, "recompute": "full", **pins}
    inner = 1
    for axis in ("tp", "pp", "cp"):  # ep is part of dp
        inner *= int(fields.get(axis, 1))
    fields.setdefault("dp", max(cluster.num_devices // inner, 1))
    fields.setdefault("zero", 3 if int(fields["dp"]) > 1 else 0)
    fields.setdefault("sp", int(fields.get("tp", 1)) > 1)
    strategy = Strategy.model_validate(fields)
    return strategy, estimate_strategy(list(layers), cluster, training, strategy)


def baseline_error(requested: str, message: str) -> BaselineComparison:
    """A baseline that cannot run at all (no strategy matches it)."""
    return BaselineComparison(requested=requested, error=message, reason=f"cannot run: {message}")


def describe_change(change: TermChange, *, values: bool = True) -> str:
    """``bubble +1.234 s (1.500 s vs 0.266 s)``: one term's change, baseline against plan."""
    sign = "+" if change.delta_s >= 0 else "-"
    text = f"{change.term} {sign}{abs(change.delta_s):.3f} s"
    return text + (f" ({change.baseline_s:.3f} s vs {change.plan_s:.3f} s)" if values else "")


def _baseline_reason(b: BaselineComparison, plan: Estimate) -> str:
    e, ratio = b.estimate, b.throughput_ratio
    then = [describe_change(c, values=False) for c in b.term_changes[1:3] if abs(c.delta_s) >= 0.0005]
    change = describe_change(b.term_changes[0]) + (f", then {', '.join(then)}" if then else "")
    memory = f"memory {gib(e.peak_memory_bytes)} vs {gib(plan.peak_memory_bytes)} GiB per device"
    if b.over_budget_bytes:
        return (f"does not fit: {b.over_budget_bytes / GiB:.2f} GiB over the {e.memory_budget_bytes / GiB:.0f} GiB "
                f"device ({memory}); were it to fit, Tessera's plan would be {ratio:.2f}x its throughput; "
                f"biggest change: {change}")
    speed = (f"Tessera's plan is {ratio:.2f}x the baseline's throughput" if ratio >= 1
             else f"the baseline is {1 / ratio:.2f}x faster")
    return f"{speed}; biggest change: {change}; {memory}; the baseline fits"


def build_comparison(plan: Plan, baselines: Sequence[BaselineComparison]) -> Comparison:
    """The comparison record of ``plan`` against already evaluated ``baselines``."""
    return Comparison(
        model_name=plan.model_name, cluster=plan.cluster, training=plan.training, plan_strategy=plan.strategy,
        plan_estimate=plan.estimate, candidates_evaluated=plan.candidates_evaluated,
        search_time_s=plan.search_time_s, baselines=tuple(baselines),
    )


def why_it_lost(candidate: Estimate, best: Estimate, verdict: str, *, values: bool = True) -> str:
    """A runner-up's verdict with the step-time term that differs most from the chosen plan."""
    change = compare_to_baseline(best, requested="", strategy=Strategy(), estimate=candidate).term_changes[0]
    return f"{verdict}; most: {describe_change(change, values=values)}"


# ------------------------------------------------------------------------------------ report content


def report_title(plan: Plan) -> str:
    """The report's title."""
    return f"Tessera plan: {plan.model_name} on {plan.cluster}"


def report_sections(plan: Plan, *, plan_path: str = "plan.json") -> list[Section]:
    """Every section of the strategy report, charts rendered."""
    nodes, per_node = cluster_layout(plan)
    return [
        _overview(plan, nodes=nodes, per_node=per_node),
        *_unavailable(plan),
        _strategy(plan, per_node=per_node),
        _prediction(plan),
        _breakdown(plan.estimate),
        _memory(plan.estimate),
        _timeline(plan),
        _alternatives(plan),
        *_degrees(plan),
        Section("Search", (Table(("statistic", "value"), tuple(solver_statistics(plan))),)),
        _launch(plan, nodes=nodes, per_node=per_node, plan_path=plan_path),
    ]


def solver_statistics(plan: Plan) -> list[tuple[str, str]]:
    """The search's statistics as (label, value) rows, the integer program's included when the plan has them."""
    rows = [("candidates evaluated", f"{plan.candidates_evaluated:,}"), ("search time", seconds(plan.search_time_s))]
    solver = getattr(plan, "solver", None)
    for name, field in (type(solver).model_fields.items() if solver is not None else ()):
        value = getattr(solver, name)
        label = (field.description or name).split("\n")[0].rstrip(".")
        text = seconds(value) if name.endswith("_s") else f"{value:.2%}" if name.endswith("gap") else f"{value:,}"
        rows.append((label[0].lower() + label[1:], text))
    return rows


def _overview(plan: Plan, *, nodes: int, per_node: int) -> Section:
    t, blocks = plan.training, len(plan.block_fqns)
    return Section("Model and cluster", (Table(("item", "value"), (
        ("model", f"{plan.model_name}: {format_count(plan.param_count)} parameters, {len(plan.layers)} layers ({blocks} blocks)"),
        ("cluster", f"{plan.cluster}: {nodes} node{'s' * (nodes > 1)} x {per_node} {plan.device_name}, "
                    f"{plan.estimate.memory_budget_bytes / GiB:.0f} GiB each"),
        ("training", f"global batch {t.global_batch} x {t.seq_len} tokens = {t.tokens_per_step:,} tokens per step, "
                     f"{t.precision}"),
    )),))


def recompute_summary(plan: Plan) -> str:
    """Recomputation of the plan's blocks: ``full on every block`` or ``full on 69 blocks, none on 11``."""
    counts: dict[str, int] = {}
    for layer in plan.layers:
        if layer.kind == "block":
            counts[layer.recompute] = counts.get(layer.recompute, 0) + 1
    if len(counts) <= 1:
        return f"{next(iter(counts), plan.strategy.recompute)} on every block"
    return ", ".join(f"{policy} on {count} blocks" for policy, count in counts.items())


def chunk_block_counts(plan: Plan) -> list[int]:
    """Blocks in each pipeline chunk of the plan, in chunk order."""
    chunks = plan.chunk_fqns()
    kinds = {layer.fqn: layer.kind for layer in plan.layers}
    return [sum(kinds[fqn] == "block" for fqn in chunk) for chunk in chunks]


def _strategy(plan: Plan, *, per_node: int) -> Section:
    s, e = plan.strategy, plan.estimate
    facts = list(mesh_layout(s, devices_per_node=per_node))
    facts.append(f"micro-batch {s.micro_batch} sequence(s), {e.micro_batches} micro-batches per step per dp rank")
    facts.append(f"ZeRO stage {s.zero} ({s.name})" + (", sequence parallelism" if s.sp else ""))
    facts.append(f"recompute {recompute_summary(plan)}")
    if s.pp > 1:
        chunks = f" with {s.virtual_stages} chunks per stage" if s.virtual_stages > 1 else ""
        sizes = "/".join(map(str, chunk_block_counts(plan)))
        facts.append(f"pipeline schedule {s.schedule}{chunks}; blocks per chunk {sizes}")
    return Section("Strategy", (f"{s.name}: `{s.to_string()}`", Bullets(tuple(facts))))


def _prediction(plan: Plan) -> Section:
    e = plan.estimate
    rows = (
        ("step time", seconds(e.step_time_s)),
        ("tokens/s", tokens(e.tokens_per_s)),
        ("MFU", f"{e.mfu:.1%}"),
        ("HFU", f"{e.hfu:.1%}"),
        ("model TFLOP/s per device", f"{e.model_tflops_per_device:.1f}"),
        ("hardware TFLOP/s per device", f"{e.hardware_tflops_per_device:.1f}"),
        ("peak memory per device", f"{gib(e.peak_memory_bytes)} of {gib(e.memory_budget_bytes)} GiB"),
    )
    blocks: list[Block] = [Table(("metric", "value"), rows)]
    if e.notes:
        blocks += ["Assumptions:", Bullets(tuple(e.notes))]
    return Section("Prediction", tuple(blocks))


def _breakdown(e: Estimate) -> Section:
    terms = step_terms(e)
    rows = tuple((name, seconds(value), f"{value / e.step_time_s:.1%}") for name, value in terms.items())
    rows += (("step time", seconds(e.step_time_s), "100.0%"),)
    chart = Figure("step_time", "Step time by term (exposed communication only; hidden communication is free)",
                   plots.breakdown_chart(terms, step_time_s=e.step_time_s))
    return Section("Step time breakdown", (Table(("term", "time", "share"), rows), chart))


def _stage_memory(e: Estimate) -> list[dict[str, int]]:
    return [dict(stage) for stage in e.stage_memory_by_category_bytes] or [dict(e.memory_by_category_bytes)]


def _memory(e: Estimate) -> Section:
    stages = _stage_memory(e)
    categories = list(dict.fromkeys(key for stage in stages for key in stage))
    header = ("category (GiB)", *(f"stage {i}" for i in range(len(stages))))
    rows = tuple((c, *(gib(stage.get(c, 0)) for stage in stages)) for c in categories)
    rows += (("total", *(gib(sum(stage.values())) for stage in stages)),
             ("device limit", *(gib(e.memory_budget_bytes) for _ in stages)))
    chart = Figure("memory", "Peak memory per pipeline stage by category; the dashed line is the device's memory",
                   plots.memory_chart(stages, budget_bytes=e.memory_budget_bytes))
    return Section("Memory per pipeline stage", (Table(header, rows), chart))


def drawn_micro_batches(strategy: Strategy, micro_batches: int) -> int:
    """Micro-batches the timeline draws: the first ``2 pp`` (a multiple of ``pp`` when interleaved)."""
    drawn = min(micro_batches, 2 * strategy.pp)
    if strategy.pp > 1 and strategy.schedule == "interleaved" and drawn >= strategy.pp:
        drawn -= drawn % strategy.pp  # Megatron's interleaved order runs micro-batches in groups of pp
    return drawn


def _timeline(plan: Plan) -> Section:
    s, e = plan.strategy, plan.estimate
    stage_times = list(e.stage_time_per_micro_batch_s)
    if not stage_times:
        return Section("Pipeline timeline", ("The estimate has no per-stage timings to draw.",))
    drawn = drawn_micro_batches(s, e.micro_batches)
    schedule = s.schedule if s.pp > 1 else "1f1b"  # pp=1: forward and backward of each micro-batch in turn
    label = (f"{s.schedule}" + (f":{s.virtual_stages}" if s.virtual_stages > 1 else "")) if s.pp > 1 else "no pipeline (pp=1)"
    shading = " Lighter boxes are later chunks." if s.virtual_stages > 1 else ""
    text = (f"{'Schedule ' + label if s.pp > 1 else 'No pipeline (pp=1)'}: the first {drawn} of {e.micro_batches} "
            "micro-batches per step, simulated from the per-stage time of one micro-batch; boxes are numbered by "
            f"micro-batch.{shading} The schedule's order is drawn faithfully; the step time above is the cost model's.")
    try:
        ops = plots.simulate_schedule(schedule, stage_times, micro_batches=drawn, virtual_stages=s.virtual_stages)
    except plots.ScheduleDeadlock as exc:
        return Section("Pipeline timeline", (text, f"The timeline could not be simulated: {exc}."))
    title = f"{label}, {drawn} of {e.micro_batches} micro-batches"
    chart = Figure("timeline", f"Pipeline timeline ({title})", plots.timeline_chart(ops, stages=len(stage_times), title=title))
    return Section("Pipeline timeline", (text, chart))


def _unavailable(plan: Plan) -> list[Section]:
    """The axes the runtime cannot apply to this model, one line each (none: no section)."""
    if not plan.unavailable_axes:
        return []
    text = "The search planned without these axes: the runtime cannot apply them to this model."
    rows = tuple((f"`{axis}`", reason) for axis, reason in plan.unavailable_axes.items())
    gains = tuple(f"{c.verdict}: `{c.strategy.to_string()}`, {seconds(c.estimate.step_time_s)} per step (predicted)."
                  for c in plan.unavailable_gains)
    return [Section("Unavailable axes", (text, Table(("axis", "why not"), rows), *gains))]


def _alternatives(plan: Plan) -> Section:
    if not plan.alternatives:
        return Section("Alternatives", ("The search found no other strategy.",))
    rows = tuple(
        (str(rank), f"`{c.strategy.to_string()}`", seconds(c.estimate.step_time_s), tokens(c.estimate.tokens_per_s),
         gib(c.estimate.peak_memory_bytes), why_it_lost(c.estimate, plan.estimate, c.verdict))
        for rank, c in enumerate(plan.alternatives, start=2)
    )
    header = ("rank", "strategy", "step time", "tokens/s", "GiB/device", "why it lost")
    text = f"The next {len(rows)} strategies the search ranked (the plan is rank 1)."
    return Section("Alternatives", (text, Table(header, rows)))


def _degrees(plan: Plan) -> list[Section]:
    """Why the expert- and context-parallel degrees: what they cost and the best plan at every other degree."""
    s, e = plan.strategy, plan.estimate
    if s.ep == 1 and s.cp == 1 and not plan.degree_alternatives:
        return []
    comm = e.comm_time_by_kind_s
    facts = []
    if s.ep > 1:
        replicas = s.expert_dp * s.cp
        reduced = f"reduced over {replicas} ranks (dp/ep x cp)" if replicas > 1 else "not reduced: each expert lives on one rank"
        facts.append(f"ep={s.ep}: each device holds 1/{s.ep} of every MoE layer's experts (expert weights, gradients "
                     f"and Adam state divided by {s.ep}; expert gradients {reduced}); "
                     f"the dispatch and combine all-to-alls (two forward, two backward per MoE layer and "
                     f"micro-batch) take {seconds(comm.get('ep_alltoall', 0.0))} per step, on the critical path")
    if s.cp > 1:
        facts.append(f"cp={s.cp}: each sequence is split into {2 * s.cp} zig-zag chunks (causal work balanced), "
                     f"activations per device divided by {s.cp}; the K/V ring takes {seconds(comm.get('cp_ring', 0.0))} "
                     f"per step, {seconds(exposed_comm_by_kind(e).get('cp_ring', 0.0))} of it not hidden behind attention")
    rows = tuple(
        (c.verdict.partition(":")[0], f"`{c.strategy.to_string()}`", seconds(c.estimate.step_time_s),
         gib(c.estimate.peak_memory_bytes), why_it_lost(c.estimate, e, c.verdict.partition(": ")[2]))
        for c in plan.degree_alternatives
    )
    blocks: list[Block] = [Bullets(tuple(facts))] if facts else []
    if rows:
        blocks += ["The fastest strategy the search estimated at every other degree (the plan: "
                   f"ep={s.ep}, cp={s.cp}); a degree the search space admits that is not listed was pruned by the step-time "
                   "lower bound (its compute alone could not beat the plan).",
                   Table(("degree", "best strategy at that degree", "step time", "GiB/device", "why it lost"), rows)]
    return [Section("Expert and context parallelism", tuple(blocks))]


def _launch(plan: Plan, *, nodes: int, per_node: int, plan_path: str) -> Section:
    command = launch_command(nodes=nodes, devices_per_node=per_node, plan_path=plan_path)
    text = (f"Run on each of the {nodes} node(s); `train.py` reads the plan with `tessera.Plan.from_json` and "
            "applies it with `tessera.runtime.apply.apply_plan`.")
    if nodes > 1:
        text += " Set `HEAD_NODE` to the first node's address."
    return Section("Launch", (text, Code(command)))


# ----------------------------------------------------------------------------------------- documents


def plan_markdown(plan: Plan, *, plan_path: str = "plan.json", figure_dir: str | Path | None = None) -> str:
    """The report as Markdown; its charts are written as PNG files into ``figure_dir`` (left out without one).

    ``plan_path`` is where the launch command expects the plan's JSON."""
    folder = Path(figure_dir) if figure_dir is not None else None
    return render_markdown(report_title(plan), report_sections(plan, plan_path=plan_path), figure_dir=folder)


def plan_html(plan: Plan, *, plan_path: str = "plan.json") -> str:
    """The report as one self-contained HTML page (charts embedded)."""
    return render_html(report_title(plan), report_sections(plan, plan_path=plan_path))


def write_markdown(plan: Plan, path: str | Path, *, plan_path: str = "plan.json") -> Path:
    """Write the Markdown report to ``path`` and its charts (PNG) beside it, each file atomically."""
    target = check_writable_file(path, what="report")
    return write_text_atomically(target, plan_markdown(plan, plan_path=plan_path, figure_dir=target.parent), what="report")


def write_html(plan: Plan, path: str | Path, *, plan_path: str = "plan.json") -> Path:
    """Write the self-contained HTML report to ``path`` atomically."""
    target = check_writable_file(path, what="report")
    return write_text_atomically(target, plan_html(plan, plan_path=plan_path), what="report")
