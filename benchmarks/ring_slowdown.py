"""Checks of the context-parallel ring's fitted attention slowdown (``Calibration.cp_attention_slowdown``), which
applies to the rings whose profile says so (``ImplementationProfile.cp_ring_slowdown``: PyTorch's and Tessera's, not
Transformer Engine's).

Run: ``.venv/bin/python benchmarks/ring_slowdown.py`` (about 15 s on a 2-core machine). Prints two tables:

1. Each stack's context-parallel rows (NeMo's, Transformer Engine's ring; torchtitan's, PyTorch's), planned as
   ``benchmarks/published.py`` plans them, priced with the ring slowed by the factor in use and unslowed: the median
   and worst absolute error of each. Which stack's ring the factor belongs to.
2. Llama 3 405B at 131K tokens on 16,384 H100s with the published TP 8 / CP 16 / PP 16 / DP 8 (not a calibration row:
   Llama Team, 'The Llama 3 Herd of Models', arXiv:2407.21783, Table 4, 380 TFLOP/s per GPU), priced with the ring
   slowed and not: as Megatron runs it with 2 virtual stages (an assumption: the paper does not give them), and as
   ``benchmarks/sparse_and_long.py`` prices it (Tessera's profile without its refusals, 1F1B).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from published import evaluate_as_run, plan_run
from published_rows import framework_profile, measured_runs, published_step_s, regime
from tessera.cost_models import TrainingConfig, estimate
from tessera.cost_models.compute import GPU_CALIBRATION
from tessera.cost_models.profiles import MEGATRON, TESSERA
from tessera.planner.capture import capture_preset
from tessera.planner.search import best_candidate, rank_candidates
from tessera.topology import load_cluster

LLAMA3_405B = dict(model="llama3-405b", cluster="dgx-h100:nodes=2048", global_batch=128, seq_len=131072,
                   pins={"dp": 8, "tp": 8, "pp": 16, "cp": 16, "sp": True})


def stack(run: dict) -> str:
    return "NeMo (Transformer Engine's ring)" if run["framework"].startswith("NeMo") else "torchtitan (PyTorch's ring)"


def error_with_ring(run: dict, strategy, *, slowed: bool) -> float:  # noqa: ANN001 - a Strategy
    """The row's relative error with its ring's attention slowed by the factor in use, or not."""
    profile = replace(framework_profile(run), cp_ring_slowdown=slowed)
    step = evaluate_as_run(run, strategy, GPU_CALIBRATION, profile=profile).step_time_s
    return step / published_step_s(run) - 1


def ring_table() -> list[str]:
    runs = [run for run in measured_runs() if regime(run) == "cp"]
    chosen = {run["id"]: plan_run(run, GPU_CALIBRATION)[0] for run in runs}
    lines = ["| stack | context-parallel rows | ring | median abs error | worst |", "|---|---|---|---|---|"]
    for name in sorted({stack(run) for run in runs}):
        rows = [run for run in runs if stack(run) == name]
        for slowed in (True, False):
            errors = [abs(error_with_ring(run, chosen[run["id"]], slowed=slowed)) for run in rows]
            ring = f"slowed {GPU_CALIBRATION.cp_attention_slowdown:g}x" if slowed else "unslowed"
            lines.append(f"| {name} | {len(rows)} | {ring} | {statistics.median(errors):.1%} | {max(errors):.1%} |")
    return lines


def llama3_table() -> list[str]:
    case = LLAMA3_405B
    graph = capture_preset(case["model"], seq_len=case["seq_len"])
    cluster = load_cluster(case["cluster"])
    training = TrainingConfig(global_batch=case["global_batch"], seq_len=case["seq_len"])
    unrestricted = replace(TESSERA, refused_together=())
    filled, _ = best_candidate(rank_candidates(graph, cluster, training, pins=case["pins"], profile=unrestricted))
    layouts = (("as Megatron runs it, 2 virtual stages", filled.model_copy(update={"schedule": "interleaved", "virtual_stages": 2}),
                MEGATRON),
               ("as sparse_and_long.py prices it", filled, unrestricted))
    lines = ["| priced | strategy | slowdown | model TFLOP/s per GPU | counting the recomputation | MFU |",
             "|---|---|---|---|---|---|"]
    for what, strategy, profile in layouts:
        for slowed in (True, False):
            e = estimate(graph.layers, cluster, training, strategy, profile=replace(profile, cp_ring_slowdown=slowed))
            peak = cluster.device.peak_flops("bf16")
            slowdown = GPU_CALIBRATION.cp_attention_slowdown if slowed else 1.0
            lines.append(f"| {what} | `{strategy.to_string()}` | {slowdown:g} | {e.mfu * peak / 1e12:.0f} | "
                         f"{e.hfu * peak / 1e12:.0f} | {e.mfu:.1%} |")
    return lines


def main() -> None:
    print("\n".join(ring_table()))
    print()
    print("\n".join(llama3_table()))
    print("\nPublished: 380 TFLOP/s per GPU, BF16 MFU 38% (what its FLOP count includes is not stated).")


if __name__ == "__main__":
    main()
