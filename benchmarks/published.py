"""Tessera's prediction for every published run with a measured throughput, and the calibration fit.

Run: ``.venv/bin/python benchmarks/published.py`` (about 4 minutes on an idle 2-core machine); ``--rows REGEX``
evaluates only the matching runs with the calibration in use (no fit, no file written: seconds per row),
``--no-fit`` and ``--no-own-plan`` skip the grid fit and Tessera's own plans. For each run in ``benchmarks/reference/``
(``published_runs.yaml``, a copy of the shared calibration set annotated with each row's framework, and
``fsdp_fp8_runs.yaml``, PyTorch FSDP and FP8 runs; every row with its source; ``published_rows``) it pins what the source states (tp, pp, dp, cp, ZeRO,
micro-batch, sequence parallelism, recompute, schedule, precision), lets the planner fill what it leaves out,
evaluates it as the framework that ran it (``cost_models.profiles``) and compares the predicted step time with
the published one. Published step time is the source's own: given directly (Korthikanti et al.), its tokens
per GPU per second (llm-foundry, torchtitan, NeMo), or its FLOP count divided by its TFLOP/s per GPU (SC'21
eq. 3 counts the recomputed forward; Megatron-Core's table counts model FLOPs only).

It then fits the calibration constants on the TRAIN_IDS split (grid search, least mean |log error|,
strategies held fixed), in turn: the compute constants on the bf16 rows, DeepSpeed's ZeRO-3 slowdown on its
rows, the FP8 efficiency curve on the FP8 rows, the ring's attention slowdown on the context-parallel rows, the
straggler jitter on all of them; and reports the error on
the held-out rows, per regime (``published_rows.regime``). Writes ``benchmarks/results/published-<hardware>-<date>.md``
and the held-out rows' error band per regime, ``cost_models/error_bands.json``, which every plan's report quotes.
Pairs of runs of one workload (model, cluster, batch) in two configurations are judged too: the error of the
predicted ratio of their step times and whether the faster is named right (``workload_pairs``): how a planner's
choice is judged; the band of the pairs with a held-out run (``error_bands.gap_band``) decides which runners-up and baselines are
within the cost model's error of the plan.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import re
import platform
import statistics
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch
from rich.console import Console
from rich.table import Table

from goal_stats import goal_summary
from published_plot import Point, write_chart
from published_rows import (
    cluster_spec, framework_profile, measured_runs, model_spec, mtp_modules, pins, published_step_s, regime, runtime_only,
    training_config,
)
from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import GPU_CALIBRATION, Calibration
from tessera.cost_models.error_bands import write_bands
from tessera.cost_models.profiles import DEEPSPEED, ImplementationProfile
from tessera.errors import InfeasiblePlanError
from tessera.planner.capture import capture_preset
from tessera.planner.layer_graph import LayerGraph, with_mtp_modules
from tessera.planner.plan import Plan
from tessera.planner.search import search
from tessera.planner.space import runtime_refusal, strategies
from tessera.topology import load_cluster

HERE = Path(__file__).resolve().parent
# Calibration split, fixed here so the held-out error means something: every other row of each source
# table by model size trains; the rest (and every run of a table's other half) tests.
TRAIN_IDS = frozenset({
    "megatron-sc21-t1-1.7b", "megatron-sc21-t1-7.5b", "megatron-sc21-t1-39.1b", "megatron-sc21-t1-145.6b",
    "megatron-sc21-t1-529.6b", "megatron-sc21-t2-zero3-174.6b-384gpu", "megatron-sc21-t2-zero3-174.6b-768gpu",
    "megatron-sc21-t2-ptdp-174.6b-384gpu",
    "megatron-sc21-t2-ptdp-529.6b-1120gpu", "megatron-core-h100-weak-1.7b", "megatron-core-h100-weak-16b",
    "megatron-core-h100-weak-70b", "megatron-core-h100-weak-177b", "megatron-core-h100-weak-462b",
    "korthikanti-22B-seqsel", "korthikanti-175B-full", "korthikanti-530B-seqsel", "korthikanti-1T-full",
    # fsdp_fp8_runs.yaml: every other row of each source table, in the file's order
    "foundry-h100-mpt70b-s2048-64gpu", "foundry-h100-mpt30b-s2048-32gpu", "foundry-h100-mpt13b-s2048-64gpu",
    "foundry-h100-mpt7b-s2048-8gpu", "foundry-h100-mpt3b-s2048-64gpu", "foundry-h100-mpt3b-s512-8gpu",
    "foundry-h100-mpt1b-s32768-8gpu", "foundry-h100-fp8-mpt3b-s8192-8gpu", "foundry-h100-fp8-mpt3b-s512-8gpu",
    "foundry-h100-fp8-mpt1b-s512-8gpu", "foundry-a100-mpt70b-s2048-64gpu", "foundry-a100-mpt13b-s4096-8gpu",
    "foundry-a100-mpt3b-s2048-8gpu", "foundry-a100-mpt350m-s2048-8gpu", "foundry-a100-40-mpt70b-s2048-128gpu",
    "foundry-a100-40-mpt30b-s2048-128gpu", "foundry-a100-40-mpt7b-s2048-128gpu",
    "torchtitan-a100-llama3-8b-selective-layer-lbs1", "torchtitan-a100-llama3-70b-full-lbs1",
    "torchtitan-a100-llama2-13b-selective-layer-lbs2", "torchtitan-a100-llama2-70b-selective-op-lbs1",
    "torchtitan-h100-llama3-8b-8gpu-s8192-fsdp-torchcompile", "torchtitan-h100-llama3-8b-8gpu-s8192-fsdp-torchcompile-float8",
    "torchtitan-h100-llama3-70b-256gpu-s8192-2d", "torchtitan-h100-llama3-405b-512gpu-s8192-interleaved1f1b",
    "torchtitan-h100-llama3-8b-8gpu-s32768-fsdp8-cp1", "torchtitan-h100-llama3-8b-8gpu-s131072-fsdp2-cp4",
    "torchtitan-h100-llama3-405b-512gpu-s32768-fsdp8-cp1", "torchtitan-h100-llama3-405b-512gpu-s131072-fsdp2-cp4",
    "nemo2407-fp8-gpt3-175b-128gpu", "nemo2407-fp8-llama2-7b-8gpu", "nemo2407-fp8-llama2-70b-64gpu",
    "torchtitan2506-h100-llama3-70b-256gpu-bf16-tp", "torchtitan2506-h100-llama3-70b-256gpu-fp8-tp",
    "torchtitan2506-h100-llama3-8b-64gpu-bf16-tp", "torchtitan2506-h100-llama3-8b-64gpu-fp8-tp",
    "torchtitan2506-h200-llama3-8b-32gpu-fsdp-float8",
    "nemo2403-fp8-llama2-7b-s4k-4gpu-cp1", "nemo2403-fp8-llama2-7b-s16k-16gpu-cp1", "nemo2403-fp8-llama2-7b-s64k-64gpu-cp2",
    "nemo2403-fp8-llama2-7b-s256k-256gpu-cp8", "nemo2403-fp8-llama2-7b-s1024k-1024gpu-cp32",
})
COMPUTE_GRID = {
    "peak_fraction": [round(0.40 + 0.01 * i, 2) for i in range(41)],
    "half_width": [0.0, 80.0, 160.0, 320.0],
    "traffic_factor": [0.0, 1.0, 2.0, 4.0, 8.0],
    "attention_efficiency": [0.0, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7],
}
FP8_GRID = {"fp8_peak_fraction": [round(0.3 + 0.025 * i, 3) for i in range(27)],
            "fp8_half_width": [0.0, 160.0, 320.0, 640.0, 1280.0]}
CP_GRID = {"cp_attention_slowdown": [round(1.0 + 0.05 * i, 2) for i in range(21)]}
ZERO3_SLOWDOWNS = [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0]
JITTERS = [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02]
COLUMNS = ("run", "split", "regime", "gpus", "strategy (pinned + planner-filled)", "published s", "predicted s", "error",
           "GiB (published, error)", "fits", "Tessera's own plan", "its step s", "speedup")


@cache
def own_plan(spec: str, cluster: str, training: TrainingConfig, mtp_layers: int = 0) -> Plan:
    """Tessera's unpinned plan for the run's model, cluster and batch (same cost model, Tessera's runtime; with the
    run's multi-token-prediction modules, priced as if it ran them, to compare like with like)."""
    return search(graph_for(spec, training.seq_len, mtp_layers), load_cluster(cluster), training)


@cache
def graph_for(spec: str, seq_len: int, mtp_layers: int = 0) -> LayerGraph:
    """The model ``spec`` captured at ``seq_len``, with the multi-token-prediction modules its run trained."""
    return with_mtp_modules(capture_preset(spec, seq_len=seq_len, dtype=torch.bfloat16), mtp_layers)


def run_graph(run: dict) -> LayerGraph:
    """The graph of the run's model as it trained (``model.mtp_layers``: DeepSeek-V3's multi-token prediction)."""
    return graph_for(model_spec(run), run["model"]["seq_len"], mtp_modules(run))


def evaluate_as_run(run: dict, strategy: Strategy, calibration: Calibration, *, deepspeed: float | None = None,
                    profile: ImplementationProfile | None = None):
    """The estimate of ``strategy`` for ``run`` as its framework runs it (``deepspeed``: a ZeRO-3 slowdown to try;
    ``profile``: a variant of the framework's to try instead)."""
    graph, cluster = run_graph(run), load_cluster(cluster_spec(run))
    profile = profile or framework_profile(run)
    if deepspeed is not None and profile.name == DEEPSPEED.name:
        profile = replace(profile, zero3_comm_slowdown=deepspeed)
    return estimate(graph.layers, cluster, training_config(run), strategy, calibration=calibration, profile=profile)


def plan_run(run: dict, calibration: Calibration):
    """(strategy, estimate): the fastest strategy under the source's pins that fits (else the fastest), among the
    ZeRO stages its framework runs."""
    graph, cluster = run_graph(run), load_cluster(cluster_spec(run))
    fixed, stages = pins(run), framework_profile(run).zero_stages
    # planner.space applies block_recompute and chunk_blocks pins, not block_reshard: set it on every candidate
    kept = {key: fixed.pop(key) for key in ("block_reshard",) if key in fixed}
    pinned = [fixed] if "zero" in fixed else [{**fixed, "zero": zero} for zero in stages]  # what the framework runs
    # what its framework combines (torchtitan: cp with pp and sp), not only what Tessera's runtime does
    candidates = [s.model_copy(update=kept) for p in pinned for s in strategies(
        list(graph.layers), cluster, training_config(run), p, exclusive=framework_profile(run).refused_together)]
    scored = [(s, evaluate_as_run(run, s, calibration)) for s in candidates]
    fitting = [pair for pair in scored if pair[1].fits] or scored
    return min(fitting, key=lambda pair: pair[1].step_time_s)


def runtime_comparable(run: dict, strategy: Strategy):
    """The published configuration's estimate with only what Tessera's runtime can also do, on Tessera's runtime:
    the fair opponent for Tessera's own plan (it may not fit there: Tessera's runtime keeps more than some
    frameworks do)."""
    graph, cluster = run_graph(run), load_cluster(cluster_spec(run))
    return estimate(graph.layers, cluster, training_config(run), runtime_only(strategy))


def log_error(run: dict, strategy: Strategy, calibration: Calibration, *, deepspeed: float | None = None) -> float:
    predicted = evaluate_as_run(run, strategy, calibration, deepspeed=deepspeed).step_time_s
    return math.log(predicted / published_step_s(run))


def fit_calibration(runs: list[dict], chosen: dict[str, Strategy], *,
                    start: Calibration = GPU_CALIBRATION) -> tuple[Calibration, float]:
    """Grid search on the training split, strategies held fixed, one family of constants at a time: the compute
    constants on the bf16 rows (DeepSpeed's ZeRO-3 and the context-parallel rows aside), DeepSpeed's ZeRO-3 slowdown
    on its rows, the FP8 curve on the FP8 rows, the ring's attention slowdown on the context-parallel rows, then the
    straggler jitter on every training row. Each family is searched one axis at a time over its grid, twice round
    (coordinate descent). Returns the constants and the DeepSpeed slowdown."""
    train = [r for r in runs if r["id"] in TRAIN_IDS]
    by_regime = {name: [r for r in train if regime(r) == name] for name in ("deepspeed-zero3", "fp8", "cp")}
    dense = [r for r in train if regime(r) not in by_regime]
    compute = coordinate_fit(start, COMPUTE_GRID, dense, chosen)
    deepspeed = min(ZERO3_SLOWDOWNS, key=lambda z: _mean_abs_log_error(by_regime["deepspeed-zero3"], chosen, compute, deepspeed=z))
    fp8 = coordinate_fit(compute, FP8_GRID, by_regime["fp8"], chosen) if by_regime["fp8"] else compute
    ring = coordinate_fit(fp8, CP_GRID, by_regime["cp"], chosen) if by_regime["cp"] else fp8
    return coordinate_fit(ring, {"jitter": JITTERS}, train, chosen, rounds=1, deepspeed=deepspeed), deepspeed


def coordinate_fit(start: Calibration, grid: dict[str, list[float]], runs: list[dict], chosen: dict[str, Strategy],
                   *, rounds: int = 2, deepspeed: float | None = None) -> Calibration:
    """``start`` with each field of ``grid`` set in turn to the value of least mean |log error| on ``runs``."""
    best = start
    for _ in range(rounds):
        for name, values in grid.items():
            best = min((replace(best, **{name: v}) for v in values),
                       key=lambda c: _mean_abs_log_error(runs, chosen, c, deepspeed=deepspeed))
    return best


def _mean_abs_log_error(runs: list[dict], chosen: dict[str, Strategy], calibration: Calibration, *, deepspeed=None) -> float:
    if not runs:
        return 0.0
    return statistics.fmean(abs(log_error(r, chosen[r["id"]], calibration, deepspeed=deepspeed)) for r in runs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", metavar="REGEX", help="only the runs whose id matches (no fit, no file written)")
    parser.add_argument("--no-fit", action="store_true", help="skip the calibration grid fit")
    parser.add_argument("--no-own-plan", action="store_true", help="skip Tessera's own unpinned plans")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    runs, console = measured_runs(), Console(width=180)
    subset = args.rows is not None
    if subset:
        runs = [run for run in runs if re.search(args.rows, run["id"])]
    chosen = {run["id"]: plan_run(run, GPU_CALIBRATION) for run in runs}
    fitted, deepspeed = (GPU_CALIBRATION, DEEPSPEED.zero3_comm_slowdown) if subset or args.no_fit else fit_calibration(
        runs, {key: pair[0] for key, pair in chosen.items()})
    console.print(f"grid fit on the train split: {fitted}, DeepSpeed ZeRO-3 slowdown {deepspeed}")
    rows, speedups, memory_errors, unfit, points = [], [], [], [], []
    by_gpu: dict[str, list[float]] = {}
    for run in runs:
        strategy, est = chosen[run["id"]]
        published = published_step_s(run)
        error = est.step_time_s / published - 1
        split = "train" if run["id"] in TRAIN_IDS else "test"
        points.append(Point(run["id"], split == "test", regime(run), published, est.step_time_s))
        by_gpu.setdefault(load_cluster(cluster_spec(run)).device.name, []).append(error)  # the part it is priced as
        training = training_config(run)
        own_cells = ("not planned (--no-own-plan)", "—", "—")
        if not (subset or args.no_own_plan):
            own_cells = own_plan_cells(run, strategy, est, training, speedups)
        memory = f"{est.peak_memory_bytes / 2**30:.1f}"
        if published_gib := run["reported"].get("memory_gib"):
            memory_errors.append(est.peak_memory_bytes / 2**30 / published_gib - 1)
            memory += f" ({published_gib:.1f}, {memory_errors[-1]:+.0%})"
        if not est.fits:
            unfit.append(f"{run['id']} {est.peak_memory_bytes / 2**30:.1f} GiB of {est.memory_budget_bytes / 2**30:.0f}")
        rows.append((run["id"], split, regime(run), str(run["hardware"]["gpus"]), strategy.to_string(), f"{published:.2f}",
                     f"{est.step_time_s:.2f}", f"{error:+.1%}", memory, "yes" if est.fits else "NO", *own_cells))
    errors = [("test" if p.held_out else "train", p.regime, abs(p.error)) for p in points]
    train_log_errors = [abs(math.log1p(p.error)) for p in points if not p.held_out]
    held_out: dict[str, list[float]] = {}  # published over predicted, by regime: the error bands' input
    for point in (p for p in points if p.held_out):
        held_out.setdefault(point.regime, []).append(point.published_s / point.predicted_s)
    pairs = workload_pairs(runs, {key: pair[1].step_time_s for key, pair in chosen.items()})
    summary = (summarize(errors, fitted, deepspeed) + device_bias(by_gpu) + memory_summary(memory_errors, unfit, len(runs))
               + pair_summary(pairs))
    if train_log_errors:  # what the fit minimises, with the calibration in use
        summary += f"\n- calibration objective (mean |log error| over the train split): {statistics.mean(train_log_errors):.4f}"
    if held_out:  # the same measure on the rows the fit never sees
        held_out_log = [abs(math.log(ratio)) for ratios in held_out.values() for ratio in ratios]
        summary += f"\n- held out, mean |log error|: {statistics.mean(held_out_log):.4f}"
        held_out_errors = [abs(p.error) for p in points if p.held_out]
        summary += (f"\n- held out, median |error| to two decimals (against the 4% goal): "
                    f"{statistics.median(held_out_errors):.2%}\n" + goal_summary(held_out_errors))
    summary += "" if not speedups else plan_quality(speedups)
    table = Table(title="Published runs: step time, predicted vs published")
    for column in COLUMNS:
        table.add_column(column, no_wrap=column != "strategy (pinned + planner-filled)")
    for row in rows:
        table.add_row(*row)
    if subset:  # the strategy in full, one run a line
        for row in rows:
            console.print(" | ".join(row[:10]), soft_wrap=True)
    else:
        console.print(table)
    console.print(summary)
    if not subset:
        markdown = write_markdown(rows, summary)
        print(f"written {write_chart(points, markdown.with_suffix('.png')).relative_to(HERE.parent)}")
        band_file = write_bands(held_out, source=f"benchmarks/published.py, held-out rows, {datetime.date.today().isoformat()}",
                                pair_ratios=[p.ratio for p in pairs if p.held_out])
        print(f"written {band_file.relative_to(HERE.parent)} (the error band of each regime, and of a gap)")


def plan_quality(speedups: list[Speedup]) -> str:
    """The summary line on Tessera's own plans against the published configurations that run on its runtime."""
    fair = [x.ratio for x in speedups if x.opponent_runs]
    other = [x.ratio for x in speedups if not x.opponent_runs]
    return (f"\n- plan quality: Tessera's own plan is predicted at least as fast as the published configuration in "
            f"{sum(x >= 0.999 for x in fair)} of the {len(fair)} runs whose configuration Tessera's runtime can run "
            f"(median speedup {statistics.median(fair):.2f}x, worst {min(fair):.2f}x; same cost model, own plan always "
            "fits; a published configuration is compared on Tessera's runtime: without TP overlap, with the runtime's "
            "sequence parallelism and its FSDP2); "
            f"{len(other)} more do not fit there or combine what it refuses "
            f"(speedups {', '.join(f'{x:.2f}x' for x in sorted(other))})")


def own_plan_cells(run: dict, strategy: Strategy, est, training: TrainingConfig, speedups: list[Speedup]) -> tuple[str, ...]:
    """The table's cells for Tessera's own plan of ``run``'s case (its speedup appended to ``speedups``)."""
    try:
        own = own_plan(model_spec(run), cluster_spec(run), training, mtp_modules(run))
    except InfeasiblePlanError:  # the published run fits only by what Tessera's runtime does not do
        return ("none fits on Tessera's runtime", "—", "—")
    opponent = runtime_comparable(run, strategy)
    refused = runtime_refusal(strategy, training, own.unavailable_axes)
    speedups.append(Speedup(opponent.step_time_s / own.estimate.step_time_s, opponent.fits and refused is None))
    why = (f" (published does not run on Tessera's runtime: {refused})" if refused
           else "" if opponent.fits else " (published does not fit on Tessera's runtime)")
    return own.strategy.to_string(), f"{own.estimate.step_time_s:.2f}", f"{speedups[-1].ratio:.2f}x{why}"


class Speedup(NamedTuple):
    """Tessera's own plan against the published configuration run on Tessera's runtime."""

    ratio: float
    opponent_runs: bool
    """Whether Tessera's runtime can run the published configuration: it fits in memory there and combines nothing
    the runtime refuses (``cost_models.types.RUNTIME_EXCLUSIVE``); else it is no real alternative."""


class Pair(NamedTuple):
    """Two published runs of one workload (model, cluster, global batch and length) in two configurations."""

    first: str
    second: str
    published: float
    """The first's published step time over the second's."""
    predicted: float
    """The same ratio, predicted."""

    @property
    def held_out(self) -> bool:
        return not {self.first, self.second} <= TRAIN_IDS

    @property
    def ratio(self) -> float:
        """Published ratio over predicted ratio: 1 when the prediction has the gap between them right."""
        return self.published / self.predicted

    @property
    def ordered_right(self) -> bool:
        """Whether the prediction names the faster of the two (a published gap under ``TIE``: either answer)."""
        return abs(math.log(self.published)) < math.log1p(TIE) or (self.published > 1) == (self.predicted > 1)


TIE = 0.02
"""Published step times within 2% of each other: the sources' run-to-run noise, no faster one to name."""


def workload_pairs(runs: list[dict], predicted_s: dict[str, float]) -> list[Pair]:
    """Every pair of runs of the same workload in another configuration (strategy, recompute, precision, framework)
    measured by one source document (two documents' runs of one configuration differ by their software versions):
    how a planner's choice between two configurations is judged, which the error of each alone does not show (two
    predictions of one workload share their biases)."""
    by_workload: dict[tuple, list[dict]] = {}
    for run in runs:
        document = run["source"].split(",")[0]  # e.g. "pytorch/torchtitan docs/performance.md (commit eaea6f6a2fa9)"
        key = (model_spec(run), cluster_spec(run), run["training"]["global_batch"], run["model"]["seq_len"], document)
        by_workload.setdefault(key, []).append(run)
    return [Pair(a["id"], b["id"], published_step_s(a) / published_step_s(b), predicted_s[a["id"]] / predicted_s[b["id"]])
            for group in by_workload.values() for a, b in itertools.combinations(group, 2)]


def pair_summary(pairs: list[Pair]) -> str:
    """The pairs' relative error and how often the faster configuration is named right, all and held out."""
    lines = []
    for name, chosen in (("all", pairs), ("with a held-out run", [p for p in pairs if p.held_out])):
        if chosen:
            errors = [abs(p.ratio - 1) for p in chosen]
            lines.append(f"- pairs of one workload in two configurations, {name}: {len(chosen)}; the gap between them "
                         f"predicted within median {statistics.median(errors):.1%}, worst {max(errors):.1%}; the faster "
                         f"named right in {sum(p.ordered_right for p in chosen)} of {len(chosen)} (a gap under "
                         f"{TIE:.0%}: either)")
    wrong = [p for p in pairs if not p.ordered_right]
    if wrong:
        lines.append("- named wrong: " + "; ".join(f"{p.first} / {p.second}: published {p.published:.2f}, predicted "
                                                   f"{p.predicted:.2f}" for p in wrong))
    return "".join("\n" + line for line in lines)


def summarize(errors: list[tuple[str, str, float]], fitted: Calibration, deepspeed: float) -> str:
    """Median and worst |error| per split, and per regime on the held-out and on the training rows."""
    groups = {"train": [e for s, _, e in errors if s == "train"], "test (held out)": [e for s, _, e in errors if s == "test"],
              "all": [e for _, _, e in errors]}
    for name in sorted({r for _, r, _ in errors}):
        groups[f"held out, {name}"] = [e for s, r, e in errors if s == "test" and r == name]
    for name in sorted({r for _, r, _ in errors}):
        groups[f"train, {name}"] = [e for s, r, e in errors if s == "train" and r == name]
    lines = [f"- {name}: median |error| {statistics.median(v):.1%}, worst {max(v):.1%} over {len(v)} runs"
             for name, v in groups.items() if v]
    lines.append(f"- calibration in use: {GPU_CALIBRATION}, DeepSpeed ZeRO-3 slowdown {DEEPSPEED.zero3_comm_slowdown}; "
                 f"grid fit on the train split: {fitted}, DeepSpeed ZeRO-3 slowdown {deepspeed}")
    return "\n".join(lines)


def device_bias(by_gpu: dict[str, list[float]]) -> str:
    """The signed median error of every GPU's runs, both splits (+: predicted slower than published): a part whose
    runs all lean one way shows what one share of peak for every GPU leaves out."""
    parts = [f"{gpu} {statistics.median(v):+.1%} ({min(v):+.1%} to {max(v):+.1%}, {len(v)} runs)"
             for gpu, v in sorted(by_gpu.items())]
    return "\n- by GPU, signed median error (+: predicted slower), all runs: " + "; ".join(parts)


def memory_summary(errors: list[float], unfit: list[str], runs: int) -> str:
    """Peak memory against the runs that publish it (torchtitan's tables: its logged peak reserved memory, which the
    caching allocator's fragmentation puts above what tensors hold), and the runs predicted not to fit: each ran, so
    each is a prediction too high by at least its excess."""
    lines = ""
    if errors:
        low, high = min(errors), max(errors)
        lines += (f"\n- peak memory per GPU against the {len(errors)} runs that publish it (torchtitan's peak reserved "
                  f"memory): median |error| {statistics.median(map(abs, errors)):.1%}, from {low:+.1%} to {high:+.1%}")
    return lines + (f"\n- runs predicted not to fit the memory they ran in: {len(unfit)} of {runs}"
                    + (f" ({'; '.join(unfit)})" if unfit else ""))


def write_markdown(rows: list[tuple[str, ...]], summary: str) -> Path:
    date = datetime.date.today().isoformat()
    out = HERE / "results" / f"published-{platform.machine()}-cpu-{date}.md"
    lines = [
        f"# Published runs vs Tessera's prediction ({date})", "",
        "Command: `.venv/bin/python benchmarks/published.py`. Data and sources: `benchmarks/reference/published_runs.yaml`, "
        "`benchmarks/reference/fsdp_fp8_runs.yaml`.", "",
        f"![Predicted against published step time, and each run's error by regime]({out.with_suffix('.png').name})", "",
        summary, "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    out.write_text("\n".join(lines) + "\n")
    print(f"written {out.relative_to(HERE.parent)}")
    return out


if __name__ == "__main__":
    main()
