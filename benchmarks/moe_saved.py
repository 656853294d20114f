"""What transformers' experts save for the backward, against what capture's stand-in and a fused path keep.

Run: ``.venv/bin/python benchmarks/moe_saved.py`` (seconds, one process, CPU).

transformers 5 runs a model's packed experts with grouped matmuls (``config._experts_implementation`` ``grouped_mm``,
``torch._grouped_mm``, which runs on CPU too; a block built on its own falls back to the eager loop over experts).
Capture measures them through its own static-shaped stand-in at the expected load (``planner.experts``: batched
matmuls, the combine by ``models.moe.sum_rows``). Megatron-Core, which ran the published Qwen3 rows, runs the layer
through a fused permutation, grouped GEMMs and a fused SwiGLU. This builds one Qwen3-MoE sparse block at
Qwen3-30B-A3B's widths (hidden 2048, 128 experts of width 768, 8 per token), runs a forward of ``--tokens`` tokens in
bf16 each way and sums what autograd saves, per token and hidden unit, weights aside. Beside them, the count of what
the fused path keeps per routed copy of a token: the permuted input (``h``), the gated first linear's output (``2f``),
the activation's output (``f``) and the expert's output (``h``), all bf16, and the router's fp32 probabilities. The
other paths keep the activation's output besides, which capture reports as a gated activation
(``LayerStats.fused_gate_saving_bytes``, taken off where the framework fuses it). A second line: a whole Qwen3-235B
decoder layer as capture measures it, and its hand-written norms' part (``LayerStats.declared_norm_saving_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768  # Qwen/Qwen3-30B-A3B's config.json


def saved_bytes(run, weights: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, the ``weights`` aside (saved-tensor hooks see
    what custom autograd functions save too)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in weights:
            storages[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def fused_bytes_per_token(hidden: int, width: int, top_k: int, experts: int) -> float:
    """What a fused permute and grouped GEMM keep per token (module docstring), in bytes."""
    per_copy = 2 * (hidden + 2 * width + width + hidden)
    return top_k * per_copy + 4 * experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    from transformers import Qwen3MoeConfig  # the hf extra
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from tessera.planner.experts import expected_expert_load

    torch.manual_seed(0)
    x = torch.randn(1, args.tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    measured = {}
    for implementation in ("eager", "grouped_mm", "capture"):
        config = Qwen3MoeConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                moe_intermediate_size=WIDTH, norm_topk_prob=True)
        config._experts_implementation = "eager" if implementation == "capture" else implementation
        block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
        weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
        load = expected_expert_load(block, 1.0) if implementation == "capture" else contextlib.nullcontext()
        with load:
            measured[implementation] = saved_bytes(lambda: block(x), weights) / (args.tokens * HIDDEN)
    fused = fused_bytes_per_token(HIDDEN, WIDTH, TOP_K, EXPERTS) / HIDDEN
    gate = TOP_K * 2 * WIDTH / HIDDEN  # the activation's output, bf16, per routed copy
    print(f"bytes saved per token and hidden unit: transformers' eager experts {measured['eager']:.1f}, its grouped "
          f"matmuls {measured['grouped_mm']:.1f}, capture's stand-in {measured['capture']:.1f} "
          f"({measured['capture'] - gate:.1f} without the activation's output); a fused permute and grouped GEMM "
          f"{fused:.1f}")
    print(block_as_captured())


BLOCK_235B = ("hf:qwen3_moe:num_hidden_layers=2,hidden_size=4096,num_attention_heads=64,num_key_value_heads=4,"
              "head_dim=128,num_local_experts=128,num_experts_per_tok=8,moe_intermediate_size=1536,norm_topk_prob=true,"
              "vocab_size=151936,tie_word_embeddings=false")
"""Two of Qwen3-235B-A22B's decoder layers (its published config.json), as the published rows build it."""


def block_as_captured(seq_len: int = 256) -> str:
    """What capture measures a whole Qwen3-235B decoder layer saving, and the part of it that its four hand-written
    norms keep beyond a fused norm's (``LayerStats.declared_norm_saving_bytes``), per token and hidden unit."""
    from tessera.planner.capture import capture_preset

    block = capture_preset(BLOCK_235B, seq_len=seq_len, dtype=torch.bfloat16).blocks[-1]
    per = seq_len * block.hidden_size
    return (f"a Qwen3-235B decoder layer as capture measures it: {block.saved_bytes_no_recompute / per:.1f} bytes per "
            f"token and hidden unit, {block.declared_norm_saving_bytes / per:.1f} of them its norms' beyond a fused "
            "norm's")


if __name__ == "__main__":
    main()
