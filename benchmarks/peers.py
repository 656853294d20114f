"""Tessera beside other step-time predictors on the same published rows (``benchmarks/reference/``).

Run: ``.venv/bin/python benchmarks/peers.py --llm-analysis DIR`` (as long as ``published.py``). The peer is run
from a temporary location, never vendored: ``DIR`` holds the unpacked wheel of ``llm-analysis`` 0.2.2 from the
package index (``pip download llm-analysis==0.2.2 --no-deps -d DIR && cd DIR && unzip *.whl``). Its ``fire``
dependency serves only its command line; where it is not installed an empty module stands in for it.

Every row is first planned as ``published.py`` plans it (the source's pins, the planner filling the rest); each
peer then predicts the same strategy: the same tp, pp, dp, micro-batch, ZeRO stage and recomputation. A peer
skips a row it cannot express (context parallelism, per-block recomputation, an interleaved or zero-bubble
schedule it has no term for is still run as plain 1F1B and said so). ``llm-analysis`` is run as the issue that
asked for this comparison describes it: 50% of peak FLOP/s (``flops_efficiency=0.5``, its docs' Megatron-LM
figure), FP8 rows as its 8-bit weights and activations (``w8a8e16``, at its ``peak_i8_TFLOPS``).

Writes ``benchmarks/results/peers-<hardware>-<date>.md``: per predictor and split (train / held out), the
median and worst |error| on the rows that predictor can express, and Tessera's on the same rows.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import types
from pathlib import Path

from published import HERE, TRAIN_IDS, plan_run
from published_rows import measured_runs, published_step_s, regime
from tessera.cost_models import Strategy
from tessera.cost_models.compute import GPU_CALIBRATION

LLM_ANALYSIS_GPUS = {"A100-SXM4-80GB": "a100-sxm-80gb", "A100-SXM-80GB": "a100-sxm-80gb", "A100-SXM-40GB": "a100-sxm-40gb",
                     "H100-SXM-80GB": "h100-sxm-80gb", "H100-SXM-96GB-500W": "h100-sxm-80gb"}


def llm_analysis_step_s(la, run: dict, strategy: Strategy) -> float | None:
    """llm-analysis's step time for ``strategy`` on ``run``, or None where it cannot express the row."""
    if strategy.cp > 1 or strategy.block_recompute or run["hardware"]["gpu"] not in LLM_ANALYSIS_GPUS:
        return None
    m = run["model"]
    ffn = m.get("ffn_hidden") or 4 * m["hidden"]
    model = la.config.ModelConfig(
        name=run["id"], num_layers=m["layers"], n_head=m["heads"], hidden_dim=m["hidden"], vocab_size=m["vocab"],
        max_seq_len=m["seq_len"], num_key_value_heads=m.get("kv_heads") or m["heads"], ffn_embed_dim=ffn,
        expansion_ratio=ffn / m["hidden"], model_type="llama" if m.get("family") == "llama" else "gpt",
    )
    fp8 = run["training"].get("precision") == "fp8"
    analysis = la.analysis.LLMAnalysis(
        model, la.config.get_gpu_config_by_name(LLM_ANALYSIS_GPUS[run["hardware"]["gpu"]]),
        dtype_config=la.config.get_dtype_config_by_name("w8a8e16" if fp8 else "w16a16e16"),
        parallelism_config=la.config.ParallelismConfig(tp_size=strategy.tp, pp_size=strategy.pp, dp_size=strategy.dp,
                                                       sp_size=strategy.tp if strategy.sp else 1),
        flops_efficiency=0.5,
    )
    recompute = {"none": "NONE", "selective": "SELECTIVE", "full": "FULL"}[strategy.recompute]
    summary = analysis.training(
        batch_size_per_gpu=strategy.micro_batch, global_batch_size=run["training"]["global_batch"], seq_len=m["seq_len"],
        activation_recomputation=la.analysis.ActivationRecomputation[recompute],
        ds_zero=la.analysis.DSZeRO(strategy.zero), mlp_gated_linear_units=m.get("family") == "llama",
    )
    return float(summary["latency_per_iter"])


def load_llm_analysis(folder: Path):
    """The peer's modules from ``folder`` (an unpacked wheel), ``fire`` stubbed where absent (CLI only)."""
    sys.path.insert(0, str(folder))
    try:
        import fire  # noqa: F401
    except ImportError:
        sys.modules["fire"] = types.ModuleType("fire")
    import llm_analysis.analysis
    import llm_analysis.config

    return llm_analysis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm-analysis", type=Path, required=True, help="folder holding the unpacked llm-analysis wheel")
    args = parser.parse_args()
    la = load_llm_analysis(args.llm_analysis)
    results = []  # (id, split, regime, tessera error, {peer: error or None})
    for run in measured_runs():
        strategy, est = plan_run(run, GPU_CALIBRATION)
        published = published_step_s(run)
        peer = llm_analysis_step_s(la, run, strategy)
        results.append((run["id"], "train" if run["id"] in TRAIN_IDS else "test", regime(run), est.step_time_s / published - 1,
                        {"llm-analysis": None if peer is None else peer / published - 1}))
        print(run["id"], f"tessera {results[-1][3]:+.1%}", f"llm-analysis {results[-1][4]['llm-analysis']}", flush=True)
    write_markdown(results)


def summary_lines(results: list) -> list[str]:
    """Per peer and split: its median and worst |error| on the rows it expresses, and Tessera's on those rows."""
    lines = []
    for peer in sorted({name for *_, peers in results for name in peers}):
        for split, label in (("train", "calibration rows"), ("test", "held-out rows")):
            rows = [(t, p[peer]) for _, s, _, t, p in results if s == split and p[peer] is not None]
            if not rows:
                continue
            ours, theirs = [abs(t) for t, _ in rows], [abs(p) for _, p in rows]
            lines.append(f"- {peer}, {label} it can express ({len(rows)}): median |error| {statistics.median(theirs):.1%}, "
                         f"worst {max(theirs):.1%}; Tessera on the same rows: median {statistics.median(ours):.1%}, "
                         f"worst {max(ours):.1%}")
    return lines


def write_markdown(results: list) -> None:
    date = datetime.date.today().isoformat()
    out = HERE / "results" / f"peers-{platform.machine()}-cpu-{date}.md"
    peers = sorted({name for *_, p in results for name in p})
    header = ["run", "split", "regime", "Tessera", *peers]
    lines = [f"# Tessera and other predictors on the published rows ({date})", "",
             "Command: `.venv/bin/python benchmarks/peers.py --llm-analysis DIR` (see the script's docstring for DIR).", "",
             *summary_lines(results), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rid, split, reg, ours, theirs in results:
        cells = ["—" if theirs[p] is None else f"{theirs[p]:+.1%}" for p in peers]
        lines.append("| " + " | ".join([rid, split, reg, f"{ours:+.1%}", *cells]) + " |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(summary_lines(results)))
    print(f"written {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
