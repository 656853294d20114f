"""Checks of the context-parallel ring's fitted attention slowdown (``Calibration.cp_attention_slowdown``).

Run: ``.venv/bin/python benchmarks/ring_slowdown.py`` (about 10 s on a 2-core machine). Prints two tables:

1. The constant fitted on one stack's context-parallel calibration rows alone (NeMo's, torchtitan's), as
   ``benchmarks/published.py`` fits it (``coordinate_fit`` over ``CP_GRID``, strategies held as planned with the
   calibration in use), and the other stack's context-parallel rows predicted with it: does one stack's factor
   carry to the other's implementation?
2. Llama 3 405B at 131K tokens on 16,384 H100s with the published TP 8 / CP 16 / PP 16 / DP 8 (not a calibration row:
   Llama Team, 'The Llama 3 Herd of Models', arXiv:2407.21783, Table 4, 380 TFLOP/s per GPU), priced with the factor
   in use and at 1.0: as Megatron runs it with 2 virtual stages (an assumption: the paper does not give them), and as
   ``benchmarks/sparse_and_long.py`` prices it (Tessera's profile without its refusals, 1F1B).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from published import CP_GRID, TRAIN_IDS, coordinate_fit, log_error, plan_run
from published_rows import measured_runs, regime
from tessera.cost_models import TrainingConfig, estimate
from tessera.cost_models.compute import GPU_CALIBRATION
from tessera.cost_models.profiles import MEGATRON, TESSERA
from tessera.planner.capture import capture_preset
from tessera.planner.search import best_candidate, rank_candidates
from tessera.topology import load_cluster

LLAMA3_405B = dict(model="llama3-405b", cluster="dgx-h100:nodes=2048", global_batch=128, seq_len=131072,
                   pins={"dp": 8, "tp": 8, "pp": 16, "cp": 16, "sp": True})


def stack(run: dict) -> str:
    return "NeMo" if run["framework"].startswith("NeMo") else "torchtitan"


def cross_stack_table() -> list[str]:
    runs = [run for run in measured_runs() if regime(run) == "cp"]
    chosen = {run["id"]: plan_run(run, GPU_CALIBRATION)[0] for run in runs}
    lines = ["| fitted on | its calibration rows | slowdown | other stack's rows | their median abs error |",
             "|---|---|---|---|---|"]
    for name in ("NeMo", "torchtitan"):
        train = [run for run in runs if stack(run) == name and run["id"] in TRAIN_IDS]
        fitted = coordinate_fit(GPU_CALIBRATION, CP_GRID, train, chosen)
        others = [run for run in runs if stack(run) != name]
        median = statistics.median(abs(math.expm1(log_error(run, chosen[run["id"]], fitted))) for run in others)
        lines.append(f"| {name} | {len(train)} | {fitted.cp_attention_slowdown:g} | {len(others)} | {median:.1%} |")
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
        for slowdown in (GPU_CALIBRATION.cp_attention_slowdown, 1.0):
            calibration = replace(GPU_CALIBRATION, cp_attention_slowdown=slowdown)
            e = estimate(graph.layers, cluster, training, strategy, calibration=calibration, profile=profile)
            peak = cluster.device.peak_flops("bf16")
            lines.append(f"| {what} | `{strategy.to_string()}` | {slowdown:g} | {e.mfu * peak / 1e12:.0f} | "
                         f"{e.hfu * peak / 1e12:.0f} | {e.mfu:.1%} |")
    return lines


def main() -> None:
    print("\n".join(cross_stack_table()))
    print()
    print("\n".join(llama3_table()))
    print("\nPublished: 380 TFLOP/s per GPU, BF16 MFU 38% (what its FLOP count includes is not stated).")


if __name__ == "__main__":
    main()
