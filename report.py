"""Terminal rendering with rich: a plan (strategy, mesh layout, prediction, memory, runners-up, launch line)
and a comparison of the plan with hand-tuned baselines.

Text that came from the user (model, cluster and device names, baseline strings, reasons quoting them) goes
through :func:`literal` before it joins a markup string, so ``foo[/bar]`` prints as typed instead of breaking the
render; the consoles made here also leave ``:name:`` alone (no emoji), so ``hf:llama:`` is not a llama. A console
passed in should be made with ``emoji=False`` for the same reason (the CLI's is).
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from tessera.cost_models import Estimate, Strategy
from tessera.cost_models.error_bands import ErrorBand
from tessera.cost_models.units import format_in, format_seconds, seconds_unit
from tessera.topology.validation import printable
from tessera.planner.compare import BaselineComparison, Comparison, why_it_lost
from tessera.planner.plan_facts import (
    PER_LAYER_HEADER, band_sentence, cluster_layout, launch_command, mesh_layout, per_layer_rows, step_terms,
    tokens, uniform_comparison,
)
from tessera.planner.plan import Plan, format_count

GiB = 2**30


def literal(value: object) -> str:
    """``value`` as text that rich markup shows exactly as it is (``[`` escaped), its control characters as escapes
    (a received plan's model name reaches the terminal here)."""
    return escape(printable(str(value)))


def _console(console: Console | None) -> Console:
    return console or Console(emoji=False)


def plan_renderable(plan: Plan, *, launch: str | None = None) -> Group:
    """The plan as rich tables: headline, memory by category, communication, alternatives. ``launch`` replaces the
    headline's launch line (the torchrun line reading ``plan.json``) where the caller launches otherwise."""
    parts = [_headline(plan, launch=launch), _memory(plan), _communication(plan), _alternatives(plan)]
    if any(layer.time_s for layer in plan.layers):
        parts.insert(1, _per_layer(plan))
    if plan.degree_alternatives:
        parts.append(_degree_alternatives(plan))
    return Group(*parts)


def print_plan(plan: Plan, console: Console | None = None, *, launch: str | None = None) -> None:
    """Print the plan's tables to the terminal (``launch``: see :func:`plan_renderable`)."""
    _console(console).print(plan_renderable(plan, launch=launch))


def _headline(plan: Plan, *, launch: str | None = None) -> Table:
    e = plan.estimate
    layout = cluster_layout(plan)
    table = Table(title=f"Tessera plan: {literal(plan.model_name)} on {literal(plan.cluster)}", show_header=False,
                  title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = [
        ("model", f"{literal(plan.model_name)}: {format_count(plan.param_count)} parameters, "
                  f"{len(plan.layers)} layers"),
        ("cluster", f"{literal(plan.cluster)}: {e.memory_budget_bytes / GiB:.4g} GiB {literal(plan.device_name)} "
                    "per device"),
        ("training", f"global batch {plan.training.global_batch}"
                     + (f" x {plan.training.seq_len} tokens" if plan.token_inputs else " samples (example_inputs)")
                     + f", {plan.precision_summary()}"),
        ("strategy", f"{plan.strategy.name}  [cyan]{literal(plan.strategy.to_string())}[/]"),
        ("mesh", "; ".join(mesh_layout(plan.strategy, devices_per_node=layout.per_node))
                 + f"; {e.micro_batches} micro-batch{'' if e.micro_batches == 1 else 'es'} per step"),
        ("step time", _step_breakdown(e)),
        *((("likely", literal(band.describe(e.step_time_s))),) if (band := plan.error_band()) else ()),
        ("throughput", f"{plan.throughput()}, MFU {e.mfu:.1%}, HFU {e.hfu:.1%} "
                       f"({_tflops(e.model_tflops_per_device)} model TFLOP/s per device)"),
        ("memory", f"{e.peak_memory_bytes / GiB:.1f} / {e.memory_budget_bytes / GiB:.1f} GiB per device"),
        *((f"no {axis}", literal(reason)) for axis, reason in plan.unavailable_axes.items()),
        *(("", literal(f"{c.verdict} ({c.strategy.to_string()}, {format_seconds(c.estimate.step_time_s)} per step)"))
          for c in plan.unavailable_gains),
        ("search", _search_line(plan)),
        ("launch", literal(plan.not_on_the_runtime() or launch
                           or launch_command(nodes=layout.hosts, devices_per_node=layout.per_host))),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _search_line(plan: Plan) -> str:
    line = (f"{plan.candidates_evaluated:,} {'strategy' if plan.candidates_evaluated == 1 else 'strategies'} "
            f"estimated in {plan.search_time_s:.2f} s")
    if plan.capture_time_s:
        line = f"model captured in {plan.capture_time_s:.2f} s; {line}"
    solver = getattr(plan, "solver", None)
    if getattr(solver, "ilp_solved", 0):
        line += (f"; {solver.ilp_solved} integer programs in {solver.ilp_time_s:.2f} s (worst gap {solver.worst_gap:.1%}), "
                 f"{solver.ilp_improvements} beat the best uniform strategy")
    return line


def _per_layer(plan: Plan) -> Table:
    """Each layer's sharding, activation policy, memory and time (alike neighbours on one row), captioned with
    what the best uniform plan would cost."""
    table = Table(title="Per-layer plan", title_justify="left", caption=literal(uniform_comparison(plan)),
                  caption_justify="left")
    for column in PER_LAYER_HEADER:
        table.add_column(column, overflow="fold", justify="right" if column.startswith(("memory", "ms")) else "left")
    for row in per_layer_rows(plan):
        table.add_row(*map(literal, row))
    return table


def _tflops(value: float) -> str:
    """``412`` TFLOP/s on a GPU; three significant figures where that would print 0 (a CPU, a tiny model)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"


def _step_breakdown(e: Estimate) -> str:
    unit = seconds_unit(e.step_time_s)
    parts = [("compute", e.compute_time_s), ("recompute", e.recompute_time_s), ("bubble", e.bubble_time_s),
             ("exposed comm", e.exposed_comm_time_s), ("optimizer", e.optimizer_time_s),
             ("stragglers", e.straggler_time_s), ("overlap contention", e.contention_time_s or None),
             ("exposed offload", e.offload_time_s or None)]
    shown = ", ".join(f"{name} {format_in(value, unit)}" for name, value in parts if value is not None)
    return f"{format_in(e.step_time_s, unit)} {unit[1]}  ({shown})"


def _memory(plan: Plan) -> Table:
    return _memory_table(plan.estimate)


def _memory_table(e: Estimate) -> Table:
    table = Table(title="Memory per device", title_justify="left")
    table.add_column("category")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    for name, value in e.memory_by_category_bytes.items():
        table.add_row(name, f"{value / GiB:.2f}", f"{value / e.peak_memory_bytes:.0%}")
    table.add_row("[bold]total[/]", f"[bold]{e.peak_memory_bytes / GiB:.2f}[/]", f"{e.peak_memory_bytes / e.memory_budget_bytes:.0%} of device")
    return table


def _communication(plan: Plan) -> Table:
    return _communication_table(plan.estimate)


def _communication_table(e: Estimate) -> Table:
    unit = seconds_unit(max(e.comm_time_by_kind_s.values(), default=e.step_time_s))
    table = Table(title="Communication per step (before overlap)", title_justify="left")
    table.add_column("kind")
    table.add_column("seconds" if unit[1] == "s" else unit[1], justify="right")
    for kind, seconds in e.comm_time_by_kind_s.items():
        table.add_row(kind, format_in(seconds, unit))
    if not e.comm_time_by_kind_s:
        table.add_row("none (single device)", "0")
    return table


def _alternatives(plan: Plan) -> Table:
    table = Table(title="Runners-up", title_justify="left", caption=literal(band_sentence(plan) or ""), caption_justify="left")
    unit = seconds_unit(plan.estimate.step_time_s)
    table.add_column("rank", justify="right", no_wrap=True)  # the plan is 1, as the caption counts
    table.add_column("strategy", overflow="fold", ratio=3)
    for column in (f"step {unit[1]}", "tokens/s", "GiB/device"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("why it lost", ratio=2)
    for rank, candidate in enumerate(plan.alternatives, start=2):
        e = candidate.estimate
        table.add_row(
            str(rank), literal(candidate.strategy.to_string()), format_in(e.step_time_s, unit), f"{e.tokens_per_s:,.0f}",
            f"{e.peak_memory_bytes / GiB:.1f}", literal(why_it_lost(e, plan.estimate, candidate.verdict, values=False)),
        )
    return table


def _degree_alternatives(plan: Plan) -> Table:
    """The best strategy at every other expert-/context-parallel degree: why the plan's degrees won."""
    s = plan.strategy
    table = Table(title=f"Why ep={s.ep}, cp={s.cp}: the best strategy at each other degree", title_justify="left")
    unit = seconds_unit(plan.estimate.step_time_s)
    table.add_column("degree", no_wrap=True)
    table.add_column("strategy", overflow="fold", ratio=3)
    for column in (f"step {unit[1]}", "GiB/device"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("why it lost", ratio=2)
    for candidate in plan.degree_alternatives:
        e = candidate.estimate
        degree, _, verdict = candidate.verdict.partition(": ")
        table.add_row(literal(degree), literal(candidate.strategy.to_string()), format_in(e.step_time_s, unit),
                      f"{e.peak_memory_bytes / GiB:.1f}",
                      literal(why_it_lost(e, plan.estimate, verdict, values=False)))
    return table


def estimate_json(strategy: Strategy, estimate: Estimate, *, band: ErrorBand | None = None) -> dict:
    """The estimate as a flat JSON object (``tessera evaluate --format json``); with ``band``, where the step time
    likely falls (``likely_step_time_s``: low and high, and the held-out runs of its regime)."""
    e = estimate
    likely = {} if band is None else {"likely_step_time_s": list(band.range_s(e.step_time_s)), "likely_regime": band.regime,
                                      "likely_runs": band.runs}
    return {
        "strategy": strategy.to_string(),
        "step_time_s": e.step_time_s,
        **likely,
        "tokens_per_s": e.tokens_per_s,
        "model_tflops_per_device": e.model_tflops_per_device,
        "hardware_tflops_per_device": e.hardware_tflops_per_device,
        "mfu": e.mfu,
        "hfu": e.hfu,
        "peak_memory_bytes": e.peak_memory_bytes,
        "memory_budget_bytes": e.memory_budget_bytes,
        "fits": e.fits,
        "breakdown": {
            "time_s": {
                "compute": e.compute_time_s, "recompute": e.recompute_time_s, "bubble": e.bubble_time_s,
                "exposed_comm": e.exposed_comm_time_s, "optimizer": e.optimizer_time_s,
                "stragglers": e.straggler_time_s, "offload": e.offload_time_s, "contention": e.contention_time_s,
            },
            "comm_s_before_overlap": e.comm_time_by_kind_s,
            "memory_bytes": e.memory_by_category_bytes,
            "stage_peak_memory_bytes": list(e.stage_peak_memory_bytes),
        },
    }


def print_estimate(strategy: Strategy, estimate: Estimate, console: Console | None = None, *,
                   band: ErrorBand | None = None) -> None:
    """Print one strategy's estimate: headline (with ``band``, where the step time likely falls), memory and
    communication tables."""
    e = estimate
    table = Table(title=f"Estimate: {literal(strategy.to_string())}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    fits = "[green]fits[/]" if e.fits else f"[red]does not fit: {(e.peak_memory_bytes - e.memory_budget_bytes) / GiB:.1f} GiB over[/]"
    for key, value in (
        ("step time", _step_breakdown(e)),
        *((("likely", literal(band.describe(e.step_time_s))),) if band else ()),
        ("throughput", f"{e.tokens_per_s:,.0f} tokens/s; {_tflops(e.model_tflops_per_device)} model TFLOP/s per device "
                       f"(MFU {e.mfu:.1%}); {_tflops(e.hardware_tflops_per_device)} hardware TFLOP/s (HFU {e.hfu:.1%})"),
        ("memory", f"{e.peak_memory_bytes / GiB:.1f} / {e.memory_budget_bytes / GiB:.1f} GiB per device, {fits}"),
    ):
        table.add_row(key, value)
    _console(console).print(Group(table, _memory_table(e), _communication_table(e)))


def comparison_renderable(comparison: Comparison) -> Group:
    """The plan and each baseline side by side, then each configuration's strategy and why they differ."""
    t = comparison.training
    table = Table(title=f"Tessera vs baselines: {literal(comparison.model_name)} on {literal(comparison.cluster)}, "
                        f"global batch {t.global_batch} x {t.seq_len}", title_justify="left")
    table.add_column("config", no_wrap=True)
    for column in ("step s", "tokens/s", "MFU", "GiB/device", "plan speed-up"):
        table.add_column(column, justify="right", no_wrap=True)
    e = comparison.plan_estimate
    table.add_row("[bold]Tessera[/]", f"{e.step_time_s:.3f}", tokens(e.tokens_per_s), f"{e.mfu:.1%}",
                  f"{e.peak_memory_bytes / GiB:.1f}", "1.00x")
    for index, baseline in enumerate(comparison.baselines, start=1):
        table.add_row(*_baseline_cells(index, baseline))
    details = Table(title="Strategies and why they differ", title_justify="left", show_header=False)
    details.add_column(style="bold", no_wrap=True)
    details.add_column(overflow="fold")
    details.add_row("Tessera", f"[cyan]{literal(comparison.plan_strategy.to_string())}[/] "
                               f"({comparison.candidates_evaluated} strategies searched in {comparison.search_time_s:.2f} s)")
    for index, baseline in enumerate(comparison.baselines, start=1):
        evaluated = f" -> [cyan]{literal(baseline.strategy.to_string())}[/]" if baseline.strategy else ""
        runs_on = "" if baseline.runs_on == "tessera" else f" (priced as {baseline.runs_on} runs it)"
        details.add_row(f"baseline {index}",
                        f"{literal(baseline.requested)}{evaluated}{runs_on}\n{literal(baseline.reason)}")
    return Group(table, details, *((literal(_band_line(comparison)),) if comparison.likely else ()))


def _band_line(comparison: Comparison) -> str:
    """The plan's likely step time, and the baselines that may really be as fast as the plan."""
    inside = comparison.baselines_inside_band()
    line = f"Tessera's likely step time: {comparison.likely}."
    if inside:
        names = ", ".join(f"baseline {i}" for i in inside)
        line += (f" Within the cost model's error of the plan: {names} (predicted at most "
                 f"{comparison.inside_high_s:.3f} s; the error of a predicted gap between two configurations of one "
                 "workload, from published pairs).")
    return line


def _baseline_cells(index: int, baseline: BaselineComparison) -> tuple[str, ...]:
    e = baseline.estimate
    if e is None:
        return (f"baseline {index}", "-", "-", "-", "-", "[red]cannot run[/]")
    memory = f"{e.peak_memory_bytes / GiB:.1f}" + ("" if e.fits else " [red](over)[/]")
    return (f"baseline {index}", f"{e.step_time_s:.3f}", tokens(e.tokens_per_s), f"{e.mfu:.1%}", memory,
            f"{baseline.throughput_ratio:.2f}x")


def print_comparison(comparison: Comparison, console: Console | None = None) -> None:
    """Print the plan-versus-baselines tables to the terminal."""
    _console(console).print(comparison_renderable(comparison))


def comparison_terms_json(comparison: Comparison) -> dict:
    """Step-time terms of the plan and each evaluated baseline, in seconds (for scripts and tests)."""
    result = {"plan": step_terms(comparison.plan_estimate)}
    for index, baseline in enumerate(comparison.baselines, start=1):
        if baseline.estimate is not None:
            result[f"baseline {index}"] = step_terms(baseline.estimate)
    return result
