"""Tessera beside other step-time predictors on the same published rows (``benchmarks/reference/``).

Run: ``.venv/bin/python benchmarks/peers.py --llm-analysis DIR --calculon DIR`` (about 10 s; either peer
alone works too). The peers are run from temporary locations, never vendored:

- ``--llm-analysis``: the unpacked wheel of ``llm-analysis`` 0.2.2 from the package index (``pip download
  llm-analysis==0.2.2 --no-deps -d DIR && cd DIR && unzip *.whl``). Its ``fire`` dependency serves only its
  command line; where it is not installed an empty module stands in for it.
- ``--calculon``: a checkout of Calculon (github.com/calculon-ai/calculon, commit caa4b11 of 2024-02-22; Isaev et
  al., SC'23), e.g. ``git clone https://github.com/calculon-ai/calculon DIR``. Pure Python, no dependencies.

Every row is first planned as ``published.py`` plans it (the source's pins, the planner filling the rest); each
peer then predicts the same strategy: the same tp, pp, dp, micro-batch, ZeRO stage and recomputation. A peer
skips a row it cannot express (context parallelism, per-block recomputation, an interleaved or zero-bubble
schedule it has no term for is still run as plain 1F1B and said so). ``llm-analysis`` is run as the issue that
asked for this comparison describes it: 50% of peak FLOP/s (``flops_efficiency=0.5``, its docs' Megatron-LM
figure), FP8 rows as its 8-bit weights and activations (``w8a8e16``, at its ``peak_i8_TFLOPS``). Calculon is run
with its own system files (``systems/a100_80g.json``, which its step-time validation against Korthikanti et al.
uses, and ``systems/h100_80g_nvl8.json``) with the memory capacity lifted, as its own validation file
``a100_80e.json`` does: the published run did fit, and only its time is compared. Its block is GPT's (multi-head
or multi-query attention, a two-matrix MLP) without ZeRO-2/3 or context parallelism: it skips gated-MLP, grouped-
query, FSDP and zero-bubble rows. It models the transformer blocks only (no embedding or LM head), and has no
40 GB A100 file (such a row would use the 80 GB one's 2.0 TB/s; none is expressible today).

Writes ``benchmarks/results/peers-<hardware>-<date>.md``: per predictor and split (train / held out), the
median and worst |error| on the rows that predictor can express, and Tessera's on the same rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import platform
import statistics
import sys
import types
from pathlib import Path

from published import HERE, TRAIN_IDS, plan_run
from published_rows import cluster_spec, framework_profile, measured_runs, published_step_s, regime
from tessera.cost_models import Strategy
from tessera.cost_models.compute import GPU_CALIBRATION
from tessera.cost_models.profiles import MEGATRON_2021
from tessera.topology import load_cluster
from tessera.topology.hardware import device

LLM_ANALYSIS_GPUS = {"A100-40GB": "a100-sxm-40gb", "A100-80GB": "a100-sxm-80gb", "H100": "h100-sxm-80gb"}
CALCULON_SYSTEMS = {"A100-40GB": "a100_80g.json", "A100-80GB": "a100_80g.json", "H100": "h100_80g_nvl8.json"}
PEER_PARTS = {"A100-40GB": "A100-SXM-40GB", "A100-80GB": "A100-SXM-80GB", "H100": "H100-SXM-80GB"}
"""The catalog entry of each part the peers know."""
GPUS_PER_NODE = 8  # Calculon's first network tier (NVLink) in both system files


def peer_gpu(run: dict) -> str | None:
    """The row's GPU as the peers know it: every H100 row (the 96 GB 500 W part and those whose variant is not
    stated, as ``published_rows.cluster_spec`` places them) is their H100 SXM (at the row's peak:
    :func:`peer_peak_share`)."""
    gpu = run["hardware"]["gpu"]
    if gpu.startswith("H100"):
        return "H100"
    if gpu.startswith("A100"):
        return "A100-40GB" if "40GB" in gpu else "A100-80GB"
    return None


def peer_peak_share(run: dict) -> float:
    """The row's device peak over the part the peers price it as: below 1 for torchtitan's 500 W H100, which the
    catalog puts between the H100 SXM and NVL as its page does, so the peers get the same peak as Tessera."""
    peer = peer_gpu(run)
    if peer is None:
        return 1.0
    return priced_device(run).peak_flops("bf16") / device(PEER_PARTS[peer]).peak_flops("bf16")


def priced_device(run: dict):
    """The part Tessera prices the row on (``published_rows.cluster_spec``)."""
    return load_cluster(cluster_spec(run)).device


def llm_analysis_step_s(la, run: dict, strategy: Strategy) -> float | None:
    """llm-analysis's step time for ``strategy`` on ``run``, or None where it cannot express the row."""
    if strategy.cp > 1 or strategy.block_recompute or peer_gpu(run) is None:
        return None
    m = run["model"]
    ffn = m.get("ffn_hidden") or 4 * m["hidden"]
    model = la.config.ModelConfig(
        name=run["id"], num_layers=m["layers"], n_head=m["heads"], hidden_dim=m["hidden"], vocab_size=m["vocab"],
        max_seq_len=m["seq_len"], num_key_value_heads=m.get("kv_heads") or m["heads"], ffn_embed_dim=ffn,
        expansion_ratio=ffn / m["hidden"], model_type="llama" if m.get("family") == "llama" else "gpt",
    )
    fp8 = run["training"].get("precision") == "fp8"
    gpu = la.config.get_gpu_config_by_name(LLM_ANALYSIS_GPUS[peer_gpu(run)])
    share = peer_peak_share(run)
    if share != 1:  # the part is not the peer's own: its peak and memory bandwidth as Tessera prices them
        gpu = dataclasses.replace(
            gpu, peak_fp16_TFLOPS=gpu.peak_fp16_TFLOPS * share, peak_i8_TFLOPS=gpu.peak_i8_TFLOPS * share,
            peak_i4_TFLOPS=gpu.peak_i4_TFLOPS * share,
            hbm_bandwidth_in_GB_per_sec=priced_device(run).memory_bandwidth_bytes_per_s / 1e9)
    analysis = la.analysis.LLMAnalysis(
        model, gpu,
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


def calculon_step_s(calculon, folder: Path, run: dict, strategy: Strategy) -> float | None:
    """Calculon's step time for ``strategy`` on ``run`` (``folder``: its checkout, for the system files), or None
    where it cannot express the row."""
    if not calculon_expresses(run, strategy):
        return None
    assert peer_peak_share(run) == 1, "Calculon's system files are the peers' own parts"
    llm, m = calculon.llm.Llm, run["model"]
    system = json.loads((folder / "systems" / CALCULON_SYSTEMS[peer_gpu(run)]).read_text())
    system["mem1"]["GiB"] = system["mem2"]["GiB"] = 1e12  # only the time is compared: the published run fitted
    app = llm.Application({"hidden": m["hidden"], "feedforward": m.get("ffn_hidden") or 4 * m["hidden"],
                           "seq_size": m["seq_len"], "attn_heads": m["heads"], "attn_size": m["hidden"] // m["heads"],
                           "num_blocks": m["layers"]})
    model = llm(app, logging.getLogger("calculon"))
    try:  # Calculon refuses what it cannot model with its Error or an assert (e.g. a layout its network tiers lack)
        model.compile(calculon.System(system), llm.Execution.from_json(calculon_execution(run, strategy)))
        model.run(calculon.System(system))
    except (llm.Error, AssertionError) as error:
        print(f"calculon cannot run {run['id']}: {error!r}")
        return None
    return float(model.get_total_time())


def calculon_expresses(run: dict, strategy: Strategy) -> bool:
    """Calculon's block is GPT's (multi-head or multi-query attention, a two-matrix MLP), its data parallelism
    DDP or ZeRO-1, its schedules 1F1B and interleaved; no context or expert parallelism, no per-block policies."""
    m = run["model"]
    kv_heads = m.get("kv_heads") or m["heads"]
    return (strategy.cp == 1 and not strategy.block_recompute and strategy.zero <= 1 and strategy.ep == 1
            and strategy.schedule != "zero-bubble" and m.get("family") != "llama" and kv_heads in (1, m["heads"])
            and peer_gpu(run) is not None)


def calculon_execution(run: dict, strategy: Strategy) -> dict:
    """Calculon's execution configuration (``Llm.Execution.fields()``) for ``strategy`` on ``run``."""
    m = run["model"]
    tp, pp, dp = strategy.tp, strategy.pp, strategy.dp
    recompute = {"none": "none", "selective": "attn_only", "full": "full"}[strategy.recompute]
    modern = framework_profile(run).name != MEGATRON_2021.name  # Megatron-LM since 2022: fused bias-GeLU, DP overlap
    return {
        "num_procs": tp * pp * dp, "tensor_par": tp, "pipeline_par": pp, "data_par": dp,
        # Megatron's rank order puts tp innermost, then dp, then pp: each on NVLink while it fits in a node
        "tensor_par_net": 0, "data_par_net": 0 if tp * dp <= GPUS_PER_NODE else 1,
        "pipeline_par_net": 0 if tp * dp * pp <= GPUS_PER_NODE else 1,
        "batch_size": run["training"]["global_batch"], "microbatch_size": strategy.micro_batch,
        "datatype": "float8" if run["training"].get("precision") == "fp8" else "float16",
        "fused_activation": modern,
        "attention_type": "multiquery" if (m.get("kv_heads") or m["heads"]) == 1 < m["heads"] else "multihead",
        "activation_recompute": recompute,
        "pipeline_interleaving": strategy.virtual_stages if pp > 1 and strategy.schedule == "interleaved" else 1,
        "optimizer_sharding": strategy.zero == 1 and dp > 1,
        "tensor_par_comm_type": "rs_ag" if strategy.sp else "ar",
        "tensor_par_overlap": "ring" if strategy.tp_overlap and tp > 1 else "none",
        # Megatron's sequence parallelism gathers the input again in the backward (Calculon forbids it under full)
        "seq_par_ag_redo": strategy.sp and strategy.sp_regather and recompute != "full",
        "data_par_overlap": dp > 1 and modern,
        "weight_offload": False, "activations_offload": False, "optimizer_offload": False, "training": True,
    }


def _stub_if_absent(name: str) -> None:
    """An empty module for ``name`` where it is not installed: a peer imports it for a command line not run here."""
    try:
        __import__(name)
    except ImportError:
        sys.modules[name] = types.ModuleType(name)


def load_calculon(folder: Path):
    """Calculon's package from ``folder`` (a checkout of its repository)."""
    sys.path.insert(0, str(folder))
    _stub_if_absent("psutil")  # only its execution searches use it
    import calculon

    return calculon


def load_llm_analysis(folder: Path):
    """The peer's modules from ``folder`` (an unpacked wheel), ``fire`` stubbed where absent (CLI only)."""
    sys.path.insert(0, str(folder))
    _stub_if_absent("fire")
    import llm_analysis.analysis
    import llm_analysis.config

    return llm_analysis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm-analysis", type=Path, help="folder holding the unpacked llm-analysis wheel")
    parser.add_argument("--calculon", type=Path, help="folder holding a checkout of Calculon")
    args = parser.parse_args()
    peers = {}
    if args.llm_analysis:
        la = load_llm_analysis(args.llm_analysis)
        peers["llm-analysis"] = lambda run, strategy: llm_analysis_step_s(la, run, strategy)
    if args.calculon:
        calculon = load_calculon(args.calculon)
        peers["Calculon"] = lambda run, strategy: calculon_step_s(calculon, args.calculon, run, strategy)
    if not peers:
        parser.error("name at least one peer: --llm-analysis DIR and/or --calculon DIR (see the docstring)")
    results = []  # (id, split, regime, tessera error, {peer: error or None})
    for run in measured_runs():
        if run["model"].get("experts"):  # neither peer has routed experts: those rows are Tessera's alone
            continue
        strategy, est = plan_run(run, GPU_CALIBRATION)
        published = published_step_s(run)
        theirs = {name: predict(run, strategy) for name, predict in peers.items()}
        results.append((run["id"], "train" if run["id"] in TRAIN_IDS else "test", regime(run), est.step_time_s / published - 1,
                        {name: None if t is None else t / published - 1 for name, t in theirs.items()}))
        print(run["id"], f"tessera {results[-1][3]:+.1%}", *(f"{k} {v}" for k, v in results[-1][4].items()), flush=True)
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
             "Command: `.venv/bin/python benchmarks/peers.py --llm-analysis DIR --calculon DIR` (see the script's docstring for DIR).", "",
             *summary_lines(results), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rid, split, reg, ours, theirs in results:
        cells = ["—" if theirs[p] is None else f"{theirs[p]:+.1%}" for p in peers]
        lines.append("| " + " | ".join([rid, split, reg, f"{ours:+.1%}", *cells]) + " |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(summary_lines(results)))
    print(f"written {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
