"""Per-device memory of one pipeline stage, by category, as Tessera's runtime holds it.

Model state per parameter (mixed precision keeps fp32 masters): fp32 parameters (4 B), fp32 gradients
(4 B) and two fp32 Adam moments (8 B). ZeRO stage 1 shards the moments over the data-parallel axis,
stage 2 also the gradients, stage 3 (FSDP) also the parameters; FSDP then gathers one block at a time
(plus one prefetched) in the compute dtype. Tensor parallelism divides blocks and vocabulary matrices.
Expert parallelism divides routed experts by ``ep``; the "data-parallel axis" of a kind of state is the ranks
holding the same weights: ``dp * cp`` for dense, ``(dp / ep) * cp`` for expert state (``cost_models.sparse``).
Context parallelism divides activations by ``cp`` (each rank keeps ``s / cp`` tokens).

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, Sec. 4): without sequence parallelism, the inputs of norms and the residual stream
(10 of the 34 ``sbh`` bytes per layer) are replicated on every tensor-parallel rank; with it everything
is divided by ``tp``.
"""

from __future__ import annotations

from tessera.cost_models.partition import StageTotals
from tessera.cost_models.pipeline import in_flight_micro_batches
from tessera.cost_models.sparse import (
    largest_gathered_params, local_param_split, ring_and_dispatch_buffer_bytes, sharded_params,
)
from tessera.cost_models.types import Strategy, TrainingConfig

FP32 = 4
GiB = 2**30
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP default bucket_cap_mb=25; two buckets in flight
FSDP_PREFETCH_BLOCKS = 2  # the block being computed plus the one prefetched
REPLICATED_ACTIVATION_SHARE = 10 / 34  # Korthikanti et al. eq. 2: sbh(10 + 24/t) of sbh*34 without SP
# Allowance outside tensors: CUDA context, NCCL buffers and allocator fragmentation (~2 GiB on GPUs,
# a stated assumption); a CPU rank costs ~220 MB before any model (shared/PLATFORM-NOTES.md).
GPU_RESERVE_BYTES = 2 * GiB
CPU_RESERVE_BYTES = 256 * 2**20


def compute_dtype_bytes(training: TrainingConfig) -> int:
    """Bytes per element of the compute dtype."""
    return FP32 if training.precision == "fp32" else 2


def local_params(stage: StageTotals, strategy: Strategy) -> float:
    """Parameters of ``stage`` on one device: tp divides the sharded ones, tp * ep the routed experts."""
    if not stage.expert_params:
        return stage.sharded_params / strategy.tp + stage.replicated_params
    return sum(local_param_split(stage, strategy))


def stage_memory(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool
) -> dict[str, int]:
    """Peak bytes on one device of ``stage`` by category."""
    # ZeRO shards dense state over dp * cp ranks and expert state over edp * cp (cost_models.sparse).
    state = {
        "parameters": sharded_params(stage, strategy, from_zero=3) * FP32,
        "gradients": sharded_params(stage, strategy, from_zero=2) * FP32,
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": activation_bytes(stage, strategy, micro_batches=micro_batches),
        "buffers": _buffer_bytes(stage, training, strategy),
        "reserve": CPU_RESERVE_BYTES if on_cpu else GPU_RESERVE_BYTES,
    }
    return {name: int(value) for name, value in state.items()}


def activation_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """Activations a stage holds at its peak: in-flight micro-batches plus one block being recomputed."""
    per_micro_batch = stage.saved_bytes * strategy.micro_batch
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    held = per_micro_batch * in_flight + stage.recompute_buffer_bytes * strategy.micro_batch
    return held * tp_activation_share(strategy) / strategy.cp


def tp_activation_share(strategy: Strategy) -> float:
    """Share of a layer's activations one tensor-parallel rank keeps."""
    if strategy.tp == 1 or strategy.sp:
        return 1 / strategy.tp
    return REPLICATED_ACTIVATION_SHARE + (1 - REPLICATED_ACTIVATION_SHARE) / strategy.tp


def _buffer_bytes(stage: StageTotals, training: TrainingConfig, strategy: Strategy) -> float:
    # Send and receive buffers of the stage boundary: one micro-batch's boundary activation (s / cp tokens).
    pipeline = 2 * stage.boundary_bytes * strategy.micro_batch / strategy.cp if strategy.pp > 1 else 0
    pipeline += ring_and_dispatch_buffer_bytes(stage, strategy)  # cp ring / ep all-to-all buffers (0 without them)
    if strategy.zero == 3:
        largest = largest_gathered_params(stage, strategy)
        # Gathered compute-dtype parameters of the current and prefetched block, one unsharded fp32 gradient.
        return pipeline + largest * (FSDP_PREFETCH_BLOCKS * compute_dtype_bytes(training) + FP32)
    return pipeline + (2 * DDP_BUCKET_BYTES if strategy.dp * strategy.cp > 1 else 0)
