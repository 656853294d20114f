"""Checkpoint cost on local gloo ranks: save, asynchronous save and load times and size on disk, measured and
as ``cost_models.reliability`` predicts them.

Run: ``/work/venv/bin/python benchmarks/checkpoint_time.py [--models small,large] [--repeats 3]``
(``--smoke``: ``gpt-tiny``, one repeat, no results file unless ``--out`` names one).

For each model (a small GPT of ~4M parameters and a larger one of ~55M) and each plan saved on 4 ranks (DDP,
ZeRO-3, TP 2 x DP 2), every rank builds the model from one seed, applies the plan and trains one step (AdamW's
state exists only after the first step; a checkpoint before it would hold no optimizer state). Then, per
repeat, it times:

- **sync save**: ``pm.save(root)`` until it returns: DCP's parallel write, the manifest (every file hashed
  with SHA-256), the ``COMPLETE`` marker, fsyncs and the rename (``runtime.checkpoint_files``);
- **async save**: ``pm.save(root, async_save=True)`` until it returns (**blocks**: the copy of the state to
  host memory, all the training loop waits for) and until ``wait()`` returns (**total**: written and committed);
- **load, same plan**: ``pm.load`` of the synchronous checkpoint, files verified by SHA-256 (the default).

Then 2 ranks load each plan's checkpoint under another plan (**load, 2 ranks**; DCP reshards). Every time is
the slowest rank's; each figure is the median over ``--repeats``. Size: the bytes of every file in the
committed folder (DCP's shards and metadata, plan, RNG states, manifest).

The cost model (``checkpoint_cost``) predicts 12 bytes per parameter and a write of ``bytes / (devices x
per-device bandwidth)``; it assumes 0.12 GB/s per device (Llama 3's storage, the CLI's default), which is
compared with the measured sync save. This machine's disk is also measured (fsynced sequential writes) and
the prediction repeated at that bandwidth, taken as the aggregate for all ranks, since they share one disk.
The cost model's staging time (an asynchronous save's blocking) assumes a PCIe 5 device-to-host copy; on CPU
ranks the copy is host memory to host memory, so that row compares unlike things and is shown only for
completeness.

Caveats: loads follow their saves within seconds, so they read from the page cache, not the disk; and the
machine's cores are shared, so the load average before and after is recorded in the results file.
Writes ``benchmarks/results/checkpoint-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tessera
from tessera.cost_models.reliability import LLAMA3_STORAGE_BYTES_PER_S_PER_GPU, checkpoint_cost
from tessera.models import build_model, model_config
from tessera.planner.plan import Plan
from tessera.runtime.apply import apply_plan
from tessera.runtime.checkpoint_files import step_folder
from tessera.runtime.launch import spawn
from tessera.runtime.parallel_model import ParallelModel

HERE = Path(__file__).resolve().parent
MODELS = {
    "small": "gpt:layers=4,hidden=256,heads=8,vocab=2048,seq=128",  # 4.2M parameters
    "large": "gpt:layers=6,hidden=768,heads=12,vocab=8192,seq=128",  # 55M parameters
}
SMOKE_MODELS = {"tiny": "gpt-tiny"}
GLOBAL_BATCH, SEQ_LEN = 8, 32  # the step only creates AdamW's state: its size does not matter
SAVE_RANKS, RELOAD_RANKS = 4, 2
SAVED = {  # every field pinned, so the planner only evaluates them
    "DDP": "dp=4,zero=0,mbs=2,recompute=none",
    "ZeRO-3": "dp=4,zero=3,mbs=2,recompute=none",
    "TP2xDP2": "dp=2,tp=2,zero=0,mbs=4,recompute=none,sp=false",
}
RELOADED = {  # each checkpoint loaded on 2 ranks under another plan
    "DDP": "dp=2,zero=3,mbs=4,recompute=none",
    "ZeRO-3": "dp=1,tp=2,mbs=8,recompute=none,sp=false",
    "TP2xDP2": "dp=2,zero=0,mbs=4,recompute=none",
}
DISK_PROBE_BYTES = 256 << 20
TIMEOUT_S = 3600


# ------------------------------------------------------------------------------------------------ rank bodies


def save_and_load(spec: str, plans: dict[str, str], root: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    """On every rank: per plan, ``repeats`` sync saves, async saves and same-plan loads (slowest rank's seconds)."""
    results = {}
    for name, plan_json in plans.items():
        pm = build(spec, plan_json)
        pm.train_step(batch(spec))  # creates AdamW's state
        results[name] = time_saves_and_loads(pm, Path(root) / name, repeats)
        del pm
        gc.collect()
    return results


def load_under_other_plans(spec: str, plans: dict[str, str], root: str, repeats: int) -> dict[str, list[float]]:
    """On every rank: per plan, ``repeats`` loads of the checkpoint saved under another plan."""
    results = {}
    for name, plan_json in plans.items():
        pm = build(spec, plan_json)
        checkpoint = Path(root) / name / "sync-0"
        results[name] = [slowest(lambda pm=pm: pm.load(checkpoint)) for _ in range(repeats)]
        del pm
        gc.collect()
    return results


def build(spec: str, plan_json: str) -> ParallelModel:
    torch.manual_seed(0)
    return apply_plan(build_model(spec), Plan.from_json(plan_json))


def batch(spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(model_config(spec).vocab, (GLOBAL_BATCH, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, next-token targets


def time_saves_and_loads(pm: ParallelModel, root: Path, repeats: int) -> dict[str, list[float]]:
    """Each repeat saves to its own root (a step is saved once per root); only ``sync-0`` is kept for reloads."""
    times: dict[str, list[float]] = {"sync_s": [], "async_block_s": [], "async_total_s": [], "load_s": [],
                                     "size_bytes": []}
    for repeat in range(repeats):
        sync_root, async_root = root / f"sync-{repeat}", root / f"async-{repeat}"
        times["sync_s"].append(slowest(lambda: pm.save(sync_root)))
        block_s, total_s = time_async_save(pm, async_root)
        times["async_block_s"].append(block_s)
        times["async_total_s"].append(total_s)
        times["load_s"].append(slowest(lambda: pm.load(sync_root)))
        times["size_bytes"].append(folder_bytes(step_folder(sync_root, pm.step)))
        dist.barrier()
        if dist.get_rank() == 0:  # bound the disk used: a large model's checkpoint is ~0.7 GB
            shutil.rmtree(async_root)
            if repeat:
                shutil.rmtree(sync_root)
    return times


def time_async_save(pm: ParallelModel, root: Path) -> tuple[float, float]:
    """(seconds until ``save`` returned, seconds until committed), each the slowest rank's."""
    dist.barrier()
    started = time.perf_counter()
    pending = pm.save(root, async_save=True)
    blocked = time.perf_counter() - started
    pending.wait()
    total = time.perf_counter() - started
    return slowest_of(blocked), slowest_of(total)


def slowest(action: Callable[[], object]) -> float:
    """Seconds ``action`` takes on the slowest rank, all starting together."""
    dist.barrier()
    started = time.perf_counter()
    action()
    return slowest_of(time.perf_counter() - started)


def slowest_of(seconds: float) -> float:
    elapsed = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


# ------------------------------------------------------------------------------------------------ driver


def disk_write_bytes_per_s(folder: Path, nbytes: int, *, probes: int = 3) -> float:
    """Sequential write bandwidth of ``folder``'s disk: the median of ``probes`` fsynced writes of ``nbytes``
    (the disk is shared, so one probe can land in someone else's burst)."""
    block = os.urandom(16 << 20)
    path = folder / "disk-probe.bin"
    rates = []
    for _ in range(probes):
        started = time.perf_counter()
        with path.open("wb") as handle:
            for _ in range(max(1, nbytes // len(block))):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        rates.append(path.stat().st_size / (time.perf_counter() - started))
        path.unlink()
    return statistics.median(rates)


def make_plans(spec: str, strategies: dict[str, str], ranks: int) -> dict[str, Plan]:
    plans = {}
    for name, strategy in strategies.items():
        plan = tessera.plan(spec, f"cpu:ranks={ranks}", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN,
                            strategy=strategy, precision="fp32")
        if any(layer.recompute != "none" for layer in plan.layers):
            raise RuntimeError(f"the planner chose recomputation for the pinned {strategy}")
        plans[name] = plan
    return plans


def measure_model(model: str, spec: str, repeats: int, work: Path) -> list[dict]:
    """One spawn of 4 ranks saves and loads every plan; one of 2 ranks reloads each under another plan."""
    saved, reloaded = make_plans(spec, SAVED, SAVE_RANKS), make_plans(spec, RELOADED, RELOAD_RANKS)
    root = work / spec.replace(":", "_").replace(",", "_")
    as_json = {name: plan.to_json() for name, plan in saved.items()}
    measured = spawn(save_and_load, nprocs=SAVE_RANKS, args=(spec, as_json, str(root), repeats), timeout_s=TIMEOUT_S)[0]
    as_json = {name: plan.to_json() for name, plan in reloaded.items()}
    loads = spawn(load_under_other_plans, nprocs=RELOAD_RANKS, args=(spec, as_json, str(root), repeats), timeout_s=TIMEOUT_S)[0]
    shutil.rmtree(root, ignore_errors=True)
    return [{"model": model, "spec": spec, "plan": name, "params": saved[name].param_count, "reload_plan": RELOADED[name],
             **{key: statistics.median(values) for key, values in measured[name].items()},
             "reload_s": statistics.median(loads[name])} for name in SAVED]


def with_predictions(row: dict, disk_bytes_per_s: float) -> dict:
    """``row`` plus the cost model's size, write time (assumed and measured disk) and staging time."""
    assumed = checkpoint_cost(row["params"], num_devices=SAVE_RANKS,
                              write_bytes_per_s_per_device=LLAMA3_STORAGE_BYTES_PER_S_PER_GPU, asynchronous=True)
    local = checkpoint_cost(row["params"], num_devices=SAVE_RANKS, write_bytes_per_s_per_device=disk_bytes_per_s,
                            aggregate_write_bytes_per_s=disk_bytes_per_s)
    return {**row, "predicted_bytes": assumed.total_bytes, "predicted_write_s": assumed.write_time_s,
            "predicted_local_write_s": local.write_time_s, "predicted_staging_s": assumed.staging_time_s}


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


def measured_cells(row: dict) -> list[str]:
    return [row["plan"], f"{row['params'] / 1e6:.1f}M", f"{row['size_bytes'] / 1e6:.1f}", f"{row['sync_s']:.2f}",
            f"{row['async_block_s']:.2f}", f"{row['async_total_s']:.2f}", f"{row['load_s']:.2f}",
            f"{row['reload_s']:.2f} (`{row['reload_plan']}`)"]


def predicted_cells(row: dict) -> list[str]:
    return [row["plan"], f"{row['predicted_bytes'] / 1e6:.1f} vs {row['size_bytes'] / 1e6:.1f}",
            error(row["predicted_bytes"], row["size_bytes"]),
            f"{row['predicted_write_s']:.2f} vs {row['sync_s']:.2f}", error(row["predicted_write_s"], row["sync_s"]),
            f"{row['predicted_local_write_s']:.2f} vs {row['sync_s']:.2f}",
            error(row["predicted_local_write_s"], row["sync_s"]),
            f"{row['predicted_staging_s'] * 1e3:.1f} ms vs {row['async_block_s'] * 1e3:.0f} ms"]


MEASURED_HEADER = ["plan (4 ranks)", "params", "size (MB)", "sync save (s)", "async: blocks (s)",
                   "async: total (s)", "load, same plan (s)", "load, 2 ranks (s) (plan)"]
PREDICTED_HEADER = ["plan", "size MB: predicted vs measured", "error", "write s at 0.12 GB/s/device vs sync save",
                    "error", "write s at this disk vs sync save", "error", "staging (PCIe 5) vs async blocks"]


def error_summary(rows: list[dict]) -> str:
    """The range of each prediction's error over every row."""
    def span(predicted: str, measured: str) -> str:
        errors = [(row[predicted] - row[measured]) / row[measured] for row in rows]
        return f"{min(errors):+.0%} to {max(errors):+.0%}"

    return (f"Cost-model error over all rows: size {span('predicted_bytes', 'size_bytes')}; sync save time at "
            f"0.12 GB/s per device {span('predicted_write_s', 'sync_s')}, at this disk's bandwidth "
            f"{span('predicted_local_write_s', 'sync_s')}.")


def print_tables(rows: list[dict], console: Console) -> None:
    for title, header, cells in (("measured (median)", MEASURED_HEADER, measured_cells),
                                 ("cost model vs measured", PREDICTED_HEADER, predicted_cells)):
        table = Table(title=f"Checkpoints: {title}")
        for column in ["model", *header]:
            table.add_column(column)
        for row in rows:
            table.add_row(row["model"], *(cell.replace("`", "") for cell in cells(row)))
        console.print(table)


def markdown_table(rows: list[dict], header: list[str], cells: Callable[[dict], list[str]]) -> list[str]:
    return [f"| model | {' | '.join(header)} |", "|---" * (len(header) + 1) + "|",
            *[f"| {row['model']} | {' | '.join(cells(row))} |" for row in rows]]


def write_report(rows: list[dict], path: Path, *, args: argparse.Namespace, disk_bytes_per_s: float,
                 load_before: tuple[float, ...], load_after: tuple[float, ...]) -> Path:
    command = " ".join(["/work/venv/bin/python", "benchmarks/checkpoint_time.py", *sys.argv[1:]])
    models = {row["model"]: row["spec"] for row in rows}
    loads = "; ".join(f"{when}: {', '.join(f'{x:.2f}' for x in values)}"
                      for when, values in (("before", load_before), ("after", load_after)))
    lines = [
        "# Checkpoint save and load time, size, and the cost model's prediction", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo ranks with one torch "
        f"thread each; torch {torch.__version__}. Load average (1, 5, 15 min) {loads}. Disk: "
        f"{disk_bytes_per_s / 1e9:.2f} GB/s sequential write (median of 3 fsynced files).", "",
        f"Each plan saved on {SAVE_RANKS} ranks after one AdamW step (fp32); every time is the slowest rank's, the "
        f"median of {args.repeats} repeats. Sync save includes hashing every file for the manifest and the fsyncs; "
        f"loads verify SHA-256 and read from the page cache (they follow the save). \"load, 2 ranks\": the same "
        "checkpoint loaded on 2 ranks under the plan shown (resharded by DCP).", "",
        "Models: " + "; ".join(f"{model} `{spec}`" for model, spec in models.items()) + ".", "",
        "## Measured", "", *markdown_table(rows, MEASURED_HEADER, measured_cells), "",
        "## Cost model (`cost_models.reliability.checkpoint_cost`) vs measured", "",
        "Error is (predicted - measured) / measured. Size: 12 bytes per parameter (fp32 weights, AdamW's two "
        "moments); the checkpoint also holds AdamW's per-parameter `step`, DCP's metadata, RNG states, the plan and "
        "the manifest. Write time at the CLI's default 0.12 GB/s per device (Llama 3's storage) and at this "
        "machine's measured disk bandwidth (one disk shared by every rank); the model counts only the write, not "
        "hashing, fsyncs and DCP's planning. Staging assumes a PCIe 5 device-to-host copy, which CPU ranks do not "
        "make (their copy is host to host), so that column compares unlike things.", "",
        *markdown_table(rows, PREDICTED_HEADER, predicted_cells), "", error_summary(rows), "",
    ]
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,large", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="gpt-tiny, one repeat; no results file unless --out")
    parser.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/results/...)")
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1
    models = SMOKE_MODELS if args.smoke else {name: MODELS[name] for name in args.models.split(",")}
    console = Console(width=200)
    load_before = os.getloadavg()
    if load_before[0] >= 2:
        console.print(f"load average {load_before[0]:.1f}: other work shares the cores, times will be inflated")
    work = Path(tempfile.mkdtemp(prefix="tessera-checkpoint-bench-"))
    try:
        disk = disk_write_bytes_per_s(work, DISK_PROBE_BYTES >> 4 if args.smoke else DISK_PROBE_BYTES)
        rows = [with_predictions(row, disk) for model, spec in models.items()
                for row in measure_model(model, spec, args.repeats, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_tables(rows, console)
    console.print(error_summary(rows), f"disk: {disk / 1e9:.2f} GB/s", sep="\n")
    out = args.out or (None if args.smoke else HERE / "results" /
                       f"checkpoint-{platform.machine()}-cpu-{datetime.date.today().isoformat()}.md")
    if out is not None:
        write_report(rows, out, args=args, disk_bytes_per_s=disk, load_before=load_before, load_after=os.getloadavg())
        console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
