"""In-memory snapshots on one device: the step time a snapshot every step adds, and what the training thread spends
on each, against what the cost model charges (``cost_models.reliability``: on an accelerator, the staging copy to
host memory over PCIe; on CPU ranks, the whole work as ``tessera profile`` measures it).

Run where a GPU is lent (``benchmarks/gpu_session.sh`` does): ``python benchmarks/snapshot_gpu.py [--rounds 3]
[--steps 4]``; ``--device cpu`` is a dry run of the harness on a tiny model (``tests/unit/test_gpu_check.py``).
One device, no process group, so one node and no buddy: the background thread writes and hashes on the host's
otherwise idle cores. Each configuration is planned and applied as ``gpu_check.py`` does; its steps run in blocks
of ``--steps``, with snapshots and without in turn (each round starting at the other mode), ``synchronize`` around
each block. Overhead: the median block step time with snapshots over the median without, minus one. Writes
``benchmarks/results/snapshot-<device>-<date>.md`` (or under ``--out``). Never needed for CI.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_check import SMALL_GPT, SMALL_LLAMA, catalog_cluster, planned, synchronize  # noqa: E402

CONFIGS = {  # (name, model spec, sequence length, micro-batch, precision); two micro-batches per step
    "cuda": [("gpt-bf16-mbs4", SMALL_GPT, 1024, 4, "bf16"), ("llama-bf16-mbs4", SMALL_LLAMA, 2048, 4, "bf16")],
    "cpu": [("tiny-fp32-mbs2", "gpt-tiny:layers=2", 64, 2, "fp32")],
}
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def measure(config: tuple, device: str, *, rounds: int, steps: int) -> dict:
    """Step time with and without a snapshot every step, the training thread's time per snapshot (its wait for the
    one before and its staging) and the background thread's CPU per snapshot, and the model's price."""
    from tessera.cost_models.reliability import host_snapshot_rate, snapshot_cost
    from tessera.models import build_model, model_config
    from tessera.runtime.apply import apply_plan
    from tessera.runtime.snapshots import SnapshotConfig
    from tessera.topology import load_cluster

    name, spec, seq_len, micro_batch, precision = config
    cluster = "cpu:ranks=1" if device == "cpu" else catalog_cluster(torch.cuda.get_device_name())
    plan = planned(spec, cluster, seq_len, micro_batch, "none", precision)
    torch.manual_seed(0)
    parallel = apply_plan(build_model(spec, device=device), plan)
    tokens = torch.randint(model_config(spec).vocab, (plan.training.global_batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(1)).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    with tempfile.TemporaryDirectory(prefix="tessera-snapshot-gpu-", dir=SHM) as folder:
        snapshots = parallel.enable_snapshots(SnapshotConfig(every=1, store=Path(folder) / "store"))
        parallel.train_step(batch)  # warm-up: kernels, optimizer state, the staging buffer
        blocks: dict[str, list[float]] = {"off": [], "k=1": []}
        for round_ in range(rounds):
            for mode in ("off", "k=1") if round_ % 2 == 0 else ("k=1", "off"):
                parallel.snapshots = snapshots if mode == "k=1" else None
                snapshots.wait()
                synchronize(device)
                started = time.perf_counter()
                for _ in range(steps):
                    parallel.train_step(batch)
                synchronize(device)
                blocks[mode].append((time.perf_counter() - started) / steps)
        parallel.snapshots = snapshots
        taken, training_s, background_s = snapshots.taken, snapshots.training_thread_s, snapshots.background_cpu_s
        parallel.close()
    cost = snapshot_cost(plan.param_count, num_devices=1, devices_per_node=1,
                         host_rate=host_snapshot_rate(load_cluster(cluster).device))
    off, on = statistics.median(blocks["off"]), statistics.median(blocks["k=1"])
    return {"config": name, "model": spec, "params": plan.param_count, "step_s": off, "overhead": on / off - 1,
            "training_thread_s": training_s / taken, "background_cpu_s": background_s / taken,
            "predicted_s": cost.training_pays_s(), "predicted_overhead": cost.training_pays_s() / off,
            "priced_as": "whole work on the host's cores" if cost.host_work_s else "staging copy over PCIe"}


def markdown(rows: list[dict], *, device_name: str, command: str) -> str:
    lines = [f"# In-memory snapshots on one device ({datetime.date.today().isoformat()})", "",
             f"Device: {device_name}. Command: `{command}`. One process, one node (no buddy). Training thread: its "
             "wait for the snapshot before and its staging, per snapshot. Predicted: what the cost model charges "
             "training per snapshot, and that over the measured step.", "",
             "| config | params | step (ms) | k = 1 overhead | training thread per snapshot (ms) | background CPU "
             "per snapshot (ms) | predicted per snapshot (ms) | predicted overhead | priced as |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | - | - | - | - | - | - | - | FAILED {r['error']} |")
            continue
        lines.append(f"| {r['config']} | {r['params'] / 1e6:,.1f}M | {r['step_s'] * 1e3:,.1f} | {r['overhead']:+.1%} | "
                     f"{r['training_thread_s'] * 1e3:,.2f} | {r['background_cpu_s'] * 1e3:,.1f} | "
                     f"{r['predicted_s'] * 1e3:,.2f} | {r['predicted_overhead']:+.1%} | {r['priced_as']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per block")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run with --device cpu for a dry run of the harness")
    rows = []
    for config in CONFIGS[args.device]:
        try:
            rows.append(measure(config, args.device, rounds=args.rounds, steps=args.steps))
        except Exception as error:  # a failed configuration is a finding, not the end of the run
            rows.append({"config": config[0], "error": f"{type(error).__name__}: {error}".splitlines()[0][:300]})
        print(rows[-1], flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "this machine's CPU (dry run)"
    command = "python benchmarks/snapshot_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"snapshot-{args.device}-{datetime.date.today().isoformat()}.md"
    out.write_text(markdown(rows, device_name=device_name, command=command.strip()))
    print(f"written {out}")
    return out


if __name__ == "__main__":
    main()
