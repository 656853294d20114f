"""In-memory snapshots on local gloo ranks: per-step overhead at ``k = 1``, and the work a failure loses with
snapshots against disk checkpoints alone.

Run: ``.venv/bin/python benchmarks/snapshot_overhead.py [--rounds 6] [--trials 4]`` (``--smoke``: one model, one
round, one trial each, no results file unless ``--out`` names one).

**Overhead.** Four ranks are two simulated nodes (ranks 0-1 and 2-3), each with its own store under
``/dev/shm`` (``runtime.snapshots``: own node plus buddy node). For each small model and plan the ranks train,
with the learning rate on a cosine schedule as training's is (it changes every step, and so does each
snapshot's header), in rounds; each round runs a block of ``BLOCK`` steps per mode (no snapshots, one every ``k`` = 1, 2, 4, 8
steps), the modes in turn, each round starting at the next mode. A block is timed in steady state: after an
untimed step and snapshot, so its first steps overlap the snapshot before them as in a run, and the timer stops
without waiting for the block's last snapshot. A round's overhead is its block's mean step time over the same
round's block without snapshots, minus one (rank 0's clock: every step ends in an all-reduce, so all ranks
finish it together); reported: the median over rounds and the lowest and highest, since the rounds measure the drift
of a shared machine's load as much as anything. Also shown: the bytes each rank writes per snapshot, what the
training thread spends per snapshot in the k = 1 blocks (rank 0's median; rank 0 also writes the plan and data
position): its wait for the snapshot before and its staging copy into the staging buffer, the time a snapshot takes
from staging to commit on every node (in the background), and CPU time, which the load hardly moves: each rank's
process CPU per step with and without snapshots (every thread: training, the snapshot thread, gloo's) and the
snapshot thread's own.

**Lost work.** A fault run: 4 ranks train ``gpt-tiny`` (TP 2 x DP 2) with a disk checkpoint every
``DISK_EVERY`` steps and, in the snapshot mode, a snapshot every step. Node 1's two ranks die at a random moment
(a timer, uniform over ``DISK_EVERY`` steps' time after a warm-up), node 1's store is deleted, and the two
survivors restart under another plan and recover. Lost work = steps rank 0 had completed before the failure
minus the step the restart resumed from.

**Predicted.** Before the cases the ranks run ``tessera profile``'s snapshot probe; the cost model's k = 1
overhead for each case (``cost_models.reliability``: on CPU ranks training pays the snapshot's whole work) is
shown beside the measured one.

Writes ``benchmarks/results/snapshot-<hardware>-<date>.md`` with the command and the load average before and
after (the machine's cores are shared with other work: read the numbers with that in mind).
"""

from __future__ import annotations

import argparse
import datetime
import math
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

from tessera.cost_models.reliability import SnapshotWork, snapshot_cost
from tessera.runtime.apply import apply_plan
from tessera.runtime.elastic import resume_if_possible
from tessera.runtime.launch import WorkerError, spawn
from tessera.runtime.snapshots import SnapshotConfig
from tessera.cost_models.types import TrainingConfig
from tessera.models import model_config
from tessera.tests.distributed.harness import make_batches, make_model, make_plan
from tessera.topology.measure import ProfileSweep
from tessera.topology.measure_device import snapshot_work

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_truth import GLOBAL_BATCH as SMALL_BATCH, MODELS as SMALL_MODELS, SEQ_LEN as SMALL_SEQ  # noqa: E402

TINY = {"gpt-tiny": "gpt-tiny:layers=4", "llama-tiny": "llama-tiny:layers=4"}
"""The distributed tests' models and batch (``GLOBAL_BATCH`` x ``SEQ_LEN`` of ``tests/distributed/harness``: 8 x
16 tokens): steps of 20-130 ms, where a snapshot's fixed costs (a collective, a few files) weigh most."""
MODELS = {**TINY, **SMALL_MODELS}
"""Also ``local_truth``'s small GPT and Llama (5.3M and 5.5M parameters) at its batch, 16 x 256 tokens: what the
cost model is checked against on these ranks."""
PLANS = {"DDP": "dp=4,zero=0,mbs=2", "TP2xDP2": "dp=2,tp=2,mbs=4"}
ROUND_SCALE = {("tiny", "DDP"): 3, ("tiny", "TP2xDP2"): 1, ("small", "DDP"): 1, ("small", "TP2xDP2"): 1}
"""Rounds per size and plan, times ``--rounds``: the tiny models' DDP steps are 5-10x shorter than their
tensor-parallel ones here, so more of its rounds fit in the same time (and its overhead, the larger, needs
them); the small models' steps take 0.4-1 s."""
MODES = {"off": 0, "k=1": 1, "k=2": 2, "k=4": 4, "k=8": 8}
"""Blocks without snapshots and with one every ``k`` steps."""
BLOCK, WARMUP, RANKS_PER_NODE, DISK_EVERY, FAULT_STEPS = 8, 3, 2, 5, 40
FAULT_MODEL, FAULT_BEFORE, FAULT_AFTER = "gpt-tiny:layers=4", "dp=2,tp=2,mbs=4", "dp=2,zero=3,mbs=2"
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
GOAL = 0.05


def cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate's schedule: cosine over 10,000 steps (every step moves it)."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)


# ------------------------------------------------------------------------------------------------ overhead (4 ranks)


def measure_overhead(cases: list[tuple[str, str, int]], stores: str) -> dict:
    """Rank body: per case, each round's block mean step time (wall and this process's CPU) per mode, the
    background thread's CPU per snapshot, staging and commit times, the load average per round; and first, what
    ``tessera profile`` measures of a snapshot's work on these ranks (the cost model's input)."""
    rank, results = dist.get_rank(), {}
    host_rate = SnapshotWork(*snapshot_work(sweep=ProfileSweep()))
    for spec, strategy, rounds in cases:
        model = make_model(spec, 0)
        pm = apply_plan(model, case_plan(spec, model, strategy), lr_scheduler_factory=cosine)
        store = Path(stores) / f"{spec}-{strategy}" / f"node{rank // RANKS_PER_NODE}"
        snapshots = pm.enable_snapshots(SnapshotConfig(every=1, store=store, ranks_per_node=RANKS_PER_NODE))
        pm.snapshots = None  # the blocks below take their snapshots themselves
        batches = case_batches(spec, BLOCK)
        for batch in batches[:WARMUP]:
            pm.train_step(batch)
        wall: dict[str, list[float]] = {mode: [] for mode in MODES}
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        background_cpu_s, snapshots_taken, load, waits = 0.0, 0, [], {"wait": [], "staging": []}
        for round_ in range(rounds):
            load.append(os.getloadavg()[0])
            order = list(MODES)[round_ % len(MODES):] + list(MODES)[:round_ % len(MODES)]  # no mode always first
            for mode in order:
                every = MODES[mode]
                before = snapshots.background_cpu_s
                block_wall, block_cpu = run_block(pm, snapshots, batches, every, waits if every == 1 else None)
                wall[mode].append(block_wall)
                cpu[mode].append(block_cpu)
                if every:
                    background_cpu_s += snapshots.background_cpu_s - before
                    snapshots_taken += 1 + len(batches) // every
        commit_s = []
        for batch in batches[:5]:  # a snapshot's whole latency to commit on every node, after a step as in a run
            pm.train_step(batch)
            started = time.perf_counter()
            snapshots.snapshot(pm)
            snapshots.wait()
            commit_s.append(time.perf_counter() - started)
        written = snapshots._staged.nbytes
        pm.snapshots = snapshots
        pm.close()
        results[(spec, strategy)] = {"wall": wall, "cpu": cpu, "staging_s": waits["staging"], "wait_s": waits["wait"],
                                     "commit_s": commit_s,
                                     "background_cpu_s": background_cpu_s / snapshots_taken, "load": load,
                                     "written_bytes": dist_max(written), "host_rate": host_rate,
                                     "params": sum(p.numel() for p in model.parameters())}
    return results


def case_plan(spec: str, model, strategy: str):
    """The harness's hand-built plan, at ``local_truth``'s batch for its small models."""
    plan = make_plan(spec, model, strategy)
    if spec in SMALL_MODELS.values():
        plan = plan.model_copy(update={"training": TrainingConfig(global_batch=SMALL_BATCH, seq_len=SMALL_SEQ,
                                                                  precision=plan.training.precision)})
    return plan


