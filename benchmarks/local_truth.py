"""Predicted vs measured: every feasible strategy run for real on this machine's gloo ranks.

Run: ``.venv/bin/python benchmarks/local_truth.py [--cluster cluster.yaml] [--ranks 4] [--steps 3]``
(a profiled cluster file from ``tessera profile --nproc 4 --out cluster.yaml`` makes the time predictions
meaningful; without one the nominal ``cpu`` preset is used). For a small GPT and a small Llama it plans,
then runs every strategy the planner considers feasible (uniform recomputation, as enumerated) for a few
steps, in a fixed random order, one after another on the same ranks, records the measured step time and each rank's peak memory over one more step, and reports:

- Spearman rank correlation between predicted and measured step time (goal >= 0.8);
- regret: measured time of the plan Tessera would choose / fastest measured (goal <= 1.10). The sweep
  times each strategy once, so its fastest is partly luck; the choice and the sweep's ``--finalists`` fastest
  are then re-run side by side for ``--confirm-rounds`` round-robin rounds, and regret is the choice's median
  over the fastest finalist's median there (the sweep-only figure is reported beside it);
- memory error: predicted tensor memory (estimate minus its fixed reserve) vs measured peak.

Timing: after warm-up, every step starts at a barrier; a step's time is its slowest rank's, and the
strategy's time is the median over ``--steps`` steps (a burst of load elsewhere on shared cores spoils one
step, not the figure). Each rank's median CPU seconds per step go to the ``.json`` too: load elsewhere
inflates them far less than wall time, so they tell a loaded run's noise from the strategy's cost.
Memory: one further step under ``benchmarks/memory_meter.py``'s ``AllocatorMeter``
(the peak the CPU allocator held, on top of parameters, optimizer state and DDP's buckets), as
``memory_truth.py`` measures it. ``--strategies "s1;s2"`` runs a fixed list instead of the sample (a quick
check); ``--max-strategies N`` runs N spread over the predicted ranking. Measurements are appended to a
``.jsonl`` journal as they are taken: ``--resume journal.jsonl`` continues a stopped run. ``--reuse results.json`` re-predicts the measurements a run wrote, without running anything (the
measurement does not depend on the cost model). A strategy the runtime refuses is listed with its error.
Writes ``benchmarks/results/local-truth-<hardware>-<date>.md`` and the measurements to the ``.json`` beside it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from tessera.cost_models import estimate
from tessera.cost_models.memory import CPU_RESERVE_BYTES
from tessera.cost_models.types import Strategy
from tessera.errors import TesseraError
from tessera.models import build_model, model_config
from tessera.planner.plan import Plan
from tessera.planner.search import planned_layers, rank_candidates
from tessera.runtime.apply import apply_plan
from tessera.runtime.launch import WorkerError, spawn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODELS = {
    "small-gpt": "gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256",
    "small-llama": "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=4096,seq=256",
}
GLOBAL_BATCH, SEQ_LEN = 16, 256
BATCH, BATCH_TIMEOUT_S = 20, 1800
"""Strategies per spawn, and its time limit (a hung collective costs at most this)."""


def run_strategies(name: str, spec: str, plan_jsons: list[str], steps: int, journal: str, confirming: bool = False) -> None:
    """On every rank, one strategy after another in this one process group (a fresh spawn costs ~9 s here);
    rank 0 appends each strategy's measurements to ``journal`` as soon as every rank has them, so a run that
    is stopped (or a strategy that fails) loses only the strategy in flight. ``confirming`` marks the entries
    as confirmation re-runs of finalists (see ``confirm``)."""
    for index, plan_json in enumerate(plan_jsons):
        result = run_strategy(spec, plan_json, steps)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        if dist.get_rank() == 0:
            key = Plan.from_json(plan_json).strategy.to_string()
            entry = {"model": name, "strategy": key, "ranks": results, "load_average_1m": round(os.getloadavg()[0], 2)}
            if confirming:
                entry["confirm"] = True
            append(Path(journal), entry)
            print(f"[{index + 1}/{len(plan_jsons)}] {key} steps {[round(s, 3) for s in measurement(entry, steps)['step_s']]}",
                  flush=True)
        gc.collect()  # the previous strategy's tensors, before the next one's memory is measured


def run_strategy(spec: str, plan_json: str, steps: int) -> dict:
    """On every rank: apply the plan, warm up, time ``steps`` steps one by one, then measure one step's memory."""
    from memory_meter import AllocatorMeter, ddp_bucket_bytes, resident_bytes

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    parallel = apply_plan(build_model(spec, device="cpu"), plan)
    tokens = torch.randint(model_config(spec).vocab, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    buckets = sum(ddp_bucket_bytes(module) for module in parallel.modules)
    for _ in range(2 if buckets else 1):  # warm-up: allocator, optimizer state, DDP's rebuilt buckets
        parallel.train_step(batch)
    seconds, cpu_seconds = [], []
    for _ in range(steps):
        dist.barrier()
        start, cpu_start = time.perf_counter(), cpu_time_s()
        parallel.train_step(batch)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(cpu_time_s() - cpu_start)
    resident = sum(resident_bytes(module, parallel.optimizer) for module in parallel.modules)
    with AllocatorMeter(resident + buckets) as meter:
        parallel.train_step(batch)
    return {"step_s": seconds, "cpu_s": cpu_seconds, "peak_bytes": meter.peak_bytes}


def cpu_time_s() -> float:
    """This process's user + system CPU seconds, all threads (gloo's included): what a step costs the shared
    cores, which load elsewhere on the machine does not inflate the way it does wall time."""
    times = os.times()
    return times.user + times.system


def prepared(spec: str, cluster: str):
    from tessera.api import _prepare

    return _prepare(spec, cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision=None)


def as_plan(spec: str, prepared_model, strategy: Strategy, prediction=None) -> Plan:
    graph, cluster, training = prepared_model
    prediction = prediction or estimate(list(graph.layers), cluster, training, strategy)
    return Plan(model_name=spec, param_count=graph.param_count, cluster=cluster.name, device_name=cluster.device.name,
                training=training, strategy=strategy, estimate=prediction, layers=planned_layers(graph, strategy))


def candidates(spec: str, cluster: str, max_strategies: int | None) -> tuple[list[Plan], int]:
    """Fitting strategies as plans, predicted-fastest first, and how many fit in all.

    Every fitting strategy by default (266 per model here: ~25 min of real running per model). With
    ``max_strategies``, that many spread evenly over the predicted ranking -- the predicted fastest (what
    Tessera would choose) first, then every k-th -- so a quick run still covers the whole range.
    """
    model = prepared(spec, cluster)
    fitting = [(s, e) for s, e in rank_candidates(*model, prune=False) if e.fits]
    step = max(1, len(fitting) // max_strategies) if max_strategies else 1
    chosen = fitting[::step][:max_strategies] if max_strategies else fitting
    return [as_plan(spec, model, s, e) for s, e in chosen], len(fitting)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def failure_reason(error: Exception) -> str:
    """The launcher's headline and the failing rank's exception line (the traceback's last line)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[-1].strip()} ({lines[0].removesuffix('; its traceback:')})"


def measure(name: str, spec: str, plans: list[Plan], ranks: int, steps: int, journal: Path) -> tuple[dict, list[str]]:
    """Run every plan not yet in ``journal``, in batches on one set of ranks; return the journal's measurements
    for ``name`` keyed by strategy (per-step slowest-rank seconds, per-rank peaks) and the failures.

    A strategy that raises on any rank ends its batch (the launcher stops the other ranks at once); it is
    journaled as failed with its rank's exception and the batch resumes after it on fresh ranks.
    """
    while todo := [plan for plan in plans if plan.strategy.to_string() not in journaled(journal, name)]:
        batch = todo[:BATCH]
        try:
            spawn(run_strategies, nprocs=ranks, args=(name, spec, [p.to_json() for p in batch], steps, str(journal)),
                  timeout_s=BATCH_TIMEOUT_S)
        except (WorkerError, TesseraError) as error:
            in_flight = next(p for p in batch if p.strategy.to_string() not in journaled(journal, name))
            key = in_flight.strategy.to_string()
            print(f"{key} failed: {failure_reason(error)}", flush=True)
            append(journal, {"model": name, "strategy": key, "error": failure_reason(error)})
    wanted = {plan.strategy.to_string() for plan in plans}
    entries = {key: e for key, e in journaled(journal, name).items() if key in wanted}
    measured = {key: measurement(e, steps) for key, e in entries.items() if "error" not in e}
    return measured, [f"{key}: {e['error']}" for key, e in entries.items() if "error" in e]


def journaled(journal: Path, name: str) -> dict[str, dict]:
    """The sweep's entries for model ``name``, by strategy (a later entry for a strategy replaces earlier)."""
    return {e["strategy"]: e for e in journal_entries(journal, name) if not e.get("confirm")}


def confirmations(journal: Path, name: str) -> dict[str, list[dict]]:
    """The confirmation re-runs for model ``name``: each strategy's entries, in the order they ran."""
    runs: dict[str, list[dict]] = {}
    for e in journal_entries(journal, name):
        if e.get("confirm"):
            runs.setdefault(e["strategy"], []).append(e)
    return runs


def journal_entries(journal: Path, name: str) -> list[dict]:
    if not journal.exists():
        return []
    entries = (json.loads(line) for line in journal.read_text().splitlines() if line.strip())
    return [e for e in entries if e["model"] == name]


def finalists(rows: list[tuple], count: int) -> list[str]:
    """Tessera's choice (the predicted fastest) and the ``count`` fastest in the sweep."""
    chosen = min(rows, key=lambda r: r[1])[0]
    fastest = [r[0] for r in sorted(rows, key=lambda r: r[2]) if r[0] != chosen]
    return [chosen, *fastest[:count]]


def confirm(name: str, spec: str, plans: list[Plan], rounds: int, ranks: int, steps: int, journal: Path) -> dict[str, list[float]]:
    """Re-run ``plans`` in ``rounds`` round-robin rounds on one set of ranks; every timed step's seconds per
    strategy (slowest rank), the journal's earlier rounds included, so a stopped confirmation resumes.

    Why: the sweep times each strategy once, and the fastest of 266 noisy single measurements is as much luck
    as speed (the same strategy under another schedule that changes nothing measured 0.7x-1.4x). Regret against
    it overstates Tessera's loss; re-running the finalists side by side, in rounds so that drift in the machine's
    load falls on all of them alike, measures it without that bias.
    """
    by_key = {plan.strategy.to_string(): plan for plan in plans}
    while todo := rounds_to_run(confirmations(journal, name), list(by_key), rounds):
        spawn(run_strategies, nprocs=ranks, args=(name, spec, [by_key[k].to_json() for k in todo], steps, str(journal), True),
              timeout_s=BATCH_TIMEOUT_S)
    runs = confirmations(journal, name)
    return {key: [s for e in runs[key][:rounds] for s in measurement(e, steps)["step_s"]] for key in by_key}


def rounds_to_run(done: dict[str, list[dict]], keys: list[str], rounds: int) -> list[str]:
    """The re-runs still missing, round by round: a key appears once for each round it has not had."""
    return [key for r in range(rounds) for key in keys if len(done.get(key, [])) <= r]


def append(journal: Path, entry: dict) -> None:
    with open(journal, "a") as file:
        file.write(json.dumps(entry) + "\n")


def measurement(entry: dict, steps: int) -> dict:
    """A journal entry as the ``.json`` keeps it: each step's slowest rank, each rank's median CPU seconds."""
    ranks = entry["ranks"]
    return {"step_s": [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))],
            "cpu_s": [statistics.median(r["cpu_s"]) for r in ranks], "peak_bytes": [r["peak_bytes"] for r in ranks],
            "load_average_1m": entry["load_average_1m"]}


