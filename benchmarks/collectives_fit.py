"""Does the fitted collective model predict message sizes it was not fitted on?

Command (from the repository root):

    python benchmarks/collectives_fit.py --nproc 4

It runs the same profile as ``tessera profile --nproc N`` (gloo on CPU here, NCCL where there are GPUs):
every collective on every group layout over 4 KiB..16 MiB in powers of two. It then refits the model on
the even powers of two only (4 KiB, 16 KiB, ..., 16 MiB) and predicts the odd ones (8 KiB, ..., 8 MiB) with
``tessera.topology.collectives`` on the refitted Cluster, printing predicted against measured per
collective, layout and size. Results go to ``benchmarks/results/collectives-<hardware>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tessera.topology.collectives import collective_time
from tessera.topology.fitting import Measurement, fit_cluster, relative_error
from tessera.topology.profiler import ProfileResult, ProfileSweep, faster_half_mean, load_profile, profile_local

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.25


def predict(cluster, m: Measurement) -> float:
    """Model seconds for a measured point (p2p: one pair ``stride`` apart)."""
    group = 2 if m.collective == "p2p" else m.group_size
    return collective_time(m.collective, cluster, m.nbytes, group_size=group, stride=m.stride)


def held_out_rows(result: ProfileResult) -> tuple[list[tuple[Measurement, float]], object]:
    """Refit on the even-indexed sizes; return (held-out point, prediction) pairs and the refit cluster."""
    sizes = sorted(result.sweep.sizes_bytes)
    fit_sizes, held = set(sizes[0::2]), set(sizes[1::2])
    cluster, _ = fit_cluster(
        result.cluster, [m for m in result.measurements if m.nbytes in fit_sizes],
        device=result.cluster.device, name="refit-on-even-sizes", source="collectives_fit.py refit",
    )
    return [(m, predict(cluster, m)) for m in result.measurements if m.nbytes in held], cluster


def repeatability(m: Measurement) -> float:
    """The noise floor of a point: relative gap between its odd and even trials' statistic."""
    if len(m.trials_s) < 4:
        return float("nan")
    odd, even = faster_half_mean(m.trials_s[0::2]), faster_half_mean(m.trials_s[1::2])
    return abs(odd - even) / min(odd, even)


def summary_lines(rows: list[tuple[Measurement, float]]) -> list[str]:
    """Per-collective and per-size error summaries, the noise floor, and the overall share within tolerance."""
    lines = []
    for collective in sorted({m.collective for m, _ in rows}):
        errors = [abs(relative_error(p, m.seconds)) for m, p in rows if m.collective == collective]
        lines.append(
            f"{collective}: median |error| {statistics.median(errors):.0%}, max {max(errors):.0%}, "
            f"{sum(e <= TOLERANCE for e in errors)}/{len(errors)} within {TOLERANCE:.0%}"
        )
    for nbytes in sorted({m.nbytes for m, _ in rows}):
        errors = [abs(relative_error(p, m.seconds)) for m, p in rows if m.nbytes == nbytes]
        noise = [repeatability(m) for m, _ in rows if m.nbytes == nbytes]
        lines.append(
            f"{nbytes:>10,} bytes: median |error| {statistics.median(errors):.0%}, "
            f"{sum(e <= TOLERANCE for e in errors)}/{len(errors)} within {TOLERANCE:.0%}; noise floor (odd vs even "
            f"trials) median {statistics.median(noise):.0%}"
        )
    errors = [abs(relative_error(p, m.seconds)) for m, p in rows]
    lines.append(
        f"all: median |error| {statistics.median(errors):.0%}, {sum(e <= TOLERANCE for e in errors)}/{len(errors)} "
        f"held-out points within {TOLERANCE:.0%}"
    )
    return lines