def case_batches(spec: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches: the harness's, or ``local_truth``'s shape for its small models."""
    if spec not in SMALL_MODELS.values():
        return make_batches(spec, steps)
    tokens = torch.randint(model_config(spec).vocab, (steps, SMALL_BATCH, SMALL_SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]


def run_block(pm, snapshots, batches: list, every: int, waits: dict | None = None) -> tuple[float, float]:
    """Mean wall and process-CPU seconds per step over ``batches``, with a snapshot after every ``every``-th
    step (0: none). Steady state: an untimed step and snapshot first, so the timed steps overlap the one before
    them as they do in a run, and the timer stops without waiting for the last one (its tail belongs to the
    steps after it); the waits between blocks are untimed. ``waits``: where to append, per snapshot, the
    training thread's wait for the one before it and its own staging."""
    snapshots.wait()
    pm.train_step(batches[0])
    if every:
        snapshots.snapshot(pm)
    wall, cpu = time.perf_counter(), time.process_time()
    for index, batch in enumerate(batches, start=1):
        pm.train_step(batch)
        if every and index % every == 0:  # what train_step's own snapshot does: wait for the last one, stage
            started = time.perf_counter()
            snapshots.wait()
            waited = time.perf_counter()
            snapshots.snapshot(pm)
            if waits is not None:
                waits["wait"].append(waited - started)
                waits["staging"].append(time.perf_counter() - waited)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    snapshots.wait()
    return wall / len(batches), cpu / len(batches)


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


def merge_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's results, with the CPU figures averaged over the ranks (each rank measures its own process)."""
    merged = per_rank[0]
    for case, result in merged.items():
        cases = [results[case] for results in per_rank]
        result["cpu"] = {mode: [statistics.mean(values) for values in zip(*(c["cpu"][mode] for c in cases))]
                         for mode in MODES}
        result["background_cpu_s"] = statistics.mean(c["background_cpu_s"] for c in cases)
    return merged


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):+.1%} [{min(values):+.1%}, {max(values):+.1%}]"


def cpu_figures(result: dict) -> dict:
    """Per rank: training's CPU per step without snapshots, the CPU one snapshot adds (the k = 1 blocks' CPU per
    step over the same round's block without, all threads: staging, the background thread, gloo's), and the
    ``k`` at which that added CPU is ``GOAL`` of a step's (what a machine whose cores training saturates pays)."""
    cpu = result["cpu"]
    step = statistics.median(cpu["off"])
    added = statistics.median([k1 - off for k1, off in zip(cpu["k=1"], cpu["off"])])
    return {"step": step, "added": added, "k": max(1, math.ceil(added / (GOAL * step)))}


def predicted(result: dict) -> dict:
    """The cost model's k = 1 overhead (``reliability.snapshot_cost``'s work per rank, from the profiled rate,
    over the measured step without snapshots: the snapshot model alone, not the step-time model) and the
    smallest ``k`` it puts within ``GOAL``."""
    cost = snapshot_cost(result["params"], num_devices=4, devices_per_node=RANKS_PER_NODE, host_rate=result["host_rate"])
    share = cost.host_work_s / statistics.median(result["wall"]["off"])
    return {"work": cost.host_work_s, "overhead": share, "k": max(1, math.ceil(share / GOAL))}


def smallest_k(result: dict) -> str:
    """The smallest measured ``k`` whose median wall-clock overhead is within ``GOAL``."""
    wall = result["wall"]
    for mode, every in MODES.items():
        if every and statistics.median([b / off - 1 for b, off in zip(wall[mode], wall["off"])]) <= GOAL:
            return str(every)
    return f"> {max(MODES.values())}"