def rows_of(spec: str, cluster: str, measured: dict) -> list[tuple]:
    """(strategy, predicted s, measured s, predicted tensor bytes, measured peak bytes), re-predicted now."""
    model = prepared(spec, cluster)
    rows = []
    for key, m in measured.items():
        plan = as_plan(spec, model, Strategy.parse(key))
        predicted_tensors = plan.estimate.peak_memory_bytes - CPU_RESERVE_BYTES
        rows.append((key, plan.estimate.step_time_s, statistics.median(m["step_s"]), predicted_tensors, max(m["peak_bytes"])))
    return rows


def summary(name: str, rows: list[tuple], confirmed: dict[str, list[float]]) -> str:
    if len(rows) < 2:
        return f"- {name}: fewer than two strategies ran; nothing to correlate"
    predicted, measured = [r[1] for r in rows], [r[2] for r in rows]
    chosen = min(rows, key=lambda r: r[1])
    memory_errors = [abs(r[3] / r[4] - 1) for r in rows if r[4]]
    return (f"- {name}: {len(rows)} strategies ran; Spearman(predicted, measured step time) = "
            f"{spearman(predicted, measured):.2f}; Tessera's choice {chosen[0]}: {confirmed_regret(chosen[0], confirmed)}; "
            f"in the sweep alone {chosen[2] / min(measured):.2f}; "
            f"memory |error| median {statistics.median(memory_errors):.0%}, worst {max(memory_errors):.0%}")


