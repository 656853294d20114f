"""How the published-run fit responds to the overlap contention, the one constant taken from a measurement.

Run: ``.venv/bin/python benchmarks/contention_sweep.py`` (about 4 minutes on an idle 2-core machine). For each value
of ``Calibration.overlap_contention`` (the compute beside a hidden data-parallel collective runs that much slower;
0.189 from Lee et al. 2025, arXiv 2507.03114), the rest of the constants are refitted on the train split as
``benchmarks/published.py`` fits them (strategies as planned with the calibration in use, held fixed), and the
calibration objective (mean |log error| over the train split) and the held-out median and worst |error| are
printed: whether the measured value sits where the published runs would put it.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import replace

from published import TRAIN_IDS, evaluate_as_run, fit_calibration, plan_run
from published_rows import measured_runs, published_step_s
from tessera.cost_models.compute import GPU_CALIBRATION

VALUES = [0.0, 0.1, 0.15, 0.189, 0.25, 0.3, 0.4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=float, nargs="+", default=VALUES, help="contention values to try")
    args = parser.parse_args()
    runs = measured_runs()
    chosen = {run["id"]: plan_run(run, GPU_CALIBRATION)[0] for run in runs}
    print("| overlap_contention | refitted constants | calibration objective | held-out median | held-out worst |")
    print("|---|---|---|---|---|")
    for value in args.values:
        fitted, deepspeed = fit_calibration(runs, chosen, start=replace(GPU_CALIBRATION, overlap_contention=value))
        errors = {run["id"]: evaluate_as_run(run, chosen[run["id"]], fitted, deepspeed=deepspeed).step_time_s
                  / published_step_s(run) - 1 for run in runs}
        train = [abs(math.log1p(e)) for key, e in errors.items() if key in TRAIN_IDS]
        test = [abs(e) for key, e in errors.items() if key not in TRAIN_IDS]
        constants = (f"peak {fitted.peak_fraction}, FP8 {fitted.fp8_peak_fraction}, jitter {fitted.jitter}, "
                     f"ring {fitted.cp_attention_slowdown}, DeepSpeed {deepspeed}")
        print(f"| {value:g} | {constants} | {statistics.fmean(train):.4f} | {statistics.median(test):.1%} | "
              f"{max(test):.1%} |", flush=True)


if __name__ == "__main__":
    main()
