"""How often a finished torchrun job on gloo aborts while its processes exit, with and without collecting garbage
before the interpreter shuts down (``runtime.mesh._collect_at_exit``).

Run: ``.venv/bin/python benchmarks/exit_aborts.py [--runs 30]``

Three scripts, each launched ``--runs`` times by ``torchrun --standalone --nproc-per-node 2``:

- ``mesh``: plain torch, no Tessera: the 5-axis ``init_device_mesh`` Tessera builds, one all-reduce on a sliced
  axis, ``destroy_process_group``;
- ``mesh+gc``: the same with ``gc.collect`` registered at exit, which ``runtime.mesh`` does;
- ``tessera``: the README's API snippet (``auto_parallelize`` of ``gpt-tiny:layers=2`` on ``cpu:ranks=2``, three
  ``train_step``), through Tessera as it is.

A run aborts when torchrun exits non-zero after every rank printed that its work was done ("terminate called without
an active exception": a job reported as failed). Writes ``benchmarks/results/exit-aborts-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

MESH = """
import atexit, gc, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
if sys.argv[1] == "gc":
    atexit.register(gc.collect)
mesh = init_device_mesh("cpu", (2, 1, 1, 1, 1), mesh_dim_names=("edp", "pp", "ep", "cp", "tp"))
dist.all_reduce(torch.ones(4), group=mesh["edp"].get_group())
print("done", flush=True)
dist.destroy_process_group()
"""

TESSERA = """
import torch, torch.distributed as dist
import tessera
from tessera.models import build_model
dist.init_process_group("gloo")
torch.manual_seed(0)
pm = tessera.auto_parallelize(build_model("gpt-tiny:layers=2"), "cpu:ranks=2", global_batch=8, seq_len=64)
generator = torch.Generator().manual_seed(1)
for _ in range(3):
    tokens = torch.randint(256, (8, 65), generator=generator)
    pm.train_step((tokens[:, :-1], tokens[:, 1:]))
print("done", flush=True)
dist.destroy_process_group()
"""

CASES = {"mesh": (MESH, ["plain"]), "mesh+gc": (MESH, ["gc"]), "tessera": (TESSERA, [])}


def launches(script: Path, args: list[str], runs: int) -> tuple[int, int]:
    """(runs whose work finished on both ranks, of them the ones torchrun reported failed)."""
    finished = aborted = 0
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(script), *args], capture_output=True, text=True, timeout=300)
        if done.stdout.count("done") == 2:
            finished += 1
            aborted += done.returncode != 0
    return finished, aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="launches of each script (default 30)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, (text, script_args) in CASES.items():
            script = Path(folder) / f"exit_case_{name.replace('+', '_')}.py"  # not tessera.py: it would shadow the package
            script.write_text(text)
            finished, aborted = launches(script, script_args, args.runs)
            rows.append(f"| {name} | {args.runs} | {finished} | {aborted} |")
            print(rows[-1], flush=True)
    out = HERE / "results" / f"exit-aborts-{platform.machine()}-cpu-{datetime.date.today().isoformat()}.md"
    out.write_text("\n".join([
        f"# Aborts at exit of finished torchrun jobs ({datetime.date.today().isoformat()})", "",
        f"Command: `.venv/bin/python benchmarks/exit_aborts.py --runs {args.runs}`. Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, 2 gloo ranks per launch; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.1f}' for x in load_before)}, after {', '.join(f'{x:.1f}' for x in os.getloadavg())}.", "",
        "| script | launches | work finished | reported failed at exit |", "|---|---|---|---|", *rows, "",
    ]))
    print(f"written {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