def confirmed_regret(chosen: str, confirmed: dict[str, list[float]]) -> str:
    if chosen not in confirmed or len(confirmed) < 2:
        return "regret not confirmed (the choice was not among the finalists re-run: run again with --resume)"
    medians = {key: statistics.median(steps) for key, steps in confirmed.items()}
    fastest = min(medians, key=medians.get)
    return (f"regret {medians[chosen] / medians[fastest]:.2f} over the {len(confirmed)} finalists re-run side by side "
            f"(fastest {fastest}, {medians[fastest]:.3f} s vs {medians[chosen]:.3f} s)")


def confirmed_table(rows: list[tuple], confirmed: dict[str, list[float]]) -> list[str]:
    predicted = {r[0]: r for r in rows}
    lines = ["| finalist | predicted s | sweep s | re-run median s (steps, range) |", "|---|---|---|---|"]
    for key, steps in sorted(confirmed.items(), key=lambda item: statistics.median(item[1])):
        _, p, m, *_ = predicted[key]
        lines.append(f"| {key} | {p:.3f} | {m:.3f} | {statistics.median(steps):.3f} ({len(steps)}, {min(steps):.3f}-{max(steps):.3f}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=None, help="profiled cluster YAML (default: the cpu preset)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per strategy (the median is reported)")
    parser.add_argument("--max-strategies", type=int, help="run this many per model, evenly spaced in predicted "
                        "rank (default: every fitting strategy)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of the models")
    parser.add_argument("--strategies", help="run these ';'-separated strategies instead of the sample")
    parser.add_argument("--reuse", type=Path, help="re-predict the measurements in this JSON (written by a run)")
    parser.add_argument("--resume", type=Path, metavar="JOURNAL", help="continue a stopped run: keep this journal's "
                        "measurements (the .jsonl a run writes as it goes) and run only the strategies it lacks")
    parser.add_argument("--finalists", type=int, default=5, help="the sweep's fastest strategies re-run beside "
                        "Tessera's choice to measure its regret (default 5)")
    parser.add_argument("--confirm-rounds", type=int, default=3, help="round-robin rounds of the finalists' re-runs "
                        "(default 3; 0 skips the confirmation)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder for the .md and .json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = args.cluster or f"cpu:ranks={args.ranks}"
    reused = json.loads(args.reuse.read_text()) if args.reuse else {}
    console = Console(width=180)
    sections, measurements = [], {}
    journal = None if args.reuse else journal_path(args)
    for name in args.models.split(","):
        spec = MODELS[name]
        earlier = reused.get(name, {})
        measured, failed, confirmed = earlier.get("measured", {}), earlier.get("failed", []), earlier.get("confirmed", {})
        note = ""
        if not args.reuse:
            plans, note = planned_runs(spec, cluster, args)
            print(f"{name}: running {len(plans)} strategies{note}", flush=True)
            measured, failed = measure(name, spec, plans, args.ranks, args.steps, journal)
        rows = rows_of(spec, cluster, measured)
        if not args.reuse and args.confirm_rounds and len(rows) >= 2:
            keys = finalists(rows, args.finalists)
            print(f"{name}: re-running Tessera's choice and the sweep's {len(keys) - 1} fastest, "
                  f"{args.confirm_rounds} rounds", flush=True)
            plans_by_key = {plan.strategy.to_string(): plan for plan in plans}
            confirmed = confirm(name, spec, [plans_by_key[k] for k in keys], args.confirm_rounds, args.ranks,
                                args.steps, journal)
        measurements[name] = {"measured": measured, "failed": failed, "confirmed": confirmed}
        text = summary(name, rows, confirmed) + note
        print_table(console, f"{name} ({spec}) on {cluster}", rows)
        console.print(text)
        sections.append((name, spec, rows, failed, confirmed, text))
    write_results(cluster, sections, measurements, args)


def journal_path(args: argparse.Namespace) -> Path:
    """Where measurements are appended as they are taken: ``--resume``'s file, else a new one beside the results."""
    if args.resume:
        if not args.resume.exists():
            raise SystemExit(f"--resume {args.resume}: no such journal; start without --resume to begin one")
        return args.resume
    journal = results_stem(args).with_suffix(".jsonl")
    if journal.exists():
        raise SystemExit(f"{journal} exists (measurements of an earlier run): continue it with --resume {journal}, "
                         "or move it away to start afresh")
    return journal


def results_stem(args: argparse.Namespace) -> Path:
    return args.out / f"local-truth-{platform.machine()}-cpu-{datetime.date.today().isoformat()}"


def planned_runs(spec: str, cluster: str, args: argparse.Namespace) -> tuple[list[Plan], str]:
    if args.strategies:
        model = prepared(spec, cluster)
        return [as_plan(spec, model, Strategy.parse(s)) for s in args.strategies.split(";")], " (fixed list)"
    plans, feasible = candidates(spec, cluster, args.max_strategies)
    if len(plans) == feasible:
        return shuffled(plans), f" (every one of the {feasible} fitting strategies)"
    return shuffled(plans), f" ({len(plans)} of {feasible} fitting strategies, evenly spaced in predicted rank)"


def shuffled(plans: list[Plan]) -> list[Plan]:
    """Run in a fixed random order: a drift in the machine's state over the run (load, heat) then scatters
    over the predicted ranking instead of tilting it."""
    order = list(plans)
    random.Random(0).shuffle(order)
    return order


def error_by_axis(rows: list[tuple]) -> list[str]:
    """Median measured / predicted step time (and peak memory) for each value of each strategy axis: which
    kind of strategy the model gets wrong, and which way."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for key, predicted, measured, predicted_bytes, measured_bytes in rows:
        s = Strategy.parse(key)
        schedule = s.schedule if s.pp > 1 else "none"
        for axis in (f"tp={s.tp}", f"pp={s.pp}", f"zero={s.zero}", f"recompute={s.recompute}", f"schedule={schedule}"):
            groups.setdefault(axis, []).append((measured / predicted, measured_bytes / predicted_bytes))
    lines = ["| strategies with | count | measured / predicted time, median (range) | memory, median (range) |",
             "|---|---|---|---|"]
    for axis, ratios in sorted(groups.items()):
        times, memory = [t for t, _ in ratios], [m for _, m in ratios]
        lines.append(f"| {axis} | {len(ratios)} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) | "
                     f"{statistics.median(memory):.2f} ({min(memory):.2f}-{max(memory):.2f}) |")
    return lines


def print_table(console: Console, title: str, rows: list[tuple]) -> None:
    table = Table(title=title)
    for column in ("strategy", "predicted s", "measured s", "predicted MiB", "measured MiB"):
        table.add_column(column)
    for s, p, m, pm, mm in sorted(rows, key=lambda r: r[1]):
        table.add_row(s, f"{p:.3f}", f"{m:.3f}", f"{pm / 2**20:.0f}", f"{mm / 2**20:.0f}")
    console.print(table)


def write_results(cluster: str, sections: list, measurements: dict, args: argparse.Namespace) -> None:
    date = datetime.date.today().isoformat()
    stem = results_stem(args)
    if not args.reuse:
        stem.with_suffix(".json").write_text(json.dumps(measurements, indent=1) + "\n")
    command = " ".join(["benchmarks/local_truth.py", *sys.argv[1:]])
    loads = [m["load_average_1m"] for v in measurements.values() for m in v["measured"].values()]
    lines = [f"# Predicted vs measured on {args.ranks} gloo ranks ({date})", "",
             f"Command: `.venv/bin/python {command}`; cluster `{cluster}`. Measured: median over timed steps of the "
             "slowest rank's step time; peak memory from the CPU allocator's events over one more step. Per-step "
             f"times are in the `.json` beside this file. 1-minute load average after each sweep run: "
             + (f"{min(loads)}-{max(loads)}." if loads else "n/a."), ""]
    lines += [text for *_, text in sections] + [""]
    for name, spec, rows, failed, confirmed, _ in sections:
        lines += [f"## {name}: `{spec}`", ""]
        if confirmed:
            lines += ["Finalists re-run side by side (round-robin, each round on the same ranks):", "",
                      *confirmed_table(rows, confirmed), ""]
        lines += ["| strategy | predicted s | measured s | predicted MiB | measured MiB |", "|---|---|---|---|---|"]
        lines += [f"| {s} | {p:.3f} | {m:.3f} | {pm / 2**20:.0f} | {mm / 2**20:.0f} |"
                  for s, p, m, pm, mm in sorted(rows, key=lambda r: r[1])]
        lines += ["", *error_by_axis(rows)]
        if failed:
            lines += ["", "Not run (the runtime refused or failed):", *[f"- {item}" for item in failed]]
        lines.append("")
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"written {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
