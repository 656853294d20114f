"""Explain a plan: the strategy report (Markdown, self-contained HTML). Comparisons with baselines are
``planner.compare``; the facts both state (formatting, mesh layout, step-time terms) are ``planner.plan_facts``.

A report is built once as a list of sections made of neutral blocks (paragraphs, bullet lists, tables,
figures, code; ``explain_plots``), then rendered: Markdown writes each figure as a PNG beside the ``.md``
and links it; HTML embeds every figure as a base64 PNG and carries its own CSS, so the file opens
offline. Both show the same numbers, formatted by the same helpers (seconds to 3 decimals, GiB to 2,
tokens/s to units).

Why the expert- and context-parallel degrees were chosen: the section built from ``Plan.degree_alternatives``
(``planner.degrees``).
"""

from __future__ import annotations

from pathlib import Path

from tessera.cost_models.types import Estimate, Strategy
from tessera.files import check_writable_file, write_text_atomically, written_by_tessera_beside
from tessera.planner import explain_plots as plots
from tessera.errors import TesseraError
from tessera.planner.compare import why_it_lost
from tessera.planner.frameworks import export_plan
from tessera.planner.frameworks.common import FRAMEWORK_NAMES, FRAMEWORKS
from tessera.planner.explain_plots import Block, Bullets, Code, Figure, Section, Table, render_html, render_markdown
from tessera.planner.plan import Plan, format_count
from tessera.planner.plan_facts import (
    PER_LAYER_HEADER, ClusterLayout, GiB, band_sentence, cluster_layout, exposed_comm_by_kind, gib, launch_command,
    mesh_layout, per_layer_rows, seconds, step_terms, tokens, uniform_comparison,
)

STEP_TIME_CHART, MEMORY_CHART, TIMELINE_CHART = "step_time", "memory", "timeline"
REPORT_CHARTS = (STEP_TIME_CHART, MEMORY_CHART)
"""The charts every Markdown report writes beside it, as ``<name>.png``, checked before anything is written
(``tessera plan`` before the search); the pipeline's timeline, only under pp > 1, is checked when written."""


# ------------------------------------------------------------------------------------ report content


def report_title(plan: Plan) -> str:
    """The report's title."""
    return f"Tessera plan: {plan.model_name} on {plan.cluster}"


def report_sections(plan: Plan, *, plan_path: str = "plan.json") -> list[Section]:
    """Every section of the strategy report, charts rendered."""
    layout = cluster_layout(plan)
    return [
        _overview(plan, layout),
        *_unavailable(plan),
        _strategy(plan, per_node=layout.per_node),
        *_per_layer(plan),
        _prediction(plan),
        _breakdown(plan.estimate),
        _memory(plan.estimate),
        _timeline(plan),
        _alternatives(plan),
        *_degrees(plan),
        Section("Search", (Table(("statistic", "value"), tuple(solver_statistics(plan))),)),
        _launch(plan, layout, plan_path=plan_path),
        *framework_sections(plan),
    ]


def solver_statistics(plan: Plan) -> list[tuple[str, str]]:
    """The search's statistics as (label, value) rows, the integer program's included when the plan has them."""
    rows = [("candidates evaluated", f"{plan.candidates_evaluated:,}"), ("search time", seconds(plan.search_time_s))]
    if plan.capture_time_s:
        rows.insert(0, ("model capture time", seconds(plan.capture_time_s)))
    solver = getattr(plan, "solver", None)
    for name, field in (type(solver).model_fields.items() if solver is not None else ()):
        value = getattr(solver, name)
        label = (field.description or name).split("\n")[0].rstrip(".")
        text = seconds(value) if name.endswith("_s") else f"{value:.2%}" if name.endswith("gap") else f"{value:,}"
        rows.append((label[0].lower() + label[1:], text))
    return rows


def _overview(plan: Plan, layout: ClusterLayout) -> Section:
    t, blocks = plan.training, len(plan.block_fqns)
    return Section("Model and cluster", (Table(("item", "value"), (
        ("model", f"{plan.model_name}: {format_count(plan.param_count)} parameters, {len(plan.layers)} layers ({blocks} blocks)"),
        ("cluster", f"{plan.cluster}: {layout.nodes} node{'s' * (layout.nodes > 1)} x {layout.per_node} "
                    f"{plan.device_name}{_hosts(layout)}, {plan.estimate.memory_budget_bytes / GiB:.0f} GiB each"),
        ("training", f"global batch {t.global_batch} x {t.seq_len} tokens = {t.tokens_per_step:,} tokens per step, "
                     f"{plan.precision_summary()}"),
    )),))


def _hosts(layout: ClusterLayout) -> str:
    """`` on 36 hosts of 4`` where a node spans several hosts (GB200 NVL72), else nothing."""
    return f" on {layout.hosts} hosts of {layout.per_host}" if layout.hosts != layout.nodes else ""


def recompute_summary(plan: Plan) -> str:
    """Activation policy of the plan's blocks: ``full on every block`` or ``full on 69 blocks, none on 11``, and
    the ZeRO-3 blocks that keep their gathered weights."""
    counts: dict[str, int] = {}
    for layer in plan.layers:
        if layer.kind == "block":
            counts[layer.recompute] = counts.get(layer.recompute, 0) + 1
    if len(counts) <= 1:
        text = f"{next(iter(counts), plan.strategy.recompute)} on every block"
    else:
        text = ", ".join(f"{policy} on {count} blocks" for policy, count in counts.items())
    keeping = sum(layer.kind == "block" and not layer.reshard for layer in plan.layers)
    return text + (f"; {keeping} blocks keep their gathered weights to their backward" if keeping else "")


