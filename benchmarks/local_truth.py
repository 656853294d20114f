"""Predicted vs measured: every feasible strategy run for real on this machine's gloo ranks.

Run: ``.venv/bin/python benchmarks/local_truth.py [--cluster cluster.yaml] [--ranks 4] [--steps 3]``
(a profiled cluster file from ``tessera profile --nproc 4 --out cluster.yaml`` makes the time predictions
meaningful; without one the nominal ``cpu`` preset is used). For a small GPT and a small Llama it plans,
then runs every strategy the planner considers feasible (uniform recomputation, as enumerated) for a few
steps, records the measured step time (max over ranks, after a warm-up step) and each rank's peak live tensor
memory over one step (``benchmarks/memory_meter.py``), and reports:

- Spearman rank correlation between predicted and measured step time (goal >= 0.8);
- regret: measured time of the plan Tessera would choose / fastest measured (goal <= 1.10);
- memory error: predicted tensor memory (estimate minus its fixed reserve) vs measured peak.

Strategies the runtime cannot run yet are listed as skipped with the reason. Writes
``benchmarks/results/local-truth-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tessera
from tessera.cost_models.memory import CPU_RESERVE_BYTES
from tessera.errors import TesseraError
from tessera.models import build_model, model_config
from tessera.planner.plan import Plan
from tessera.planner.search import rank_candidates
from tessera.runtime.apply import apply_plan
from tessera.runtime.launch import WorkerError, spawn

HERE = Path(__file__).resolve().parent
MODELS = {
    "small-gpt": "gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256",
    "small-llama": "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=4096,seq=256",
}
GLOBAL_BATCH, SEQ_LEN = 16, 256
MAX_STRATEGIES = 24


def run_strategy(spec: str, plan_json: str, steps: int) -> dict:
    """On every rank: apply the plan, warm up, time ``steps`` steps, then track one step's memory."""
    from memory_meter import PeakMemoryMeter, resident_bytes

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    parallel = apply_plan(model, plan)
    vocab = model_config(spec).vocab
    tokens = torch.randint(vocab, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    parallel.train_step(batch)  # warm-up: allocator, optimizer state
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        parallel.train_step(batch)
    dist.barrier()
    seconds = (time.perf_counter() - start) / steps
    with PeakMemoryMeter(resident_bytes(parallel.module, parallel.optimizer)) as meter:
        parallel.train_step(batch)
    return {"seconds": seconds, "peak_bytes": meter.peak_bytes}


def candidates(spec: str, cluster: str) -> tuple[list[Plan], int]:
    """Fitting strategies as plans, predicted-fastest first, and how many fit in all.

    The uniform space holds ~300 fitting strategies here (~20 s of real running each): the benchmark runs
    ``MAX_STRATEGIES`` of them spread evenly over the predicted ranking -- the predicted fastest (what
    Tessera would choose) first, then every k-th -- so the correlation covers the whole range and the
    regret compares Tessera's choice with strategies from every part of it.
    """
    from tessera.api import _prepare
    from tessera.planner.search import planned_layers

    graph, resolved, training = _prepare(spec, cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision=None)
    fitting = [(s, e) for s, e in rank_candidates(graph, resolved, training, prune=False) if e.fits]
    step = max(1, len(fitting) // MAX_STRATEGIES)
    sample = fitting[::step][:MAX_STRATEGIES]
    plans = [
        Plan(model_name=spec, param_count=graph.param_count, cluster=resolved.name, device_name=resolved.device.name,
             training=training, strategy=s, estimate=e, layers=planned_layers(graph, s))
        for s, e in sample
    ]
    return plans, len(fitting)


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


def measure_model(name: str, spec: str, cluster: str, ranks: int, steps: int) -> tuple[list[tuple], list[str], str]:
    rows, skipped = [], []
    plans, feasible = candidates(spec, cluster)
    print(f"{name}: running {len(plans)} of {feasible} fitting strategies", flush=True)
    for plan in plans:
        try:
            results = spawn(run_strategy, nprocs=ranks, args=(spec, plan.to_json(), steps), timeout_s=600)
        except (WorkerError, TesseraError) as error:
            skipped.append(f"{plan.strategy.to_string()}: {str(error).splitlines()[0][:160]}")
            continue
        measured = max(r["seconds"] for r in results)
        peak = max(r["peak_bytes"] for r in results)
        predicted_tensors = plan.estimate.peak_memory_bytes - CPU_RESERVE_BYTES
        rows.append((plan.strategy.to_string(), plan.estimate.step_time_s, measured, predicted_tensors, peak))
        print(name, rows[-1], flush=True)
    return rows, skipped, summary(name, rows) + f" ({len(plans)} of {feasible} fitting strategies, evenly spaced in predicted rank)"


def summary(name: str, rows: list[tuple]) -> str:
    if len(rows) < 2:
        return f"- {name}: fewer than two strategies ran; nothing to correlate"
    predicted, measured = [r[1] for r in rows], [r[2] for r in rows]
    chosen = min(rows, key=lambda r: r[1])
    regret = chosen[2] / min(measured)
    memory_errors = [abs(r[3] / r[4] - 1) for r in rows if r[4]]
    return (f"- {name}: {len(rows)} strategies ran; Spearman(predicted, measured step time) = "
            f"{spearman(predicted, measured):.2f}; regret of Tessera's choice ({chosen[0]}) = {regret:.2f}; "
            f"memory |error| median {statistics.median(memory_errors):.0%}, worst {max(memory_errors):.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=None, help="profiled cluster YAML (default: the cpu preset)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cluster = args.cluster or f"cpu:ranks={args.ranks}"
    console = Console(width=180)
    sections = []
    for name, spec in MODELS.items():
        rows, skipped, text = measure_model(name, spec, cluster, args.ranks, args.steps)
        table = Table(title=f"{name} ({spec}) on {cluster}")
        for column in ("strategy", "predicted s", "measured s", "predicted MiB", "measured MiB"):
            table.add_column(column)
        for s, p, m, pm, mm in rows:
            table.add_row(s, f"{p:.3f}", f"{m:.3f}", f"{pm / 2**20:.0f}", f"{mm / 2**20:.0f}")
        console.print(table)
        console.print(text)
        sections.append((name, spec, rows, skipped, text))
    write_markdown(cluster, sections, args)


def write_markdown(cluster: str, sections: list, args: argparse.Namespace) -> None:
    date = datetime.date.today().isoformat()
    out = HERE / "results" / f"local-truth-{platform.machine()}-cpu-{date}.md"
    lines = [f"# Predicted vs measured on {args.ranks} gloo ranks ({date})", "",
             f"Command: `.venv/bin/python benchmarks/local_truth.py --ranks {args.ranks} --steps {args.steps}"
             + (f" --cluster {args.cluster}`" if args.cluster else "`") + f"; cluster `{cluster}`.", ""]
    lines += [text for *_, text in sections] + [""]
    for name, spec, rows, skipped, _ in sections:
        lines += [f"## {name}: `{spec}`", "", "| strategy | predicted s | measured s | predicted MiB | measured MiB |", "|---|---|---|---|---|"]
        lines += [f"| {s} | {p:.3f} | {m:.3f} | {pm / 2**20:.0f} | {mm / 2**20:.0f} |" for s, p, m, pm, mm in rows]
        if skipped:
            lines += ["", "Not run (runtime refused):", *[f"- {item}" for item in skipped]]
        lines.append("")
    out.write_text("\n".join(lines))
    print(f"written {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