def table(rows: list[tuple[Measurement, float]]) -> Table:
    """The predicted-against-measured table."""
    out = Table(title="held-out message sizes: predicted vs measured")
    for column in ("collective", "group x stride", "bytes", "measured ms", "predicted ms", "error"):
        out.add_column(column, justify="right" if column not in ("collective",) else "left")
    for m, p in rows:
        error = relative_error(p, m.seconds)
        mark = "" if abs(error) <= TOLERANCE else " *"
        out.add_row(m.collective, f"{m.group_size} x {m.stride}", f"{m.nbytes:,}", f"{m.seconds * 1e3:.3f}",
                    f"{p * 1e3:.3f}", f"{error:+.0%}{mark}")
    return out


def markdown(result: ProfileResult, rows, *, wall_s: float | None, command: str) -> str:
    """The results file."""
    host = result.host
    lines = [
        f"# Collective model: held-out message sizes ({host['hardware']}, {host['date'][:10]})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {host['cpu']} ({host['cpu_count']} cores), {host['platform']}, torch {host['torch']}, "
        f"backend {host['backend']}, {host['world_size']} ranks.",
        f"Profile (the same run `tessera profile --nproc {host['world_size']}` does): "
        f"{'(read from a file)' if wall_s is None else f'{wall_s:.1f} s wall clock including process start-up'}, "
        f"{result.elapsed_s:.1f} s inside the ranks; {len(result.measurements)} points, {result.sweep.trials} trials "
        f"each of at least {result.sweep.min_trial_s * 1e3:.0f} ms (up to {result.sweep.max_ops_per_trial} ops; "
        f"{result.sweep.long_op_trials} trials of one op where one op takes longer).",
        "Fitted on 4 KiB, 16 KiB, ..., 16 MiB (even powers of two); predicted 8 KiB, 32 KiB, ..., 8 MiB.",
        f"Load average (1 min) before / after: {host.get('load_average_1m_before')} / "
        f"{host.get('load_average_1m_after')} on {host['cpu_count']} cores (other jobs shared the machine).",
        f"Device: fp32 matmul {result.device.matmul_flops_by_dtype['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
        f"{result.device.matmul_flops_by_dtype['bf16'] / 1e9:.1f} GFLOP/s, copy "
        f"{result.device.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank (all ranks at once).",
        "",
        "## Summary",
        "",
        *[f"- {line}" for line in summary_lines(rows)],
        "",
        "## Points (`*`: outside 25%)",
        "",
        "| collective | group x stride | bytes | measured ms | predicted ms | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m, p in rows:
        error = relative_error(p, m.seconds)
        mark = "" if abs(error) <= TOLERANCE else " *"
        lines.append(f"| {m.collective} | {m.group_size} x {m.stride} | {m.nbytes:,} | {m.seconds * 1e3:.3f} | "
                     f"{p * 1e3:.3f} | {error:+.0%}{mark} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="local ranks to profile (default 4)")
    parser.add_argument("--trials", type=int, default=ProfileSweep().trials, help="trials per point")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results")
    parser.add_argument("--keep", metavar="PATH", help="also keep the profile's cluster file here")
    parser.add_argument("--from", dest="source", metavar="PATH", help="analyse a cluster file 'tessera profile' wrote "
                        "earlier instead of profiling now")
    args = parser.parse_args(argv)
    console = Console()
    if args.source:
        result, wall_s = load_profile(args.source), None
    else:
        with tempfile.TemporaryDirectory() as workdir:
            started = time.perf_counter()
            out = Path(args.keep) if args.keep else Path(workdir) / "cluster.yaml"
            result = profile_local(args.nproc, sweep=ProfileSweep(trials=args.trials), out=out)
            wall_s = time.perf_counter() - started
    rows, _ = held_out_rows(result)
    console.print(table(rows))
    for line in summary_lines(rows):
        console.print(line)
    wall = "not timed here" if wall_s is None else f"{wall_s:.1f} s wall clock"
    console.print(f"profile: {wall} ({result.elapsed_s:.1f} s inside the ranks)")
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"collectives-{result.host['hardware']}-{datetime.date.today().isoformat()}.md"
        command = "python benchmarks/collectives_fit.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path.write_text(markdown(result, rows, wall_s=wall_s, command=command.strip()))
        console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
