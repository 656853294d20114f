"""Where one in-memory snapshot's CPU goes, part by part, and the hash rates that chose its hash.

Run: ``.venv/bin/python benchmarks/snapshot_parts.py [--model SPEC] [--strategy S] [--snapshots N]``.

**Hash rates.** SHA-256 (disk checkpoints) and XXH3-128 (snapshots) over 16 MiB in this process, GB/s.

**Parts.** Four gloo ranks as two simulated nodes (``benchmarks/snapshot_overhead.py``'s layout) train the
model; each of ``--snapshots`` rounds is a training step alone, then a step followed by a snapshot that is
waited for, with a barrier and a pause between, so nothing overlaps. Per rank and per part, the median of the
thread's own CPU time (``time.thread_time``) around it: ``staging`` (training thread), ``hash``, ``write`` (each
file written from memory), ``agree`` (the one all-reduce), ``swap`` (the copy to and from the buddy; gloo's
threads do most of it and are not in this figure), ``commit`` (node leaders) and ``background`` (the snapshot
thread's whole share). ``process`` is the rank's CPU over every thread for the step with its snapshot, less the
median step alone: what one snapshot costs in all.

The defaults are ``local_truth``'s small GPT under DDP (16 MB per rank per snapshot).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from tessera.runtime import snapshots
from tessera.runtime.apply import apply_plan
from tessera.runtime.launch import spawn
from tessera.runtime.snapshot_staging import StagedShards
from tessera.runtime.snapshots import SnapshotConfig, Snapshotter
from tessera.tests.distributed.harness import make_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from snapshot_overhead import RANKS_PER_NODE, SHM, case_batches, case_plan  # noqa: E402

PARTS = {"staging": (Snapshotter, "_staged_for"), "hash": (StagedShards, "record"), "write": (snapshots, "_write_file"),
         "agree": (snapshots, "agree_on_table"), "swap": (Snapshotter, "_swap"),
         "commit": (snapshots, "commit_snapshot"), "background": (Snapshotter, "_write")}


def hash_rates_gb_s(nbytes: int = 16 << 20, repeats: int = 5) -> dict[str, float]:
    content = os.urandom(nbytes)
    rates = {}
    for name, digest in (("SHA-256", hashlib.sha256), ("XXH3-128", xxhash.xxh3_128)):
        started = time.perf_counter()
        for _ in range(repeats):
            digest(content).digest()
        rates[name] = repeats * nbytes / (time.perf_counter() - started) / 1e9
    return rates


def timed_parts(times: dict[str, list[float]]) -> None:
    """Wrap every part of ``PARTS`` so that each call appends its thread CPU milliseconds to ``times``."""
    for part, (owner, name) in PARTS.items():
        original = getattr(owner, name)

        def timed(*args, _original=original, _part=part, **kwargs):
            started = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                times.setdefault(_part, []).append((time.thread_time() - started) * 1e3)

        setattr(owner, name, timed)


def measure(spec: str, strategy: str, rounds: int, stores: str) -> dict[str, float]:
    """Rank body: the median CPU milliseconds of each part, and of a whole snapshot (``process``)."""
    torch.set_num_threads(1)
    rank, times = dist.get_rank(), {}
    timed_parts(times)
    model = make_model(spec, 0)
    pm = apply_plan(model, case_plan(spec, model, strategy))
    snapshotter = pm.enable_snapshots(SnapshotConfig(every=1, store=Path(stores) / f"node{rank // RANKS_PER_NODE}",
                                                     ranks_per_node=RANKS_PER_NODE))
    pm.snapshots = None  # taken by hand below
    batches = case_batches(spec, rounds)
    for batch in batches[:3]:  # warm-up, and the store's files to recycle
        pm.train_step(batch)
        snapshotter.snapshot(pm)
        snapshotter.wait()
    times.clear()
    alone, with_snapshot = [], []
    for batch in batches:
        for snapshot in (False, True):
            dist.barrier()
            started = time.process_time()
            pm.train_step(batch)
            if snapshot:
                snapshotter.snapshot(pm)
                snapshotter.wait()
            dist.barrier()
            time.sleep(0.05)  # the background thread's commit and gloo's threads finish inside the window
            (with_snapshot if snapshot else alone).append((time.process_time() - started) * 1e3)
    pm.snapshots = snapshotter
    pm.close()
    medians = {part: statistics.median(values) for part, values in times.items()}
    medians["process"] = statistics.median(with_snapshot) - statistics.median(alone)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt:layers=4,hidden=256,heads=8,vocab=4096,seq=256")
    parser.add_argument("--strategy", default="dp=4,zero=0,mbs=2")
    parser.add_argument("--snapshots", type=int, default=12)
    args = parser.parse_args()
    print(f"`uptime` before: {os.popen('uptime').read().strip()}")
    print("hash rates over 16 MiB: " + ", ".join(f"{name} {rate:.1f} GB/s" for name, rate in hash_rates_gb_s().items()))
    stores = tempfile.mkdtemp(prefix="tessera-snapshot-parts-", dir=SHM)
    try:
        per_rank = spawn(measure, nprocs=4, args=(args.model, args.strategy, args.snapshots, stores), timeout_s=1800)
    finally:
        shutil.rmtree(stores, ignore_errors=True)
    parts = list(dict.fromkeys(part for medians in per_rank for part in medians))
    print(f"\n{args.model}, {args.strategy}: CPU ms per snapshot, median of {args.snapshots} (rank: parts)")
    for rank, medians in enumerate(per_rank):
        print(f"rank {rank}: " + ", ".join(f"{part} {medians[part]:.2f}" for part in parts if part in medians))
    print(f"`uptime` after: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
