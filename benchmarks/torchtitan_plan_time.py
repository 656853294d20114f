"""Wall time of ``tessera.plan`` for a full-size torchtitan model built on the meta device.

torchtitan's Qwen3-30B-A3B (its own ``qwen3_configs["30B-A3B"]``, 48 MoE blocks; plain SDPA attention, as its flex
backend needs a BlockMask a trainer builds) on ``dgx-h100:nodes=2``, global batch 64 x 4096 tokens. Capture exports
an outside model's forward with torch.export; each MoE router's autocast region and token-count ``no_grad`` region
had been made a higher-order op, recompiling the graph each time.

    .venv/bin/python benchmarks/torchtitan_plan_time.py [--runs 1]

Measured on this project's 2-core machine (2026-12-07, load about 3.5, one run each, same plan and estimate):
44.8 s before capture traced in eval mode and skipped meta autocast regions (commit 1f248ed), 19.4 s after; 15.3 s
idle with this script at the commit that added it (the step time 1.321 s throughout).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

SEQ_LEN = 4096


def qwen3_30b_a3b() -> torch.nn.Module:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs["30B-A3B"](attn_backend="flex")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    with torch.device("meta"):
        return config.build()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    import tessera

    for _ in range(args.runs):
        model = qwen3_30b_a3b()
        started = time.perf_counter()
        plan = tessera.plan(model, "dgx-h100:nodes=2", global_batch=64, seq_len=SEQ_LEN)
        print(f"plan took {time.perf_counter() - started:.1f} s: {plan.strategy.to_string()}, "
              f"{plan.estimate.step_time_s:.3f} s per step")


if __name__ == "__main__":
    main()
