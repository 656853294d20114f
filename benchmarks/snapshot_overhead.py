"""In-memory snapshots on local gloo ranks: per-step overhead at ``k = 1``, and the work a failure loses with
snapshots against disk checkpoints alone.

Run: ``.venv/bin/python benchmarks/snapshot_overhead.py [--rounds 6] [--trials 4]`` (``--smoke``: one model, one
round, one trial each, no results file unless ``--out`` names one).

**Overhead.** Four ranks are two simulated nodes (ranks 0-1 and 2-3), each with its own store under
``/dev/shm`` (``runtime.snapshots``: own node plus buddy node). For each small model and plan the ranks train
in rounds; each round runs a block of ``BLOCK`` steps without snapshots, one with a snapshot after every step
(``k = 1``) and one with a snapshot every 4 steps, in turn; a block with snapshots ends by waiting for the last
one, so every snapshot's cost is inside its block. A round's overhead is its block's mean step time over the
same round's block without snapshots, minus one (rank 0's clock: every step ends in an all-reduce, so all
ranks finish it together); reported: the median over rounds and the lowest and highest, since the rounds
measure the drift of a shared machine's load as much as anything. Also shown: the bytes each rank writes per
snapshot, the staging copy (the part on the training thread, median) and the time a snapshot takes from
staging to commit on every node (in the background).

**Lost work.** A fault run: 4 ranks train ``gpt-tiny`` (TP 2 x DP 2) with a disk checkpoint every
``DISK_EVERY`` steps and, in the snapshot mode, a snapshot every step. Node 1's two ranks die at a random moment
(a timer, uniform over ``DISK_EVERY`` steps' time after a warm-up), node 1's store is deleted, and the two
survivors restart under another plan and recover. Lost work = steps rank 0 had completed before the failure
minus the step the restart resumed from.

Writes ``benchmarks/results/snapshot-<hardware>-<date>.md`` with the command and the load average before and
after (the machine's cores are shared with other work: read the numbers with that in mind).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.runtime.apply import apply_plan
from tessera.runtime.elastic import resume_if_possible
from tessera.runtime.launch import WorkerError, spawn
from tessera.runtime.snapshots import SnapshotConfig
from tessera.tests.distributed.harness import make_batches, make_model, make_plan

MODELS = {"gpt-tiny": "gpt-tiny:layers=4", "llama-tiny": "llama-tiny:layers=4"}
PLANS = {"DDP": "dp=4,zero=0,mbs=2", "TP2xDP2": "dp=2,tp=2,mbs=4"}
MODES = {"off": 0, "k=1": 1, "k=4": 4}
"""Blocks without snapshots, with one after every step, and with one every 4 steps (a ``k`` whose interval
hides a snapshot's background write on this machine)."""
BLOCK, WARMUP, RANKS_PER_NODE, DISK_EVERY, FAULT_STEPS = 8, 3, 2, 5, 40
FAULT_MODEL, FAULT_BEFORE, FAULT_AFTER = "gpt-tiny:layers=4", "dp=2,tp=2,mbs=4", "dp=2,zero=3,mbs=2"
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


# ------------------------------------------------------------------------------------------------ overhead (4 ranks)


def measure_overhead(cases: list[tuple[str, str]], rounds: int, stores: str) -> dict:
    """Rank body: per case, each round's block mean step time per mode, staging and commit times."""
    rank, results = dist.get_rank(), {}
    for spec, strategy in cases:
        model = make_model(spec, 0)
        pm = apply_plan(model, make_plan(spec, model, strategy))
        store = Path(stores) / f"{spec}-{strategy}" / f"node{rank // RANKS_PER_NODE}"
        snapshots = pm.enable_snapshots(SnapshotConfig(every=1, store=store, ranks_per_node=RANKS_PER_NODE))
        batches = make_batches(spec, BLOCK)
        for batch in batches[:WARMUP]:
            pm.train_step(batch)
        blocks: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode, every in MODES.items():
                pm.snapshots = snapshots if every else None
                snapshots.config = snapshots.config.model_copy(update={"every": every or 1})
                started = time.perf_counter()
                for batch in batches:
                    pm.train_step(batch)
                if every:
                    snapshots.wait()  # the last snapshot's remaining background time counts in its block
                blocks[mode].append((time.perf_counter() - started) / len(batches))
        staging_s, commit_s = [], []
        for _ in range(5):  # the training thread's share, then a snapshot's whole latency to commit on every node
            started = time.perf_counter()
            snapshots.snapshot(pm)
            staged = time.perf_counter()
            snapshots.wait()
            staging_s.append(staged - started)
            commit_s.append(time.perf_counter() - started)
        written = snapshots._staged.nbytes
        pm.snapshots = snapshots
        pm.close()
        results[(spec, strategy)] = {"blocks": blocks, "staging_s": staging_s, "commit_s": commit_s,
                                     "written_bytes": dist_max(written),
                                     "params": sum(p.numel() for p in model.parameters())}
    return results if rank == 0 else {}


def dist_max(value: int) -> int:
    """The largest ``value`` over the ranks."""
    box = torch.tensor(value)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box)