def report(overhead: dict, lost: dict, *, command: str, load_before: str, load_after: str) -> str:
    loads = [value for result in overhead.values() for value in result["load"]]
    modes = [mode for mode, every in MODES.items() if every]
    lines = [
        "# In-memory snapshots: per-step overhead at k = 1 and work lost per failure", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (the load average counts "
        f"them), gloo ranks with one torch thread each; torch {torch.__version__}. Stores under {SHM} (tmpfs). "
        f"`uptime` before: {load_before}; after: {load_after}. 1-minute load at the start of each round: "
        f"{min(loads):.1f}-{max(loads):.1f}.", "",
        "## Overhead of a snapshot every k steps (4 ranks as 2 nodes, own + buddy store)", "",
        f"{'/'.join(str(len(r['wall']['off'])) for r in overhead.values())} rounds (per case, in order); each runs "
        f"a block of {BLOCK} steps per mode, the modes in turn "
        "(each round starting at the next one). A block is timed in steady state: after an untimed step (and "
        "snapshot), so its first steps overlap the snapshot before them, and without waiting for its last one. "
        "Overhead: per round, the block's mean step time over the same round's block without snapshots, minus "
        "one; median over rounds [lowest, highest]. Written: the most bytes one rank writes per snapshot "
        "(replicated chunks once). In the k = 1 blocks, per snapshot (median, rank 0): the training thread's wait "
        "for the snapshot before it, then its staging (the copy into the staging buffer). Commit: one snapshot from "
        "staging to committed on every node, after a step (background, overlapped with the next steps in a run; "
        "median of 5).", "",
        "| model | params | plan | step, no snapshots (ms) | " + " | ".join(f"{m} overhead" for m in modes)
        + " | written per rank | wait (ms) | staging (ms) | commit (ms) |",
        "|---|---|---|---|" + "---|" * len(modes) + "---|---|---|---|",
    ]
    for (spec, strategy), result in overhead.items():
        wall = result["wall"]
        cells = " | ".join(spread([b / off - 1 for b, off in zip(wall[m], wall["off"])]) for m in modes)
        lines.append(f"| `{spec}` | {result['params'] / 1e3:,.0f}K | `{strategy}` | "
                     f"{statistics.median(wall['off']) * 1e3:,.1f} | {cells} | "
                     f"{result['written_bytes'] / 1e6:,.2f} MB | {statistics.median(result['wait_s']) * 1e3:,.2f} | "
                     f"{statistics.median(result['staging_s']) * 1e3:,.2f} | "
                     f"{statistics.median(result['commit_s']) * 1e3:,.0f} |")
    fixed, rate, swap = next(iter(overhead.values()))["host_rate"]
    lines += ["", "## Predicted by the cost model", "",
              "`cost_models.reliability`: on CPU ranks training pays a snapshot's whole work, "
              "fixed + bytes / rate + bytes / swap rate per rank, as `tessera profile` measures them "
              "(`topology.measure_device.snapshot_work`), here on these 4 ranks just before the cases: "
              f"{fixed * 1e3:.1f} ms + {rate / 1e9:.3f} GB/s + swap {swap / 1e9:.3f} GB/s. Bytes: the model's, 12 per "
              "parameter over the 4 ranks. Predicted overhead: "
              "that work over the measured step without snapshots. Predicted k: the smallest with the predicted "
              f"overhead within {GOAL:.0%}; measured k: the smallest above whose median overhead is.", "",
              "| model | plan | predicted work (ms) | predicted k=1 overhead | measured k=1 overhead (median) | "
              "predicted k | measured k |", "|---|---|---|---|---|---|---|"]
    for (spec, strategy), result in overhead.items():
        model, wall = predicted(result), result["wall"]
        measured = statistics.median([b / off - 1 for b, off in zip(wall["k=1"], wall["off"])])
        lines.append(f"| `{spec}` | `{strategy}` | {model['work'] * 1e3:,.1f} | {model['overhead']:+.1%} | "
                     f"{measured:+.1%} | {model['k']} | {smallest_k(result)} |")
    lines += ["", "## CPU time: what a snapshot costs whatever the load", "",
              "Per rank (mean over the 4), median over rounds, `time.process_time` (every thread of the rank's "
              "process). Added per snapshot: the k = 1 block's CPU per step minus the same round's block without "
              "snapshots (staging, the background thread, gloo's threads for the copy and the agreement). "
              "Background thread: its own `time.thread_time` per snapshot (write, hash, collectives, commit). "
              f"CPU-bound k: the k at which the added CPU is {GOAL:.0%} of a step's (where training saturates "
              f"every core, as 4 ranks on {os.cpu_count()} cores do, that is what the wall clock pays). Measured: "
              f"the smallest k above whose median overhead is within {GOAL:.0%}.", "",
              "| model | plan | training CPU per step (ms) | added CPU per snapshot (ms) | of it, background thread "
              "(ms) | added / step | CPU-bound k | measured k |", "|---|---|---|---|---|---|---|---|"]
    for (spec, strategy), result in overhead.items():
        figures = cpu_figures(result)
        lines.append(f"| `{spec}` | `{strategy}` | {figures['step'] * 1e3:,.1f} | {figures['added'] * 1e3:,.1f} | "
                     f"{result['background_cpu_s'] * 1e3:,.1f} | {figures['added'] / figures['step']:.0%} | "
                     f"{figures['k']} | {smallest_k(result)} |")
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
    parser.add_argument("--plans", nargs="+", choices=list(PLANS), default=list(PLANS),
                        help="measure these plans only")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="measure these models only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.popen("uptime").read().strip()
    rounds, trials = (1, 1) if args.smoke else (args.rounds, args.trials)
    cases = [(MODELS[name], PLANS[plan], rounds * ROUND_SCALE["tiny" if name in TINY else "small", plan])
             for name in args.models for plan in args.plans]
    if args.smoke:
        cases = cases[:1]
    stores = tempfile.mkdtemp(prefix="tessera-snapshot-bench-", dir=SHM)
    try:
        overhead = merge_ranks(spawn(measure_overhead, nprocs=4, args=(cases, stores), timeout_s=3600))
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
