"""What a block's linears read and what its gated MLP saves beyond a fused kernel, as capture measures them.

Run: ``.venv/bin/python benchmarks/linear_inputs.py`` (about 6 s, one process, CPU; on meta, nothing allocated).
For each built-in model, per token and hidden unit of one block (bf16 elements): the distinct inputs its linears
read (``LayerStats.linear_input_bytes``: what Transformer Engine's fused modules cast), the same counted at every
linear call (``linear_call_input_bytes``: what torchao's eager ``Float8Linear`` casts), the GPT share of the block's
saved activations that stood in for both before capture measured them (``layer_sums.LINEAR_INPUT_SHARE``), and the
activation's output its gated MLP saves beyond a fused kernel (``fused_gate_saving_bytes``).
"""

from __future__ import annotations

import argparse

import torch

from tessera.cost_models.layer_sums import LINEAR_INPUT_SHARE
from tessera.planner.capture import capture_preset

MODELS = ("llama3-8b", "gpt3-2.7b", "gemma3-27b")
SEQ_LEN = 2048


def widths(nbytes: int | None, hidden: int) -> str:
    """``nbytes`` of bf16 per sequence as hidden widths per token."""
    return "not measured" if nbytes is None else f"{nbytes / 2 / SEQ_LEN / hidden:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    models = parser.parse_args().models
    print("| model | distinct linear inputs | at every linear call | GPT share of saved | gate output saved |")
    print("|---|---|---|---|---|")
    for spec in models:
        block = capture_preset(spec, seq_len=SEQ_LEN, dtype=torch.bfloat16).blocks[-1]
        h = block.hidden_size
        share = round(LINEAR_INPUT_SHARE * block.saved_bytes_no_recompute)
        print(f"| {spec} | {widths(block.linear_input_bytes, h)} | {widths(block.linear_call_input_bytes, h)} | "
              f"{widths(share, h)} | {widths(block.fused_gate_saving_bytes, h)} |")


if __name__ == "__main__":
    main()