# ------------------------------------------------------------------------------------------------ lost work


def train_until_killed(mode: str, stores: str, disk: str, log: str, fraction: float) -> None:
    """Rank body (4 ranks): train; node 1 dies ``fraction`` x ``DISK_EVERY`` steps' time after the warm-up."""
    rank = dist.get_rank()
    pm = _fault_rank(FAULT_BEFORE, mode, Path(stores))
    batches = make_batches(FAULT_MODEL, FAULT_STEPS)
    started = None
    while pm.step < FAULT_STEPS:
        pm.train_step(batches[pm.step])
        if rank == 0:
            Path(log).write_text(str(pm.step))  # steps completed so far
        if pm.step % DISK_EVERY == 0:
            pm.save(disk)
        if pm.step == WARMUP:
            started = time.perf_counter()
        elif pm.step == 2 * WARMUP and rank >= RANKS_PER_NODE:
            step_s = (time.perf_counter() - started) / WARMUP
            threading.Timer(fraction * DISK_EVERY * step_s, os._exit, (1,)).start()


def recover(mode: str, stores: str, disk: str) -> int:
    """Rank body (2 ranks, node 0): recover under another plan; the step resumed from."""
    pm = _fault_rank(FAULT_AFTER, mode, Path(stores))
    resume_if_possible(pm, disk)
    step = pm.step
    pm.close()
    return step


def _fault_rank(strategy: str, mode: str, stores: Path):
    rank = dist.get_rank()
    model = make_model(FAULT_MODEL, rank)
    pm = apply_plan(model, make_plan(FAULT_MODEL, model, strategy))
    if mode == "snapshots":
        pm.enable_snapshots(SnapshotConfig(every=1, store=stores / f"node{rank // RANKS_PER_NODE}",
                                           ranks_per_node=RANKS_PER_NODE))
    return pm


def lost_work(mode: str, trials: int, seed: int) -> list[dict]:
    outcomes, draws = [], random.Random(seed)
    for _ in range(trials):
        work = Path(tempfile.mkdtemp(prefix="tessera-snapshot-bench-", dir=SHM))
        stores, disk, log = work / "stores", work / "disk", work / "completed"
        fraction = draws.random()
        try:
            spawn(train_until_killed, nprocs=4, args=(mode, str(stores), str(disk), str(log), fraction),
                  timeout_s=600)
            raise RuntimeError("node 1 was never killed: the run finished first; lower the kill delay")
        except WorkerError:
            pass
        completed = int(log.read_text())
        shutil.rmtree(stores / "node1", ignore_errors=True)
        resumed = spawn(recover, nprocs=2, args=(mode, str(stores), str(disk)), timeout_s=600)[0]
        outcomes.append({"completed": completed, "resumed": resumed, "lost": completed - resumed})
        shutil.rmtree(work, ignore_errors=True)
    return outcomes


# ------------------------------------------------------------------------------------------------ report


def rounds(overhead: dict) -> int:
    return len(next(iter(overhead.values()))["blocks"]["off"])


