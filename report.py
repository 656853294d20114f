"""Terminal rendering of a plan with rich: the strategy, its prediction, memory and the runners-up."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table

from tessera.cost_models import Estimate, Strategy
from tessera.planner.plan import Plan, format_count

GiB = 2**30


def plan_renderable(plan: Plan) -> Group:
    """The plan as rich tables: headline, memory by category, communication, alternatives."""
    return Group(_headline(plan), _memory(plan), _communication(plan), _alternatives(plan))


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the plan's tables to the terminal."""
    (console or Console()).print(plan_renderable(plan))


def _headline(plan: Plan) -> Table:
    e = plan.estimate
    table = Table(title=f"Tessera plan: {plan.model_name} on {plan.cluster}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("model", f"{plan.model_name}: {format_count(plan.param_count)} parameters, {len(plan.layers)} layers"),
        ("cluster", f"{plan.cluster}: {e.memory_budget_bytes / GiB:.0f} GiB {plan.device_name} per device"),
        ("training", f"global batch {plan.training.global_batch} x {plan.training.seq_len} tokens, {plan.training.precision}"),
        ("strategy", f"{plan.strategy.name}  [cyan]{plan.strategy.to_string()}[/]"),
        ("step time", _step_breakdown(e)),
        ("throughput", f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}"),
        ("memory", f"{e.peak_memory_bytes / GiB:.1f} / {e.memory_budget_bytes / GiB:.1f} GiB per device"),
        ("search", f"{plan.candidates_evaluated} strategies estimated in {plan.search_time_s:.2f} s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _step_breakdown(e: Estimate) -> str:
    return (f"{e.step_time_s:.3f} s  (compute {e.compute_time_s:.3f}, recompute {e.recompute_time_s:.3f}, "
            f"bubble {e.bubble_time_s:.3f}, exposed comm {e.exposed_comm_time_s:.3f}, optimizer {e.optimizer_time_s:.3f})")


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
    table = Table(title="Communication per step (before overlap)", title_justify="left")
    table.add_column("kind")
    table.add_column("seconds", justify="right")
    for kind, seconds in e.comm_time_by_kind_s.items():
        table.add_row(kind, f"{seconds:.3f}")
    if not e.comm_time_by_kind_s:
        table.add_row("none (single device)", "0")
    return table


def _alternatives(plan: Plan) -> Table:
    table = Table(title="Runners-up", title_justify="left")
    table.add_column("strategy", no_wrap=True)
    for column in ("step s", "tokens/s", "GiB/device"):
        table.add_column(column, justify="right")
    table.add_column("verdict")
    for candidate in plan.alternatives:
        e = candidate.estimate
        table.add_row(
            candidate.strategy.to_string(), f"{e.step_time_s:.3f}", f"{e.tokens_per_s:,.0f}",
            f"{e.peak_memory_bytes / GiB:.1f}", candidate.verdict,
        )
    return table


def estimate_json(strategy: Strategy, estimate: Estimate) -> dict:
    """The estimate as a flat JSON object (``tessera evaluate --format json``)."""
    e = estimate
    return {
        "strategy": strategy.to_string(),
        "step_time_s": e.step_time_s,
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
            },
            "comm_s_before_overlap": e.comm_time_by_kind_s,
            "memory_bytes": e.memory_by_category_bytes,
            "stage_peak_memory_bytes": list(e.stage_peak_memory_bytes),
        },
    }


def print_estimate(strategy: Strategy, estimate: Estimate, console: Console | None = None) -> None:
    """Print one strategy's estimate: headline, memory and communication tables."""
    e = estimate
    table = Table(title=f"Estimate: {strategy.to_string()}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    fits = "[green]fits[/]" if e.fits else f"[red]does not fit: {(e.peak_memory_bytes - e.memory_budget_bytes) / GiB:.1f} GiB over[/]"
    for key, value in (
        ("step time", _step_breakdown(e)),
        ("throughput", f"{e.tokens_per_s:,.0f} tokens/s; {e.model_tflops_per_device:.0f} model TFLOP/s per device "
                       f"(MFU {e.mfu:.1%}); {e.hardware_tflops_per_device:.0f} hardware TFLOP/s (HFU {e.hfu:.1%})"),
        ("memory", f"{e.peak_memory_bytes / GiB:.1f} / {e.memory_budget_bytes / GiB:.1f} GiB per device, {fits}"),
    ):
        table.add_row(key, value)
    (console or Console()).print(Group(table, _memory_table(e), _communication_table(e)))
