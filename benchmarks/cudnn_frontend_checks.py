"""Checks of the head-dim pricing (``topology/head_dims.py``) against NVIDIA/cudnn-frontend's own benchmarks.

``llama-1b``: ``benchmark/Llama-3.2-1B-Training`` at commit 7606332 times Hugging Face Llama 3.2 1B (heads of 64)
training eagerly on one H200 and one B200 under SDPA's cuDNN backend (its README's tables, typed in below). Each time
is priced on Tessera's own profile with cuDNN, at the heads' width and as if 128 wide (what the pricing did before).
Not published rows: the source locks the clocks at base (H200 1,500 MHz, B200 1,665 MHz) and the catalog's peaks are
at boost clocks (``docs/calibration-log.md``, 2026-12-07).

``latent --dsv3 CSV --llama CSV``: the forward + backward rate of cuDNN on DeepSeek-V3's attention shape (keys 192,
values 128) over Llama 3.1's (heads of 128), causal, bf16, from ``benchmark/sdpa_benchmark_training/results``'s
``dsv3/gb200/*.csv`` and ``llama3.1/gb200/*.csv`` at HEAD (``git show REV:path > FILE`` in a checkout; never
vendored), each pass's FLOPs as the CSV counts them (its TFLOP/s times its time).

Run: ``.venv/bin/python benchmarks/cudnn_frontend_checks.py llama-1b`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from dataclasses import replace
from pathlib import Path

LLAMA_1B = ("hf:llama:num_hidden_layers=16,hidden_size=2048,intermediate_size=8192,num_attention_heads=32,"
            "num_key_value_heads=8,head_dim=64,vocab_size=128256,tie_word_embeddings=true,max_position_embeddings=131072")
SHAPES = ((1, 16384), (2, 8192), (3, 4096), (6, 2048), (12, 1024), (24, 768))
CUDNN_SECONDS = {"dgx-h200:nodes=1,gpus_per_node=1": (0.424, 0.357, 0.243, 0.229, 0.222, 0.329),
                 "dgx-b200:nodes=1,gpus_per_node=1": (0.285, 0.231, 0.155, 0.144, 0.139, 0.200)}
"""Seconds per iteration under CUDNN_ATTENTION, by ``SHAPES`` (the README's H200 and B200 tables)."""


def llama_1b() -> None:
    import torch

    from tessera.cost_models import Strategy, TrainingConfig, estimate
    from tessera.cost_models.profiles import TESSERA
    from tessera.planner.capture import capture_preset
    from tessera.topology import load_cluster

    profile = replace(TESSERA, attention_kernels=("cudnn",))
    for (batch, seq_len), *published in zip(SHAPES, *CUDNN_SECONDS.values()):
        layers = capture_preset(LLAMA_1B, seq_len=seq_len, dtype=torch.bfloat16).layers
        at_128 = [layer.model_copy(update={"kv_head_width": 0, "query_head_width": 0}) for layer in layers]
        training, strategy = TrainingConfig(global_batch=batch, seq_len=seq_len), Strategy.parse(f"dp=1,mbs={batch}")
        for cluster, seconds in zip(CUDNN_SECONDS, published):
            priced = {name: estimate(stats, load_cluster(cluster), training, strategy, profile=profile).step_time_s
                      for name, stats in (("heads of 64", layers), ("as 128", at_128))}
            errors = ", ".join(f"{name} {time / seconds - 1:+.1%}" for name, time in priced.items())
            print(f"{cluster.split(':')[0]} batch {batch} x {seq_len}: published {seconds:.3f} s; {errors}")


def combined_rates(path: Path) -> dict[int, float]:
    """Forward + backward TFLOP/s of the file's causal bf16 cuDNN rows (non-deterministic backward), by length."""
    flops: dict[int, list[float]] = {}
    for row in csv.DictReader(path.open()):
        if (row["backend"], row["data_type"], row["attn_mask"], row["deterministic_bwd"]) == (
                "cudnn", "bfloat16", "top_left", "False"):
            pair = flops.setdefault(int(row["q_seqlen"]), [0.0, 0.0])
            pair[0] += float(row["tflops"]) * float(row["time_ms"])
            pair[1] += float(row["time_ms"])
    return {length: work / time for length, (work, time) in sorted(flops.items())}


def latent(dsv3: Path, llama: Path) -> None:
    ours, theirs = combined_rates(dsv3), combined_rates(llama)
    for length in ours:
        print(f"{length}: DeepSeek-V3 {ours[length]:.0f}, Llama 3.1 {theirs[length]:.0f} TFLOP/s")
    print(f"median ratio {statistics.median(ours[n] / theirs[n] for n in ours):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("llama-1b")
    shapes = commands.add_parser("latent")
    shapes.add_argument("--dsv3", type=Path, required=True)
    shapes.add_argument("--llama", type=Path, required=True)
    args = parser.parse_args()
    llama_1b() if args.command == "llama-1b" else latent(args.dsv3, args.llama)


if __name__ == "__main__":
    main()
