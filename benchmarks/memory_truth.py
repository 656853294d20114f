"""Predicted vs measured peak memory per device, for DDP, each ZeRO stage, TP and PP, on real gloo ranks.

Run: ``.venv/bin/python benchmarks/memory_truth.py [--ranks 4]`` (a few minutes; timing does not matter
here, so a busy machine gives the same figures). For a tiny and a small model, each strategy is planned with
``tessera.evaluate`` (everything pinned), applied to the real model on ``--ranks`` gloo ranks, run for one
warm-up step, then one step under ``benchmarks/memory_meter.py``'s ``PeakMemoryMeter``. The prediction is
the estimate's peak per device minus its fixed CPU reserve (the meter counts tensors only); the measurement
is the largest peak over the ranks (pipeline stages differ). Goal (cost-model issue): within 10%.
Writes ``benchmarks/results/memory-truth-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tessera.cost_models.memory import CPU_RESERVE_BYTES
from tessera.models import build_model, model_config
from tessera.planner.plan import Plan
from tessera.runtime.launch import spawn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODELS = {
    "gpt-tiny": ("gpt-tiny:layers=4", 8, 64),
    "small-gpt": ("gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256", 16, 256),
    "small-llama": ("llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=4096,seq=256", 16, 256),
}
STRATEGIES = {  # name -> pins over the 4 ranks; everything else fixed so each row is one runtime path
    "DDP": "dp=4,zero=0",
    "ZeRO-1": "dp=4,zero=1",
    "ZeRO-2": "dp=4,zero=2",
    "ZeRO-3": "dp=4,zero=3",
    "TP": "dp=1,tp=4,sp=true",
    "PP": "dp=1,pp=4,schedule=1f1b",
    "TP x DP": "dp=2,tp=2,sp=true",
    "PP x DP": "dp=2,pp=2,schedule=1f1b",
}


def measure(spec: str, plan_json: str, global_batch: int, seq_len: int) -> int:
    """On every rank: apply the plan, one warm-up step, then the peak live tensor bytes of one step."""
    from memory_meter import PeakMemoryMeter, resident_bytes

    from tessera.runtime.apply import apply_plan

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    parallel = apply_plan(build_model(spec, device="cpu"), plan)
    tokens = torch.randint(model_config(spec).vocab, (global_batch, seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    parallel.train_step(batch)  # warm-up: optimizer state exists from here on
    resident = sum(resident_bytes(module, parallel.optimizer) for module in parallel.modules)
    with PeakMemoryMeter(resident) as meter:
        parallel.train_step(batch)
    return meter.peak_bytes


def plan_for(spec: str, pins: str, ranks: int, global_batch: int, seq_len: int) -> Plan:
    from tessera.api import _prepare
    from tessera.cost_models import estimate
    from tessera.cost_models.types import Strategy
    from tessera.planner.search import planned_layers

    graph, cluster, training = _prepare(spec, f"cpu:ranks={ranks}", global_batch=global_batch, seq_len=seq_len, precision=None)
    strategy = Strategy.parse(f"{pins},mbs=2,recompute=none")
    return Plan(model_name=spec, param_count=graph.param_count, cluster=cluster.name, device_name=cluster.device.name,
                training=training, strategy=strategy, estimate=estimate(list(graph.layers), cluster, training, strategy),
                layers=planned_layers(graph, strategy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for model, (spec, global_batch, seq_len) in MODELS.items():
        for name, pins in STRATEGIES.items():
            plan = plan_for(spec, pins, args.ranks, global_batch, seq_len)
            peaks = spawn(measure, nprocs=args.ranks, args=(spec, plan.to_json(), global_batch, seq_len), timeout_s=600)
            predicted = plan.estimate.peak_memory_bytes - CPU_RESERVE_BYTES
            rows.append((model, name, plan.strategy.to_string(), predicted, max(peaks)))
            print(model, name, f"predicted {predicted / 2**20:.2f} MiB measured {max(peaks) / 2**20:.2f} MiB "
                  f"error {predicted / max(peaks) - 1:+.1%}", flush=True)
    report(rows, args.ranks)


def report(rows: list[tuple], ranks: int) -> None:
    errors = [abs(p / m - 1) for *_, p, m in rows]
    verdict = (f"{len(rows)} runs; |error| median {statistics.median(errors):.1%}, worst {max(errors):.1%}; "
               f"within 10%: {sum(e <= 0.10 for e in errors)}/{len(rows)}")
    table = Table(title=f"Peak tensor memory per device, predicted vs measured ({ranks} gloo ranks)")
    for column in ("model", "runtime path", "strategy", "predicted MiB", "measured MiB", "error"):
        table.add_column(column)
    for model, name, strategy, p, m in rows:
        table.add_row(model, name, strategy, f"{p / 2**20:.2f}", f"{m / 2**20:.2f}", f"{p / m - 1:+.1%}")
    Console(width=200).print(table)
    print(verdict)
    date = datetime.date.today().isoformat()
    out = HERE / "results" / f"memory-truth-{platform.machine()}-cpu-{date}.md"
    lines = [f"# Peak memory per device: predicted vs measured ({ranks} gloo ranks, {date})", "",
             f"Command: `.venv/bin/python benchmarks/memory_truth.py --ranks {ranks}`. Predicted: the estimate's "
             "peak minus its fixed CPU reserve; measured: largest peak of live tensors over the ranks during one step "
             "after a warm-up step (`benchmarks/memory_meter.py`).", "", verdict, "",
             "| model | runtime path | strategy | predicted MiB | measured MiB | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {model} | {name} | `{s}` | {p / 2**20:.2f} | {m / 2**20:.2f} | {p / m - 1:+.1%} |"
              for model, name, s, p, m in rows]
    out.write_text("\n".join(lines) + "\n")
    print(f"written {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
