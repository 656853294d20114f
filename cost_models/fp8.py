"""FP8 training: which FLOPs run on the FP8 matrix units, what the scaling costs, what it keeps in memory.

Every FP8 recipe in use (Transformer Engine, torchao float8, MXFP8; NVIDIA's FP8 primer, torchtitan's
``docs/float8.md``) casts the inputs of the blocks' linears to FP8 and runs those matmuls at the FP8 peak; the
attention cores (softmax(QK^T)V), norms, the embedding and the LM head stay in bf16. So a block's forward splits
into FP8 matmul FLOPs (its measured FLOPs less its attention core, ``LayerStats.selective_recompute_flops``)
and bf16 FLOPs (the attention core and the head), backward likewise (the attention core's backward is twice its
forward, as FlopCounterMode counts it). The FP8 matmuls follow their own efficiency curve
(``compute.Calibration.fp8_at``): FP8 GEMMs need larger tiles than bf16 ones to reach their peak.

Scaling costs memory traffic: a cast reads the bf16 input and writes FP8, once forward and once backward for the
output gradient, priced at 1.5 bytes per 2-byte element (``CAST_BYTES_PER_ELEMENT_BYTE``: half of what a cast kernel
of its own moves, below). ``CAST_PASSES`` counts the passes per recipe: ``delayed``
scaling knows its scale from the amax history (one pass: the cast, amax fused into it); ``current`` and
``rowwise`` scaling need the amax of the tensor before the cast (two passes). These two are engineering
assumptions from how the kernels are written, not fitted. ``block`` and ``mx`` are measured against them: Transformer
Engine's GEMM profiling guide times one model's 12 GEMMs per layer with each recipe quantizing its inputs as in
training (``CAST_PASSES``).

What the forward's casts read is what the blocks' linears read, as capture measures it
(``LayerStats.linear_input_bytes``: each distinct activation a linear multiplies, so q, k and v reading one tensor
count once, as Transformer Engine's fused QKV and gate/up modules cast it, and as a compiled graph may; torchao's
eager ``Float8Linear``, which Tessera's runtime runs, casts it once per linear: ``LayerStats.linear_call_input_bytes``,
``profiles.fp8_casts_per_linear``): a Llama 3 block's linears read 3h + 3.5h elements per token (9.5h counted per
linear), a GPT block's 7h (9h). Where capture did not see every linear, a GPT share of the block's saved activations stands in (``layer_sums.LINEAR_INPUT_SHARE``).
The head's linear stays in bf16. The backward's casts (of the output gradients, which are as wide as the linears'
outputs: 10.5h for a Llama 3 block) are priced on the same bytes, twice, as the backward's other elementwise work.
"""

from __future__ import annotations

from tessera.cost_models.partition import StageTotals
from tessera.cost_models.types import TrainingConfig

CAST_BYTES_PER_ELEMENT_BYTE = 1.5 / 2
"""Bytes a cast pass is priced at per byte of its bf16 input. A cast kernel of its own reads 2 bytes an element and
writes 1, and on Hopper, whose FP8 matmuls take one layout only (cuBLASLt's "TN" format), a second transposed byte:
1.5 to 2 bytes per byte of input, two to three times this. Pricing that, with the backward's casts on the output
gradients' measured size, fitted the training rows worse (calibration objective 0.0534 -> 0.0547, the FP8 peak
share refitted 0.7 -> 0.725; the backward's sizes alone 0.0537; 2026-12-06, not kept; the change is
``benchmarks/results/fp8-cast-bytes-tried-2026-12-06.diff``): the recipes of the published
FP8 rows fuse much of their casting into the kernels beside it (Transformer Engine's ``LayerNormLinear`` casts in its
norm, a compiled graph fuses amax and cast into its neighbours), which one byte count per recipe does not tell."""
TE_GEMM_TOTALS_MS = {"H200 NVL": {"current": 20.285, "delayed": 18.978, "block": 22.882},
                     "B300": {"current": 9.147, "delayed": 7.802, "mx": 8.984}}
"""Per-layer time of one model's 12 GEMMs with each recipe quantizing its inputs as in training (autocast mode; hidden
4096, FFN 16384, 15,872 tokens), from NVIDIA/TransformerEngine ``docs/examples/gemm_profiling/gemm_profiling.rst`` at
8f2e635: what ``block`` and ``mx`` are priced from (``CAST_PASSES``)."""


def _passes_measured(part: str, recipe: str) -> float:
    """``recipe``'s cast passes from ``TE_GEMM_TOTALS_MS``: its time beyond ``current``'s, in units of ``current``'s lead
    over ``delayed`` (the one pass the two differ by), added to ``current``'s two."""
    totals = TE_GEMM_TOTALS_MS[part]
    return 2 + (totals[recipe] - totals["current"]) / (totals["current"] - totals["delayed"])


CAST_PASSES = {"delayed": 1, "current": 2, "rowwise": 2, "block": _passes_measured("H200 NVL", "block"),
               "mx": _passes_measured("B300", "mx")}
"""Passes over each linear input per cast, by ``TrainingConfig.fp8_scaling`` (see the module docstring). ``block``
(3.99) and ``mx`` (1.88) are effective counts measured beyond ``current`` (``TE_GEMM_TOTALS_MS``): ``block`` on an H200
NVL, ``mx`` on a B300, which stands in for the B200 and GB200 (no such figure for them). They carry what differs besides
the casts, the slower block-scaled kernels included (the guide: block scaling computes scales for both row- and
column-wise data, and its 1.40x over bf16 is the least of Hopper's recipes, against 1.58x for current and 1.69x for
delayed). On Blackwell, Transformer Engine runs ``block`` as MXFP8 (the guide's note); Tessera prices it as on Hopper."""


def bf16_flops(stage: StageTotals) -> tuple[float, float]:
    """(forward, backward) FLOPs per sequence that stay in bf16 under FP8: attention cores and the head."""
    attention = stage.attention_core_flops
    forward = min(stage.forward_flops, attention + stage.head_forward_flops)
    backward = min(stage.backward_flops, 2 * attention + stage.head_backward_flops)
    return forward, backward


def cast_traffic_bytes(stage: StageTotals, training: TrainingConfig, *, per_linear: bool = False) -> float:
    """Bytes the FP8 casts move per sequence and pass (forward, and again backward); 0 outside FP8. ``per_linear``:
    each linear casts its input on its own (``profiles.fp8_casts_per_linear``)."""
    if training.precision != "fp8":
        return 0.0
    inputs = stage.linear_call_input_bytes if per_linear else stage.linear_input_bytes
    return CAST_PASSES[training.fp8_scaling] * CAST_BYTES_PER_ELEMENT_BYTE * inputs


def saved_input_reduction_bytes(stage: StageTotals, training: TrainingConfig, *, saves_fp8_inputs: bool) -> float:
    """Bytes per sequence an FP8 recipe that saves its linears' inputs in FP8 keeps less than bf16 would: half
    of the inputs of the blocks that keep them on the device (a fully recomputed block saves only its input, an
    offloaded one nothing there), but those the named pieces it recomputes free whole
    (``module_recompute``)."""
    if training.precision != "fp8" or not saves_fp8_inputs or stage.blocks == 0:
        return 0.0
    kept = 1 - (stage.full_recompute_blocks + stage.offloaded_blocks) / stage.blocks
    return 0.5 * max(0.0, stage.linear_input_bytes * kept - stage.module_recompute_linear_input_bytes)
