"""Local truth for per-layer plans: the per-layer plan and the best uniform plan measured side by side (issue 21).

Run: ``.venv/bin/python benchmarks/per_layer_truth.py [--cluster cluster.yaml] [--rounds 5] [--steps 3]``
(a few minutes on 4 gloo ranks). Writes ``benchmarks/results/per-layer-truth-<hardware>-<date>.md`` and the
measurements to the ``.json`` beside it.

The model is small and heterogeneous: Tessera's MoE with one dense first block (DeepSeek-V3's layout in small,
``dense_layers=1``) and three MoE blocks. On an unconstrained budget the best plan is uniform, so the per-device
memory budget is lowered (a planning input; the CPU ranks do not enforce it) from the unconstrained plan's peak in
``--step-mib`` steps until the search returns a per-layer plan, i.e. one whose ``Plan.uniform`` (the best uniform
plan, one activation policy for every block) differs from it. The two plans are then run on the same ranks in
``--rounds`` round-robin rounds, as ``local_truth.py`` confirms its finalists (load drift falls on both alike), and
the report gives the measured ratio (uniform / per-layer median step time) next to the predicted one. Timing,
memory metering and the journal (``--resume``) are ``local_truth.py``'s.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from local_truth import GLOBAL_BATCH, SEQ_LEN, as_plan, confirm, journal_entries, prepared  # noqa: E402

from tessera.cost_models.memory import CPU_RESERVE_BYTES  # noqa: E402
from tessera.planner.plan import Plan  # noqa: E402
from tessera.planner.search import search  # noqa: E402
from tessera.topology.cluster import Cluster  # noqa: E402

NAME = "moe-dense1"
SPEC = "moe:layers=4,hidden=128,heads=4,kv_heads=2,ffn=128,vocab=2048,seq=256,experts=4,top_k=2,dense_layers=1,dense_ffn=512"


@dataclass(frozen=True)
class Pair:
    """The two plans measured side by side at one memory budget, and whether the search chose the per-layer one."""

    per_layer: Plan
    uniform: Plan
    budget_mib: int
    chosen: bool  # the search's plan at this budget is the per-layer one (else the uniform one is)
    ladder: tuple[str, ...] = ()  # with no per-layer choice: each budget tried and the plan the search chose there


def per_layer_pair(cluster_spec: str, *, step_mib: int, tries: int, budget_mib: int | None = None) -> Pair:
    """The largest budget below the unconstrained peak, in ``step_mib`` steps, at which the search's plan is not
    uniform, with that plan and its best uniform one. Where the plan stays uniform at every budget tried (or at
    ``budget_mib`` when given), the pair is the search's uniform plan and the fastest fitting per-layer candidate
    (``best_per_layer``), at the budget where that candidate comes closest to winning: the measurement then tests
    the prediction that the per-layer plan loses."""
    model = prepared(SPEC, cluster_spec)
    graph, cluster, training = model
    if budget_mib is not None:
        budgets = [budget_mib]
    else:
        peak = int(search(graph, cluster, training).estimate.peak_memory_bytes // 2**20)
        budgets = list(range(peak - step_mib, peak - step_mib * (tries + 1), -step_mib))
    losing, ladder = [], []
    for budget in budgets:
        tight = with_budget(cluster, budget)
        try:
            plan = search(graph, tight, training)
        except Exception:  # noqa: BLE001 - nothing fits any more: stop lowering
            ladder.append(f"{budget} MiB: nothing fits")
            break
        if plan.uniform is not None:
            uniform = as_plan(SPEC, (graph, tight, training), plan.uniform.strategy, plan.uniform.estimate)
            return Pair(plan, uniform, budget, chosen=True)
        ladder.append(f"{budget} MiB: {plan.strategy.to_string()} ({plan.estimate.step_time_s:.3f} s)")
        candidate = best_per_layer(graph, tight, training)
        if candidate is not None:
            losing.append((plan.estimate.step_time_s / candidate.estimate.step_time_s, budget, plan, candidate))
    if not losing:
        raise SystemExit(f"no per-layer candidate fits at {budgets[0]}-{budget} MiB; try --step-mib or --tries")
    _, budget, plan, candidate = max(losing, key=lambda item: item[0])
    uniform = as_plan(SPEC, (graph, with_budget(cluster, budget), training), plan.strategy, plan.estimate)
    return Pair(candidate, uniform, budget, chosen=False, ladder=tuple(ladder))


def with_budget(cluster: Cluster, budget_mib: int) -> Cluster:
    """``cluster`` with a per-device memory budget of ``budget_mib`` (a planning input; CPU ranks do not enforce it)."""
    return cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": budget_mib * 2**20})})


def best_per_layer(graph, cluster: Cluster, training) -> Plan | None:
    """The fastest fitting plan whose blocks do not all share one recomputation policy: every mix of none/full
    over the blocks pinned in turn (the search then picks the mesh, ZeRO stage and micro-batch for each)."""
    blocks = sum(layer.kind == "block" for layer in graph.layers)
    best = None
    for pattern in itertools.product(("none", "full"), repeat=blocks):
        if len(set(pattern)) == 1:
            continue
        try:
            plan = search(graph, cluster, training, pins={"block_recompute": pattern})
        except Exception:  # noqa: BLE001 - this mix fits nowhere at this budget
            continue
        if plan.estimate.fits and (best is None or plan.estimate.step_time_s < best.estimate.step_time_s):
            best = plan
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=None, help="profiled cluster YAML (default: the cpu preset)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per strategy and round")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds of the two plans")
    parser.add_argument("--step-mib", type=int, default=2, help="how far each try lowers the memory budget")
    parser.add_argument("--tries", type=int, default=20, help="budgets tried before giving up")
    parser.add_argument("--budget-mib", type=int, help="measure at this per-device budget instead of scanning for one")
    parser.add_argument("--resume", type=Path, metavar="JOURNAL", help="continue a stopped run's journal")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder for the results (made if absent)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = args.cluster or f"cpu:ranks={args.ranks}"
    stem = args.out / f"per-layer-truth-{platform.machine()}-cpu-{datetime.date.today().isoformat()}"
    journal = args.resume or stem.with_suffix(".jsonl")
    if journal.exists() and not args.resume:
        raise SystemExit(f"{journal} exists: continue it with --resume {journal}, or move it away")
    pair = per_layer_pair(cluster, step_mib=args.step_mib, tries=args.tries, budget_mib=args.budget_mib)
    print(f"budget {pair.budget_mib} MiB: per-layer {pair.per_layer.strategy.to_string()} vs uniform "
          f"{pair.uniform.strategy.to_string()} ({'per-layer' if pair.chosen else 'uniform'} chosen)", flush=True)
    steps = confirm(NAME, SPEC, [pair.per_layer, pair.uniform], args.rounds, args.ranks, args.steps, journal)
    write_results(stem, cluster=cluster, pair=pair, steps=steps, journal=journal, args=args)


def budget_sentence(pair: Pair, args: argparse.Namespace) -> str:
    """How the budget was chosen and which of the two plans the search picks there."""
    if args.budget_mib is not None:
        how = f"a per-device budget of {pair.budget_mib} MiB (given)"
    elif pair.chosen:
        how = (f"a per-device budget of {pair.budget_mib} MiB (the largest, in {args.step_mib} MiB steps below the "
               "unconstrained plan's peak, at which the plan is per-layer)")
    else:
        how = (f"a per-device budget of {pair.budget_mib} MiB (the search's plan is uniform at every budget tried, "
               f"in {args.step_mib} MiB steps below the unconstrained plan's peak; this is the one at which the "
               "fastest per-layer candidate comes closest to it)")
    return how + "; a planning input, not enforced by the CPU ranks"


def verdict_lines(pair: Pair) -> list[str]:
    """Which plan the search picks at the budget, and, where it is the uniform one, what it picked elsewhere."""
    if pair.chosen:
        return ["The search picks the per-layer plan at this budget; the uniform plan is its best uniform rival.", ""]
    slower = pair.per_layer.estimate.step_time_s / pair.uniform.estimate.step_time_s - 1
    if slower >= 0:
        why = f"is predicted {slower:.1%} slower"
    else:  # the estimate prefers it, yet the search's integer program did not find it (planner.refine)
        why = f"is predicted {-slower:.1%} faster, yet the search did not find it"
    lines = [f"**The search picks the uniform plan at this budget, not a per-layer one**: the fastest per-layer "
             f"candidate (every none/full mix over the blocks pinned in turn) {why}. Measured beside it, the pair "
             "tests that prediction.", ""]
    if pair.ladder:
        lines += ["The search's plan at each budget tried: " + "; ".join(pair.ladder) + ".", ""]
    return lines


def write_results(stem: Path, *, cluster: str, pair: Pair, steps: dict[str, list[float]], journal: Path,
                  args: argparse.Namespace) -> None:
    plans = per_layer, uniform = pair.per_layer, pair.uniform
    keys = [plan.strategy.to_string() for plan in plans]
    medians = [statistics.median(steps[key]) for key in keys]
    predicted = [plan.estimate.step_time_s for plan in plans]
    entries = journal_entries(journal, NAME)
    peaks = {e["strategy"]: max(r["peak_bytes"] for r in e["ranks"]) for e in entries}
    cpu = {key: statistics.median(s for e in entries if e["strategy"] == key for r in e["ranks"] for s in r["cpu_s"])
           for key in keys}
    loads = [e["load_average_1m"] for e in entries]
    measured_ratio, predicted_ratio = medians[1] / medians[0], predicted[1] / predicted[0]
    stem.with_suffix(".json").write_text(json.dumps({"budget_mib": pair.budget_mib, "per_layer_chosen": pair.chosen,
                                                     "steps": steps, "predicted_s": dict(zip(keys, predicted))},
                                                     indent=1) + "\n")
    command = " ".join(["benchmarks/per_layer_truth.py", *sys.argv[1:]])
    lines = [
        f"# Per-layer plan vs best uniform plan, measured on {args.ranks} gloo ranks ({datetime.date.today().isoformat()})", "",
        f"Command: `.venv/bin/python {command}` on {os.cpu_count()} cores; cluster `{cluster}` with "
        f"{budget_sentence(pair, args)}. Model "
        f"`{SPEC}` (one dense block, three MoE blocks), {GLOBAL_BATCH} x {SEQ_LEN} tokens per step. "
        f"{args.rounds} round-robin rounds of {args.steps} timed steps each (slowest rank per step); "
        f"1-minute load average per run {min(loads)}-{max(loads)}.", "",
        f"**Measured uniform / per-layer: {measured_ratio:.3f} in wall time, {cpu[keys[1]] / cpu[keys[0]]:.3f} in CPU "
        f"seconds per step; predicted: {predicted_ratio:.3f}.**", "", *verdict_lines(pair),
        "CPU seconds: each rank's user + system time per step (median over ranks and steps); load elsewhere on the "
        "shared cores inflates them far less than wall time. Memory: predicted tensor bytes (the estimate less its "
        "fixed CPU reserve) against the allocator's peak over one more step, as `local_truth.py` compares them.", "",
        "| plan | strategy | predicted s | measured median s (steps, range) | CPU s per step | predicted tensor MiB "
        "| measured peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, plan, key, p in zip(("per-layer", "uniform"), plans, keys, predicted):
        s = steps[key]
        tensors = plan.estimate.peak_memory_bytes - CPU_RESERVE_BYTES
        lines.append(f"| {label} | {key} | {p:.3f} | {statistics.median(s):.3f} ({len(s)}, {min(s):.3f}-{max(s):.3f}) | "
                     f"{cpu[key]:.3f} | {tensors / 2**20:.0f} | {peaks.get(key, 0) / 2**20:.0f} |")
    lines += ["", "Per block of the per-layer plan (kind, recomputation): "
              + ", ".join(f"{layer.fqn} {layer.block_kind} {layer.recompute}" for layer in per_layer.layers
                          if layer.kind == "block"), ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines[4:]))
    print(f"written {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
