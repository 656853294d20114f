"""Predicted vs measured peak memory per device, for DDP, each ZeRO stage, TP and PP, on real gloo ranks.

Run: ``.venv/bin/python benchmarks/memory_truth.py [--ranks 4] [--models ...] [--strategies ...]`` (4.5 minutes
for the default models on a 2-core machine at load 1.4-4; timing does not matter here). For a tiny and two small models whose
activations outweigh their weights, and a weight-heavy one (`wide-4`), each
strategy is planned with the cost model (everything pinned), applied to the real model on ``--ranks`` gloo
ranks, run for a warm-up step (two under DDP, whose buckets are rebuilt after the first synchronised backward),
then one step under ``benchmarks/memory_meter.py``'s ``AllocatorMeter``: the peak of what the CPU allocator
held, from the running total the allocator reports with the profiler's memory events (it sees FSDP2's
``storage.resize_`` allocations and C++ ones, which a dispatch-mode meter misses, and frees on gloo's worker
threads, which the events alone miss), on top of the parameters, optimizer state and DDP's gradient buckets. The
prediction is the estimate's worst stage minus its fixed CPU reserve; the measurement the worst rank.
Goal (cost-model issue #5): within 10%. Writes ``benchmarks/results/memory-truth-<hardware>-<date>.md`` and the
per-rank peaks to the ``.json`` beside it; ``--reuse that.json`` re-predicts without measuring again.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    # weights over activations (6.3M block parameters, 128 tokens a step): what FSDP2 gathers shows in the peak; FP8
    # on CPU can afford it (its forward matmul is a reference loop); not in the default set
    "wide-short": ("gpt:layers=2,hidden=512,heads=8,vocab=1024,seq=16", 8, 16),
    # the same with 4 blocks: ZeRO-3's middle blocks (a neighbour on each side) exist
    "wide-4": ("gpt:layers=4,hidden=512,heads=8,vocab=1024,seq=16", 8, 16),
}
DEFAULT_MODELS = ("gpt-tiny", "small-gpt", "small-llama", "wide-4")  # activations over weights, then weights over activations
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
    """On every rank: apply the plan, warm up, then the peak bytes the CPU allocator holds during one step.

    Baseline: parameters, optimizer state (gradients are freed by ``zero_grad(set_to_none=True)``) and DDP's
    gradient buckets, which live from construction on. DDP rebuilds its buckets in the forward after the first
    synchronised backward (``Reducer::rebuild_buckets``); a second warm-up step keeps that swap (whose free the
    profiler cannot attribute) out of the measured step.
    """
    from memory_meter import AllocatorMeter, ddp_bucket_bytes, resident_bytes

    from tessera.runtime.apply import apply_plan

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    parallel = apply_plan(build_model(spec, device="cpu"), plan)
    tokens = torch.randint(model_config(spec).vocab, (global_batch, seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    buckets = sum(ddp_bucket_bytes(module) for module in parallel.modules)
    for _ in range(2 if buckets else 1):
        parallel.train_step(batch)  # warm-up: optimizer state exists from here on
    resident = sum(resident_bytes(module, parallel.optimizer) for module in parallel.modules)
    with AllocatorMeter(resident + buckets) as meter:
        parallel.train_step(batch)
    return meter.peak_bytes


def plan_for(spec: str, pins: str, ranks: int, global_batch: int, seq_len: int, precision: str | None = None) -> Plan:
    from tessera.api import _prepare
    from tessera.cost_models import estimate
    from tessera.cost_models.types import Strategy
    from tessera.planner.search import planned_layers

    graph, cluster, training = _prepare(spec, f"cpu:ranks={ranks}", global_batch=global_batch, seq_len=seq_len,
                                        precision=precision)
    fixed = {"mbs": "2", "recompute": "none"}  # unless the pins say otherwise
    given = {field.split("=", 1)[0] for field in pins.split(",") if field}
    strategy = Strategy.parse(",".join([pins, *(f"{k}={v}" for k, v in fixed.items() if k not in given)]).strip(","))
    return Plan(model_name=spec, param_count=graph.param_count, cluster=cluster.name, device_name=cluster.device.name,
                training=training, strategy=strategy, estimate=estimate(list(graph.layers), cluster, training, strategy),
                layers=planned_layers(graph, strategy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of the paths")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp8"), help="default: the CPU cluster's (fp32); fp8 "
                        "runs torchao's float8 linears, whose CPU matmul is a reference loop: use it with gpt-tiny")
    parser.add_argument("--reuse", type=Path, help="take the measured peaks from this JSON (written by a run) and "
                        "only re-predict (for iterating on the cost model; the measurement does not depend on it); "
                        "rows missing from it are measured and added")
    parser.add_argument("--pins", action="append", default=[], metavar="NAME=PINS",
                        help="also run the strategy PINS under NAME (e.g. 'ZeRO-3 kept=dp=4,zero=3,block_reshard=2xfalse', "
                        "whose per-block flags fit one model)")
    parser.add_argument("--tag", default="", help="added to the results' file names (a run of a few rows beside the "
                        "full run's files)")
    parser.add_argument("--no-write", action="store_true", help="print the table only; leave benchmarks/results alone "
                        "(for checking a few rows without overwriting the full run's files)")
    args = parser.parse_args()
    extra = dict(pin.split("=", 1) for pin in args.pins)
    strategies = {**STRATEGIES, **extra}
    names = [name for name in args.strategies.split(",") if name] + list(extra)
    reused = json.loads(args.reuse.read_text()) if args.reuse else {}
    rows, measured = [], {}
    for model in args.models.split(","):
        spec, global_batch, seq_len = MODELS[model]
        for name in names:
            plan = plan_for(spec, strategies[name], args.ranks, global_batch, seq_len, args.precision)
            key = f"{model}|{name}"
            peaks = reused.get(key) or spawn(measure, nprocs=args.ranks, args=(spec, plan.to_json(), global_batch, seq_len), timeout_s=1200)
            measured[key] = peaks
            stages = [peak - CPU_RESERVE_BYTES for peak in plan.estimate.stage_peak_memory_bytes]
            rows.append((model, name, plan.strategy.to_string(), max(stages), max(peaks), stages, peaks))
            per_rank = " ".join(f"{peak / 2**20:.2f}" for peak in peaks)
            print(model, name, f"predicted {max(stages) / 2**20:.2f} MiB measured {max(peaks) / 2**20:.2f} MiB "
                  f"error {max(stages) / max(peaks) - 1:+.1%} (per rank MiB: {per_rank})", flush=True)
    report(rows, args.ranks, {**reused, **measured}, reused=measured.keys() <= reused.keys(), write=not args.no_write,
           precision=args.precision, tag=args.tag)


def report(rows: list[tuple], ranks: int, measured: dict[str, list[int]], *, reused: bool, write: bool,
           precision: str | None = None, tag: str = "") -> None:
    errors = [abs(p / m - 1) for _, _, _, p, m, *_ in rows]
    verdict = (f"{len(rows)} runs; |error| median {statistics.median(errors):.1%}, worst {max(errors):.1%}; "
               f"within 10%: {sum(e <= 0.10 for e in errors)}/{len(rows)}")
    table = Table(title=f"Peak memory per device, predicted vs measured ({ranks} gloo ranks)")
    for column in ("model", "runtime path", "strategy", "predicted MiB", "measured MiB", "error", "per stage / per rank"):
        table.add_column(column)
    for model, name, strategy, p, m, stages, peaks in rows:
        table.add_row(model, name, strategy, f"{p / 2**20:.2f}", f"{m / 2**20:.2f}", f"{p / m - 1:+.1%}", _per_rank(stages, peaks))
    Console(width=220).print(table)
    print(verdict)
    if not write:
        return
    date = datetime.date.today().isoformat()
    suffix = "".join(f"-{part}" for part in (precision, tag) if part)
    stem = HERE / "results" / f"memory-truth-{platform.machine()}-cpu-{date}{suffix}"
    if not reused:
        stem.with_suffix(".json").write_text(json.dumps(measured, indent=1) + "\n")
    lines = [f"# Peak memory per device: predicted vs measured ({ranks} gloo ranks, {date})", "",
             f"Command: `.venv/bin/python benchmarks/memory_truth.py {' '.join(sys.argv[1:])}`. Predicted: the estimate's "
             "peak minus its fixed CPU reserve (largest over pipeline stages); measured: the largest over the ranks of "
             "the peak bytes the CPU allocator held during one step after warm-up (`benchmarks/memory_meter.py`'s "
             "`AllocatorMeter`: the CPU allocator's running total, frees on gloo's threads included, on top of parameters, "
             "optimizer state and DDP's buckets). "
             "Per-rank measured peaks are in the `.json` next to this file."
             + (" Predictions were recomputed from that file (`--reuse`): the measurement does not depend on the "
                "cost model." if reused else ""), "", verdict, "",
             "| model | runtime path | strategy | predicted MiB | measured MiB | error | per stage predicted / per rank measured |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {model} | {name} | `{s}` | {p / 2**20:.2f} | {m / 2**20:.2f} | {p / m - 1:+.1%} | {_per_rank(st, pk)} |"
              for model, name, s, p, m, st, pk in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"written {stem.with_suffix('.md').relative_to(HERE.parent)}")


def _per_rank(stages: list[int], peaks: list[int]) -> str:
    """For pipelined rows, each stage's prediction against the ranks of that stage (rank r runs stage r % pp: the
    pipelined rows have tp = cp = 1, ``runtime.mesh``)."""
    if len(stages) == 1:
        return ""
    return " ".join(f"{stages[r % len(stages)] / 2**20:.1f}/{peak / 2**20:.1f}" for r, peak in enumerate(peaks))


if __name__ == "__main__":
    main()
