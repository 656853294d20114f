"""The training thread's share of an in-memory snapshot (``Snapshotter.snapshot``: staging copy and header), with a
constant learning rate and with one that moves every step, as a schedule moves it; one process.

Run: ``.venv/bin/python benchmarks/snapshot_staging.py [--model gpt-tiny:layers=4] [--snapshots 20]``. Prints the
median over ``--snapshots`` snapshots of each case. The learning rate is changed by hand (no scheduler), so the
same script measures a checkout from before schedulers were supported (there a moved learning rate rebuilt the
staging buffer: DCP's ``get_state_dict`` at every snapshot).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tessera.runtime.apply import apply_plan
from tessera.runtime.snapshots import SnapshotConfig
from tessera.tests.distributed.harness import make_batches, make_model, make_plan


def staging_ms(spec: str, snapshots: int, *, moving: bool) -> float:
    """Median milliseconds ``snapshot()`` keeps the training thread, after a first (untimed) snapshot."""
    model = make_model(spec, 0)
    pm = apply_plan(model, make_plan(spec, model, "dp=1,mbs=8"))
    snapshotter = pm.enable_snapshots(SnapshotConfig(every=1, store=Path(tempfile.mkdtemp()) / "store"))
    pm.snapshots = None  # taken by hand below
    pm.train_step(make_batches(spec, 1)[0])
    snapshotter.snapshot(pm)
    snapshotter.wait()
    times = []
    for _ in range(snapshots):
        if moving:
            for group in pm.optimizer.param_groups:
                group["lr"] *= 0.99
        started = time.perf_counter()
        snapshotter.snapshot(pm)
        times.append(time.perf_counter() - started)
        snapshotter.wait()
    pm.snapshots = snapshotter
    pm.close()
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny:layers=4")
    parser.add_argument("--snapshots", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for moving in (False, True):
        print(f"{args.model}, learning rate {'moving every step' if moving else 'constant'}: "
              f"{staging_ms(args.model, args.snapshots, moving=moving):.2f} ms on the training thread per snapshot "
              f"(median of {args.snapshots})")


if __name__ == "__main__":
    main()
