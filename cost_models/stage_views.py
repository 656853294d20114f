"""A stage's totals as a framework runs them (``cost_models.profiles``): which tensors its selective recomputation
keeps, the kernel its loss runs as, and CUDA's fused RMSNorm. Each view returns a new ``StageTotals``."""

from __future__ import annotations

from dataclasses import replace

from tessera.cost_models.partition import StageTotals


def op_level_selective(stage: StageTotals, selective_policy: str) -> bool:
    """Whether ``stage``'s selective blocks run as an op-level policy does (``selective_policy`` ``op``,
    ``profiles.ImplementationProfile``); blocks not measured for it (a graph captured before it was, a block whose
    experts were replayed) keep the attention-core policy."""
    return selective_policy == "op" and stage.op_selective_recompute_flops > 0


def as_selective_memory(stage: StageTotals, selective_policy: str, *, tp: int = 1, sp: bool = False) -> StageTotals:
    """``stage`` with its selective blocks keeping what ``selective_policy`` keeps (``profiles.selective_policy``):
    the attention-core policy's figures as summed, the others' swapped in, and one such block recomputed at a time
    on top of them.

    Under tensor and sequence parallelism the ``matmuls`` policy also keeps, per linear pair, the gathered input
    whole (the residual stream's dtype: fp32 under autocast), the row-parallel matmul's partial sum whole and the
    reduce-scattered output (``1/tp``). The ``1/tp`` share of the per-layer figure holds ``1/tp`` of the partial
    sum, and ``memory.sp_gathered_input_bytes`` adds ``1 - 1/tp`` of one residual-width tensor per pair: what is
    left to add per device is one gathered input and one ``1/tp`` output per pair (measured on small-gpt,
    ``benchmarks/memory_truth.py --pins``: ``tp=4`` 11% short and ``dp=2,tp=2`` 4% short without them). Tensor
    parallelism without sequence parallelism keeps the attention-core figure, which is larger (measured 4-13% over
    there), though its recompute time is the matmuls policy's (``compute``: the runtime runs that policy either
    way). The op-level policy keeps none of those gathered inputs: its save list holds reduce-scatters, not
    all-gathers, so each selective block gathers its pairs' inputs again in the backward
    (``communication.tp_comm_s``)."""
    if op_level_selective(stage, selective_policy):
        stage = as_op_level_memory(stage)
        if tp > 1 and sp:  # its save list keeps reduce-scatters, not all-gathers: the inputs are gathered again
            stage = replace(stage, sp_gathered_bytes=stage.sp_gathered_bytes - stage.op_selective_gathered_bytes)
        return stage
    if selective_policy != "matmuls" or not stage.matmul_selective_traffic_bytes or (tp > 1 and not sp):
        return stage
    saved = stage.saved_bytes - stage.selective_blocks_saved_bytes + stage.matmul_selective_saved_bytes
    if tp > 1:  # saved bytes are divided by tp later: what each device holds whole counts tp times here
        saved += stage.matmul_selective_gathered_bytes * tp + stage.matmul_selective_pair_bytes
    return replace(stage, saved_bytes=saved,
                   recompute_buffer_bytes=max(stage.recompute_buffer_bytes, stage.matmul_selective_buffer_bytes))


CROSS_ENTROPY_KERNELS = ("torch", "flash-attn", "compiled", "megatron")
"""How a framework computes the loss (``profiles.cross_entropy``): torch's cross-entropy over fp32 log-probabilities
(what capture measures), flash-attn's fused ``xentropy`` kernel, torch's cross-entropy under ``torch.compile`` (one
fused kernel too: the partitioner keeps the logits and a log-sum-exp per token and recomputes the softmax in the
backward), or Megatron's vocabulary-parallel cross-entropy."""
FUSED_CROSS_ENTROPY = ("flash-attn", "compiled")
"""The kernels that run on the logits as they come (:func:`with_loss_kernel`), without tensor parallelism."""