def chunk_block_counts(plan: Plan) -> list[int]:
    """Blocks in each pipeline chunk of the plan, in chunk order."""
    chunks = plan.chunk_fqns()
    kinds = {layer.fqn: layer.kind for layer in plan.layers}
    return [sum(kinds[fqn] == "block" for fqn in chunk) for chunk in chunks]


def _strategy(plan: Plan, *, per_node: int) -> Section:
    s, e = plan.strategy, plan.estimate
    facts = list(mesh_layout(s, devices_per_node=per_node))
    facts.append(f"micro-batch {s.micro_batch} sequence(s), {e.micro_batches} micro-batch"
                 f"{'' if e.micro_batches == 1 else 'es'} per step per dp rank")
    facts.append(f"ZeRO stage {s.zero}" + (f" ({s.name})" if s.dp > 1 else "") + (", sequence parallelism" if s.sp else ""))
    facts.append(f"recompute {recompute_summary(plan)}")
    if s.pp > 1:
        chunks = f" with {s.virtual_stages} chunks per stage" if s.virtual_stages > 1 else ""
        sizes = "/".join(map(str, chunk_block_counts(plan)))
        facts.append(f"pipeline schedule {s.schedule}{chunks}; blocks per chunk {sizes}")
    return Section("Strategy", (f"{s.name}: `{s.to_string()}`", Bullets(tuple(facts))))


def _per_layer(plan: Plan) -> list[Section]:
    """Each layer's sharding, activation policy, memory and time, and what the best uniform plan would cost
    (no section for a plan written before per-layer costs)."""
    if not any(layer.time_s for layer in plan.layers):
        return []
    text = ("Each layer as the plan runs it: memory is its model state and saved activations on one device at its "
            "peak, time its forward, backward, recomputation and communication per micro-batch on one device "
            "(consecutive layers alike share a row).")
    return [Section("Per-layer plan", (uniform_comparison(plan), text, Table(PER_LAYER_HEADER, tuple(per_layer_rows(plan)))))]


def _prediction(plan: Plan) -> Section:
    e = plan.estimate
    rows = (
        ("step time", seconds(e.step_time_s)),
        *((("likely step time", band.describe(e.step_time_s)),) if (band := plan.error_band()) else ()),
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
    chart = Figure(STEP_TIME_CHART, "Step time by term (hidden communication counts only as contention)",
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
    chart = Figure(MEMORY_CHART, "Peak memory per pipeline stage by category; the dashed line is the device's memory",
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
    chart = Figure(TIMELINE_CHART, f"Pipeline timeline ({title})", plots.timeline_chart(ops, stages=len(stage_times), title=title))
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
    band = band_sentence(plan)
    return Section("Alternatives", (text, Table(header, rows), *((band,) if band else ())))


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


def _launch(plan: Plan, layout: ClusterLayout, *, plan_path: str) -> Section:
    if (refused := plan.not_on_the_runtime()) is not None:
        return Section("Launch", (f"Not on Tessera's runtime: {refused}.",))
    hosts = layout.hosts
    command = launch_command(nodes=hosts, devices_per_node=layout.per_host, plan_path=plan_path)
    text = (f"Run on each of the {hosts} host(s); `train.py` reads the plan with `tessera.Plan.from_json` and "
            "applies it with `tessera.runtime.apply.apply_plan`.")
    if hosts > 1:
        text += " Set `HEAD_NODE` to the first host's address."
    return Section("Launch", (text, Code(command)))


FENCES = {"megatron": "sh", "torchtitan": "python", "deepspeed": "json"}


def framework_sections(plan: Plan) -> list[Section]:
    """One section per framework: the plan as its configuration, after the launch line."""
    return [_framework(plan, name) for name in FRAMEWORKS]


def _framework(plan: Plan, framework: str) -> Section:
    """The plan as ``framework``'s configuration (``planner.frameworks``), or why that framework cannot run it."""
    title = f"As {FRAMEWORK_NAMES[framework]} configuration"
    try:
        export = export_plan(plan, framework)
    except TesseraError as exc:
        return Section(title, (f"Not expressible: {exc}.",))
    text = (f"`tessera plan ... --format {framework}` prints this and Tessera's estimate of what "
            f"{FRAMEWORK_NAMES[framework]} runs where that differs from the plan.")
    differences = (["Differences from the plan:", Bullets(export.notes)] if export.notes else
                   [f"{FRAMEWORK_NAMES[framework]} runs the plan as planned."])
    return Section(title, (text, *differences, Code(export.text, language=FENCES[framework])))


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
    for chart in REPORT_CHARTS:  # before any is written: a user's file of that name stops the report whole
        png = target.parent / f"{chart}.png"
        check_writable_file(png, what="report chart", replace_any=written_by_tessera_beside(png, target))
    return write_text_atomically(target, plan_markdown(plan, plan_path=plan_path, figure_dir=target.parent), what="report")


def write_html(plan: Plan, path: str | Path, *, plan_path: str = "plan.json") -> Path:
    """Write the self-contained HTML report to ``path`` atomically."""
    target = check_writable_file(path, what="report")
    return write_text_atomically(target, plan_html(plan, plan_path=plan_path), what="report")
