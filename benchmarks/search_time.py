"""Planning wall time and peak memory as the model and the cluster grow (capture included).

Run: ``.venv/bin/python benchmarks/search_time.py`` (several minutes; each point runs in a fresh process so
its peak RSS is its own, after one untimed plan that warms the file cache). Prints a table and writes
``benchmarks/results/search-time-<hardware>-<date>.md`` and a plot beside it. The first three rows are the planner issue's targets, the fourth issue 21's (``--only N``
runs the first N rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
LOAD = __import__("os").getloadavg()
ONE_T = "gpt:layers=128,hidden=25600,heads=160,vocab=51200,seq=2048"
# (model, seq_len, cluster, global batch, target seconds or None)
POINTS = [
    ("gpt3-175b", 2048, "dgx-a100:nodes=128", 1536, 5.0),
    (ONE_T, 2048, "dgx-a100:nodes=384", 3072, 15.0),
    ("llama3-405b", 8192, "dgx-h100:nodes=2048", 2048, 15.0),
    # DeepSeek-V3 on 2048 H100s at its published batch (15360 x 4K tokens, arXiv:2412.19437 Sec. 4.2), issue 21's goal.
    ("deepseek-v3", 4096, "dgx-h100:nodes=256", 15360, 10.0),
    *[(model, seq, f"dgx-h100:nodes={nodes}", max(256, 8 * nodes // 4), None)
      for model, seq in (("gpt:layers=24,hidden=2048,heads=16,vocab=51200,seq=2048", 2048), ("llama3-8b", 8192),
                         ("llama3-70b", 8192), (ONE_T, 2048))
      for nodes in (1, 32, 256, 2048)],
]
WARM_UP = ("gpt-tiny", 64, "dgx-a100:nodes=1", 8)
"""Planned once, untimed, before the points: a first process after the files were last read (a cold OS file cache)
imports torch, torch._dynamo and OR-Tools ~1 s slower than the ones after it (2026-12-02: torch's own import
3.3 s in the first process, 2.2-2.5 s in the others), which would be charged to the first point alone."""
# The interpreter and torch's own import (~1.5 s here) come before the clock starts; everything Tessera
# does -- its import, capture (which pulls in torch._dynamo for meta-tensor ops), search, ILPs -- is timed.
CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch
torch_import_s = time.perf_counter() - t0
import tessera
t = time.perf_counter()
plan = tessera.plan(sys.argv[1], sys.argv[2], global_batch=int(sys.argv[3]), seq_len=int(sys.argv[4]))
print(json.dumps({"seconds": time.perf_counter() - t, "torch_import_s": torch_import_s,
                  "search_s": plan.search_time_s, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "params": plan.param_count, "devices": plan.estimate.num_devices, "strategy": plan.strategy.to_string(),
                  "candidates": plan.candidates_evaluated, "ilp": plan.solver.ilp_solved, "gap": plan.solver.worst_gap}))
"""


def measure(model: str, seq_len: int, cluster: str, global_batch: int) -> dict:
    """Plan in a fresh interpreter; the whole call (capture + search) is timed."""
    out = subprocess.run([sys.executable, "-c", CHILD, model, cluster, str(global_batch), str(seq_len)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=len(POINTS), help="run only the first N points")
    rows = []
    measure(*WARM_UP)  # untimed: the first point is not charged for reading torch's files from disk
    for model, seq, cluster, batch, target in POINTS[: parser.parse_args().only]:
        result = measure(model, seq, cluster, batch)
        rows.append((model, seq, cluster, batch, target, result))
        print(model, cluster, result, flush=True)
    table = Table(title="Planning time (capture + search), fresh process per point")
    for column in ("model", "params", "cluster", "devices", "batch", "seconds", "target", "of which search", "torch import (not counted)",
                   "peak RSS MB", "candidates", "ILPs", "plan"):
        table.add_column(column)
    lines = []
    for model, seq, cluster, batch, target, r in rows:
        if "error" in r:
            cells = (model, "-", cluster, "-", str(batch), "error", "-", "-", "-", "-", "-", "-", r["error"])
        else:
            cells = (model, f"{r['params'] / 1e9:.1f}B", cluster, str(r["devices"]), str(batch), f"{r['seconds']:.1f}",
                     f"<= {target:.0f}" if target else "", f"{r['search_s']:.1f}", f"{r['torch_import_s']:.1f}",
                     f"{r['rss_mb']:.0f}", str(r["candidates"]), str(r["ilp"]), r["strategy"])
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=200).print(table)
    write_results(lines, rows)


def write_results(lines: list[str], rows: list) -> None:
    date = datetime.date.today().isoformat()
    stem = HERE / "results" / f"search-time-{platform.machine()}-cpu-{date}"
    header = ("| model | params | cluster | devices | batch | seconds | target | of which search | torch import (not counted) "
              "| peak RSS MB | candidates | ILPs | plan |")
    plot_note = _plot(rows, stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text("\n".join([
        f"# Planning time as model and cluster grow ({date}, {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores)", "",
        "Command: `.venv/bin/python benchmarks/search_time.py`. Each point plans in a fresh process; seconds are "
        "`tessera.plan(...)` from just after `import torch`: Tessera's import, capture on the meta device and the "
        f"search with its integer programs. Load average before / after: {LOAD[0]:.2f} / {__import__('os').getloadavg()[0]:.2f} "
        "on this machine's cores (other jobs inflate every figure).", "", plot_note, "",
        header, "|" + "---|" * 13, *lines, "",
    ]))
    print(f"written {stem.with_suffix('.md').relative_to(HERE.parent)}")


def _plot(rows: list, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)"
    fig, ax = plt.subplots(figsize=(7, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for model, _, _, _, target, r in rows:
        if "error" not in r and target is None:
            series.setdefault(f"{model.split(':')[0]} ({r['params'] / 1e9:.0f}B)", []).append((r["devices"], r["seconds"]))
    if not series:
        plt.close(fig)
        return "(no plot: only the target points ran)"
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("planning wall time (s)")
    ax.set_title("Tessera planning time (capture + search)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"![planning time]({path.name})"


if __name__ == "__main__":
    main()