def with_loss_kernel(stage: StageTotals, kernel: str) -> StageTotals:
    """``stage`` with its loss run by ``kernel`` (``CROSS_ENTROPY_KERNELS``; its backward's working tensors:
    ``memory_state.loss_gradient_bytes``). A fused kernel (``FUSED_CROSS_ENTROPY``) keeps the logits as they come
    instead of fp32 log-probabilities (plus one fp32 log-sum-exp per token, left out: 4 bytes beside a vocabulary's worth), and makes
    that much less of the traffic elementwise time is charged by (``loss_traffic_saving_bytes``: the FP8 terms that
    read the activation traffic as the linears' inputs leave it alone). ``megatron`` keeps an fp32 softmax, as large
    as torch's log-probabilities."""
    if kernel == stage.loss_kernel or not stage.loss_saved_bytes or not stage.logits_bytes:
        return stage
    if kernel not in FUSED_CROSS_ENTROPY:
        return stage.amended(loss_kernel=kernel)
    saving = stage.loss_saved_bytes - stage.logits_bytes
    return stage.amended(saved_bytes=stage.saved_bytes - saving, loss_saved_bytes=stage.logits_bytes,
                         loss_traffic_saving_bytes=saving, loss_kernel=kernel)


def with_fused_norms(stage: StageTotals, selective_policy: str) -> StageTotals:
    """``stage`` with its ``torch.rms_norm`` calls run as CUDA's fused kernel (``profiles.fused_rms_norm``): each keeps
    its input alone, not what the composite measured keeps (up to two fp32 copies of it: ``planner.kernels``), in the
    layers that are not recomputed, in the selective blocks where the attention-core policy keeps their norms (the
    op-level and matmuls policies re-run them). A recomputed block's buffer (``recompute_buffer_bytes``) keeps the
    composite's figure: one block, on the safe side. Memory only: the elementwise time takes the fused norms off
    the activation traffic by itself (``StageTotals.norm_traffic_saving_bytes``, ``compute.stage_compute_s``), in
    every layer, recomputed or not."""
    return _without_saving(stage, "norm", selective_policy)


def with_fused_declared_norms(stage: StageTotals, selective_policy: str) -> StageTotals:
    """``stage`` with the norms the model declares RMSNorm kernel layers run as the framework's own fused norm
    (``profiles.fused_declared_norms``), as :func:`with_fused_norms` takes ``torch.rms_norm``'s off; the elementwise
    time takes them off the traffic by itself (``StageTotals.declared_norm_traffic_saving_bytes``)."""
    return _without_saving(stage, "declared_norm", selective_policy)


def with_fused_gates(stage: StageTotals, selective_policy: str) -> StageTotals:
    """``stage`` with its gated MLPs run as one fused kernel (``profiles.fused_gated_activation``): it keeps the gate's
    and up's outputs, not the activation's output too (``planner.kernels``), where the policy keeps them, as
    :func:`with_fused_norms` takes its norms off; the elementwise time takes them off the traffic by itself
    (``StageTotals.gate_traffic_saving_bytes``)."""
    return _without_saving(stage, "gate", selective_policy)


def _without_saving(stage: StageTotals, kernel: str, selective_policy: str) -> StageTotals:
    """``stage`` less what the fused ``kernel`` (``norm``, ``declared_norm``, ``gate``) saves less, in the layers not recomputed and in
    the selective blocks under the attention-core policy."""
    plain, selective = f"{kernel}_saving_bytes", f"selective_{kernel}_saving_bytes"
    kept = getattr(stage, plain) + (getattr(stage, selective) if selective_policy == "attention" else 0)
    if not kept:
        return stage
    return stage.amended(saved_bytes=stage.saved_bytes - kept, **{plain: 0, selective: 0})


def as_op_level_memory(stage: StageTotals) -> StageTotals:
    """``stage`` with its selective blocks keeping what the op-level policy keeps, and one of them recomputed at a
    time on top of it."""
    return replace(stage, saved_bytes=stage.saved_bytes - stage.selective_saved_bytes + stage.op_selective_saved_bytes,
                   recompute_buffer_bytes=max(stage.recompute_buffer_bytes, stage.op_selective_buffer_bytes))
