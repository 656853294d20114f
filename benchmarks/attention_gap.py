"""How much slower than its kernel's published rate the attention would have to run for a published run's step.

Run: ``.venv/bin/python benchmarks/attention_gap.py [--rows REGEX]`` (seconds per row; default: the runs with
sequences of 16K tokens and more, and those with context parallelism). For each run it plans the published
configuration as ``benchmarks/published.py`` does (the calibration in use, no fit, but the ring's fitted
``cp_attention_slowdown`` left out, so that ``k`` is against the unsplit kernel's rate: what that constant was fitted
to), then prices its attention cores ``k`` times slower than their kernel's figure
(``cost_models.compute.attention_core_rate``: the published FlashAttention-2 / cuDNN / Triton rate, or the
calibrated fallback) and finds the ``k`` at which the predicted step equals the published one (bisection; the
configuration is planned once, at the published rate, and held while ``k`` varies). A ``k``
near 1 says the attention is priced as it ran and the rest of the step explains any error; the same ``k`` on every
long-sequence run of one setup says the attention is what is mispriced there. The last column is the range of ``k``
that keeps the run within the issue's 15% of its published step: two runs of one framework and ring degree whose
ranges do not meet cannot both be within 15% under any one slowdown per framework and degree. It is a diagnosis,
not a fit: nothing here changes the model. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import re
from dataclasses import replace
from unittest import mock

from published import evaluate_as_run, plan_run
from published_rows import (
    cluster_spec, framework_profile, measured_runs, published_step_s, regime, training_config,
)
from tessera.cost_models import compute
from tessera.cost_models.compute import GPU_CALIBRATION, bf16_or, priced_attention_kernel
from tessera.topology import load_cluster

estimate_module = importlib.import_module("tessera.cost_models.estimate")  # the package exports its function instead

UNSPLIT = replace(GPU_CALIBRATION, cp_attention_slowdown=1.0)
"""The calibration in use, the context-parallel ring priced at its kernel's unsplit rate."""
LONG_SEQUENCES = 16384
BRACKET = (0.25, 4.0)
"""The slowdowns searched; a run whose published step lies outside what they give is reported as outside."""
GOAL = 0.15
"""The worst-row error the issue asks for (#19)."""


def step_with_attention_slowed(run: dict, strategy, slowdown: float) -> float:
    """The predicted step of ``strategy`` with every attention core ``slowdown`` times slower than priced (in the
    compute and in what hides the context-parallel ring behind it)."""
    priced = compute.attention_core_rate
    slowed = lambda *args, **kwargs: priced(*args, **kwargs) / slowdown  # noqa: E731
    with mock.patch.object(compute, "attention_core_rate", slowed), \
            mock.patch.object(estimate_module, "attention_core_rate", slowed):
        return evaluate_as_run(run, strategy, UNSPLIT).step_time_s


def slowdown_for(run: dict, strategy, published: float) -> float | None:
    """The attention slowdown at which the predicted step is ``published`` (None outside ``BRACKET``)."""
    low, high = BRACKET
    if not step_with_attention_slowed(run, strategy, low) <= published <= step_with_attention_slowed(run, strategy, high):
        return None
    for _ in range(30):  # geometric bisection: the step grows with the slowdown
        middle = (low * high) ** 0.5
        low, high = (middle, high) if step_with_attention_slowed(run, strategy, middle) < published else (low, middle)
    return (low * high) ** 0.5


def priced_kernel(run: dict) -> str:
    """The kernel whose published rate prices the run's attention (``compute.priced_attention_kernel``), else
    ``fallback``: the calibrated share of the peak."""
    device = load_cluster(cluster_spec(run)).device.name
    precision = bf16_or(training_config(run).precision)
    kernels = framework_profile(run).kernels_at(run["parallel"].get("cp") or 1)
    return priced_attention_kernel(device, precision, kernels) or "fallback"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", metavar="REGEX", help="only the runs whose id matches (default: the runs of sequences >= 16K "
                        "or with context parallelism)")
    args = parser.parse_args()
    runs = ([run for run in measured_runs() if re.search(args.rows, run["id"])] if args.rows
            else [run for run in measured_runs()
                  if run["model"]["seq_len"] >= LONG_SEQUENCES or (run["parallel"].get("cp") or 1) > 1])
    print(f"| run | regime | seq | cp | kernel | published s | predicted s | error | attention slower by | "
          f"slower by, within {GOAL:.0%} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        strategy, estimate = plan_run(run, UNSPLIT)[:2]
        published = published_step_s(run)
        slowdown = slowdown_for(run, strategy, published)
        within = slowdowns_within(run, strategy, published)
        print(f"| {run['id']} | {regime(run)} | {run['model']['seq_len']} | {strategy.cp} | {priced_kernel(run)} | "
              f"{published:.2f} | "
              f"{estimate.step_time_s:.2f} | {estimate.step_time_s / published - 1:+.1%} | "
              f"{'outside 0.25-4x' if slowdown is None else f'x{slowdown:.2f}'} | "
              f"{'none in 0.25-4x' if within is None else f'x{within[0]:.2f}-x{within[1]:.2f}'} |")


def slowdowns_within(run: dict, strategy, published: float) -> tuple[float, float] | None:
    """The slowdowns in ``BRACKET`` whose predicted step is within ``GOAL`` of ``published`` (an end of the bracket
    where the range reaches it), or None where none is."""
    fastest, slowest = (step_with_attention_slowed(run, strategy, k) for k in BRACKET)
    low_step, high_step = published * (1 - GOAL), published * (1 + GOAL)
    if fastest > high_step or slowest < low_step:
        return None
    low = BRACKET[0] if fastest >= low_step else slowdown_for(run, strategy, low_step)
    high = BRACKET[1] if slowest <= high_step else slowdown_for(run, strategy, high_step)
    return low, high


if __name__ == "__main__":
    main()