def report(overhead: dict, lost: dict, *, command: str, load_before: str, load_after: str) -> str:
    lines = [
        "# In-memory snapshots: per-step overhead at k = 1 and work lost per failure", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (the load average counts "
        f"them), gloo ranks with one torch thread each; torch {torch.__version__}. Stores under {SHM} (tmpfs). "
        f"`uptime` before: {load_before}; after: {load_after}.", "",
        "## Overhead of a snapshot after every step (4 ranks as 2 nodes, own + buddy store)", "",
        f"{rounds(overhead)} rounds of alternating blocks of {BLOCK} steps: without snapshots, with one after every "
        "step (k = 1), with one every 4 steps (k = 4); a block with snapshots includes waiting for its last one. "
        "Overhead: per round, the block's mean step time over the same round's block without snapshots, minus "
        "one; median over rounds [lowest, highest]. Written: the most bytes one rank writes per snapshot "
        "(replicated chunks once). Staging: the copy on the training thread (median). Commit: one snapshot from "
        "staging to committed on every node (background, overlapped with the next step; median).", "",
        "| model | params | plan | step, no snapshots (ms) | k = 1 overhead | k = 4 overhead | written per rank "
        "| staging (ms) | commit (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (spec, strategy), result in overhead.items():
        blocks = result["blocks"]
        ratios = {mode: [b / off - 1 for b, off in zip(blocks[mode], blocks["off"])] for mode in MODES if mode != "off"}
        cells = " | ".join(f"{statistics.median(r):+.1%} [{min(r):+.1%}, {max(r):+.1%}]" for r in ratios.values())
        lines.append(f"| `{spec}` | {result['params'] / 1e3:,.0f}K | `{strategy}` | "
                     f"{statistics.median(blocks['off']) * 1e3:,.1f} | {cells} | "
                     f"{result['written_bytes'] / 1e6:,.2f} MB | {statistics.median(result['staging_s']) * 1e3:,.2f} "
                     f"| {statistics.median(result['commit_s']) * 1e3:,.0f} |")
    if not lost:
        return "\n".join(lines) + "\n"
    lines += ["", f"## Work lost per failure (steps): `{FAULT_MODEL}`, `{FAULT_BEFORE}` on 4 ranks -> "
              f"`{FAULT_AFTER}` on 2", "",
              f"Disk checkpoint every {DISK_EVERY} steps in both modes; node 1 killed at a random moment.", "",
              "| mode | trials (completed -> resumed) | mean lost steps |", "|---|---|---|"]
    for mode, outcomes in lost.items():
        pairs = ", ".join(f"{o['completed']}->{o['resumed']}" for o in outcomes)
        lines.append(f"| {mode} | {pairs} | {statistics.mean(o['lost'] for o in outcomes):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-lost-work", action="store_true", help="measure the overhead only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.popen("uptime").read().strip()
    cases = [(spec, plan) for spec in MODELS.values() for plan in PLANS.values()]
    rounds, trials = (1, 1) if args.smoke else (args.rounds, args.trials)
    if args.smoke:
        cases = cases[:1]
    stores = tempfile.mkdtemp(prefix="tessera-snapshot-bench-", dir=SHM)
    try:
        overhead = spawn(measure_overhead, nprocs=4, args=(cases, rounds, stores), timeout_s=1800)[0]
    finally:
        shutil.rmtree(stores, ignore_errors=True)
    lost = {} if args.no_lost_work else {mode: lost_work(mode, trials, seed=1) for mode in ("snapshots", "disk only")}
    command = " ".join([".venv/bin/python", "benchmarks/snapshot_overhead.py", *sys.argv[1:]])
    text = report(overhead, lost, command=command, load_before=load_before, load_after=os.popen("uptime").read().strip())
    print(text)
    out = args.out
    if out is None and not args.smoke:
        today = datetime.date.today().isoformat()
        out = Path(__file__).parent / "results" / f"snapshot-{platform.machine()}-cpu-{today}.md"
    if out is not None:
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
