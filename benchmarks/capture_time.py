"""Capture time and peak memory for very large models on this machine (goal: under 5 s and under 1 GB).

Each model is captured in a fresh Python process, so its imports, peak RSS and first-call costs are its own:
``import`` (torch + tessera), ``build`` (the model on the meta device), ``capture`` (trace, measure at three
sequence lengths, fit) cold, and the same capture again warm. Wall times on a shared machine vary with what else
runs; the CPU time of the capture (``cpu s``) is steadier, and the load average is printed beside it.

    /work/venv/bin/python benchmarks/capture_time.py

writes ``benchmarks/results/capture-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = (
    ("gpt3-175b", 2048),
    ("gpt:layers=128,hidden=25600,heads=160,vocab=51200,seq=2048", 2048),  # 1T parameters
)
GOAL_S, GOAL_RSS_BYTES = 5.0, 2**30


def measure_one(spec: str, seq_len: int) -> dict[str, object]:
    """Time one capture in this process (call it in a fresh one)."""
    start = time.perf_counter()
    import torch  # noqa: F401 - the import is part of what is timed

    from tessera.models import build_model
    from tessera.planner.capture import capture

    imported, build_cpu = time.perf_counter(), time.process_time()
    model = build_model(spec, device="meta")
    built, build_cpu = time.perf_counter(), time.process_time() - build_cpu
    cpu = time.process_time()
    graph = capture(model, seq_len=seq_len, name=spec)
    captured = time.perf_counter()
    cpu = time.process_time() - cpu
    capture(model, seq_len=seq_len, name=spec)
    warm = time.perf_counter() - captured
    return {
        "spec": spec,
        "seq_len": seq_len,
        "params": graph.param_count,
        "layers": len(graph.layers),
        "unique": len(graph.unique_signatures()),
        "front_end": graph.front_end,
        "import_s": imported - start,
        "build_s": built - imported,
        "build_cpu_s": build_cpu,
        "capture_s": captured - built,
        "capture_cpu_s": cpu,
        "warm_s": warm,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def run_fresh(spec: str, seq_len: int) -> dict[str, object]:
    """``measure_one`` in a new interpreter."""
    command = [sys.executable, __file__, "--one", spec, "--seq-len", str(seq_len)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, object]]) -> list[str]:
    """Markdown table of the measurements, with the goal verdict."""
    lines = [
        "| model | seq | params | layers (unique) | import s | build s (cpu) | capture s | capture cpu s | warm s "
        "| peak RSS | goal (cpu, RSS) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        meets = r["capture_cpu_s"] < GOAL_S and r["peak_rss_bytes"] < GOAL_RSS_BYTES
        lines.append(
            f"| `{r['spec']}` | {r['seq_len']} | {r['params'] / 1e9:.1f}B | {r['layers']} ({r['unique']}) "
            f"| {r['import_s']:.2f} | {r['build_s']:.2f} ({r['build_cpu_s']:.2f}) | {r['capture_s']:.2f} "
            f"| {r['capture_cpu_s']:.2f} "
            f"| {r['warm_s']:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} MiB | {'yes' if meets else 'NO'} |"
        )
    return lines


def write_report(rows: list[dict[str, object]], command: str) -> Path:
    date = datetime.date.today().isoformat()
    out = HERE / "results" / f"capture-{platform.machine()}-cpu-{date}.md"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = [
        f"# Capture time and memory ({date})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load average at the end {load} (other processes share the CPUs).",
        f"Goal: capture under {GOAL_S:.0f} s and peak RSS under {GOAL_RSS_BYTES // 2**20} MiB, judged on the",
        "capture's CPU time: capture is single-threaded, so on an idle machine its wall time is its CPU time, while",
        "on a shared one the wall time grows with the load average above. Every number is from a",
        "fresh process; `build` makes the model on the meta device (its first call also pays torch's lazy imports,",
        "~1.6 s of CPU); `capture s` includes tracing (torch.fx), measuring at three sequence lengths on meta",
        "tensors and fitting; `capture cpu s` is its CPU time; `warm s` the same capture repeated in that process.",
        "",
        *table(rows),
        "",
    ]
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(text))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="measure this spec in this process and print JSON (internal)")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.seq_len)))
        return
    rows = [run_fresh(spec, seq_len) for spec, seq_len in MODELS]
    print("\n".join(table(rows)))
    command = f"{Path(sys.executable).as_posix()} benchmarks/capture_time.py"
    print(f"wrote {write_report(rows, command)}")


if __name__ == "__main__":
    main()
