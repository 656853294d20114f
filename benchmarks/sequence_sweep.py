"""What llm-foundry's own sequence sweep says of its attention and of everything else, on the A100 and the H100.

Run: ``.venv/bin/python benchmarks/sequence_sweep.py`` (instant). MosaicML llm-foundry's
``scripts/train/benchmarking/README.md`` (commit 061f2c7ce64e) measures MPT-1B on 8 GPUs without activation
checkpointing at 2K-32K tokens, bf16, in its 'A100 80GB' and 'H100 80GB BF16' tables (Throughput (T/s/GPU) below,
as printed). Time per token is then ``a + b * seq_len``: the attention's work per token grows with the sequence, the
rest does not. The slope gives the attention's rate (forward + backward, counted causal as kernel benchmarks count it:
3.5 x 2 x seq x hidden x layers FLOPs per token); the intercept the rate of everything else on the model's 6 x
parameters FLOPs per token. Compared with what Tessera prices: the catalog's Triton FlashAttention figures on the
A100 (``topology/catalog.yaml``) and the calibrated fallback on the H100, which has none.
"""

from __future__ import annotations

import numpy as np

from tessera.cost_models.compute import CAUSAL_WORK, GPU_CALIBRATION
from tessera.topology.hardware import attention_curve, device

LAYERS, HIDDEN, PARAMS = 24, 2048, 1_315_950_592  # MPT-1B (its yaml; NumParams column at 2K)
TOKENS_PER_S_PER_GPU = {
    "A100-SXM-80GB": {2048: 20513, 4096: 17807, 8192: 13814, 16384: 9956, 32768: 6275},
    "H100-SXM-80GB": {2048: 45455, 4096: 38535, 8192: 29157, 16384: 19649, 32768: 12025},
}


def priced_attention(part: str) -> str:
    """The rate Tessera prices llm-foundry's Triton attention at on ``part`` (causal count, TFLOP/s)."""
    curve = attention_curve(part, "fa-triton")
    if curve is not None:
        return "-".join(f"{rate / 1e12:.0f}" for seq, rate in curve if 2048 <= seq <= 32768) + " (catalog, 2K-16K)"
    fallback = GPU_CALIBRATION.attention_efficiency * device(part).peak_flops("bf16") * CAUSAL_WORK
    return f"{fallback / 1e12:.0f} (calibrated fallback)"


def main() -> None:
    print("| part | line fit, worst residual | attention TFLOP/s (causal) | Tessera prices it at | rest TFLOP/s | "
          "rest, share of bf16 peak |")
    print("|---|---|---|---|---|---|")
    for part, sweep in TOKENS_PER_S_PER_GPU.items():
        seq = np.array(sorted(sweep), dtype=float)
        per_token = np.array([1 / sweep[s] for s in sorted(sweep)])
        slope, intercept = np.polyfit(seq, per_token, 1)
        residual = np.max(np.abs((intercept + slope * seq) / per_token - 1))
        attention = 3.5 * 2 * HIDDEN * LAYERS / slope
        rest = 6 * PARAMS / intercept
        print(f"| {part} | {residual:.1%} | {attention / 1e12:.0f} | {priced_attention(part)} | {rest / 1e12:.0f} | "
              f"{rest / device(part).peak_flops('bf16'):.1%} |")


if __name__ == "__main__":
    main()
