"""Per-device memory by category for data-parallel strategies (DDP and FSDP2), as Tessera's runtime runs them.

Mixed precision (bf16/fp16) follows the runtime: DDP keeps fp32 parameters and gradients and casts under
autocast; FSDP2 keeps sharded fp32 parameters, gradients and Adam moments and gathers one block at a time
in the compute dtype. Adam holds two fp32 moments per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.types import LayerStats, Strategy, TrainingConfig
from tessera.errors import NotModelledError

FP32 = 4
GiB = 2**30
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP default bucket_cap_mb=25; two buckets in flight
FSDP_PREFETCH_BLOCKS = 2  # the block being computed plus the one prefetched
# Allowance outside tensors: CUDA context, NCCL buffers and allocator fragmentation (~2 GiB on GPUs,
# a stated assumption); a CPU rank costs ~220 MB before any model (shared/PLATFORM-NOTES.md).
GPU_RESERVE_BYTES = 2 * GiB
CPU_RESERVE_BYTES = 256 * 2**20


def compute_dtype_bytes(training: TrainingConfig) -> int:
    """Bytes per element of the compute dtype."""
    return FP32 if training.precision == "fp32" else 2


def memory_by_category(
    layers: Sequence[LayerStats], training: TrainingConfig, strategy: Strategy, *, on_cpu: bool
) -> dict[str, int]:
    """Peak per-device bytes by category: parameters, gradients, optimizer, activations, buffers, reserve."""
    if strategy.zero not in (0, 3):
        raise NotModelledError(f"ZeRO stage {strategy.zero} is not modelled yet; use zero=0 (DDP) or zero=3 (FSDP)")
    params = sum(layer.param_count for layer in layers)
    shard = strategy.dp if strategy.zero == 3 else 1
    state = {
        "parameters": params * FP32 // shard,
        "gradients": params * FP32 // shard,
        "optimizer": params * 2 * FP32 // shard,
        "activations": activation_bytes(layers, strategy),
        "buffers": _buffer_bytes(layers, training, strategy),
        "reserve": CPU_RESERVE_BYTES if on_cpu else GPU_RESERVE_BYTES,
    }
    return {name: int(value) for name, value in state.items()}


def activation_bytes(layers: Sequence[LayerStats], strategy: Strategy) -> int:
    """Bytes saved for backward by one micro-batch at its peak (the end of the forward pass)."""
    if strategy.recompute == "none":
        per_sequence = sum(layer.saved_bytes_no_recompute for layer in layers)
    elif strategy.recompute == "selective":
        per_sequence = sum(
            layer.saved_bytes_no_recompute if layer.saved_bytes_selective is None else layer.saved_bytes_selective
            for layer in layers
        )
    else:
        blocks = [layer for layer in layers if layer.kind == "block"]
        others = [layer for layer in layers if layer.kind != "block"]
        # Block inputs are kept; during backward one block at a time is recomputed in full.
        largest_block = max((layer.saved_bytes_no_recompute for layer in blocks), default=0)
        per_sequence = (
            sum(layer.saved_bytes_full_recompute for layer in blocks)
            + largest_block
            + sum(layer.saved_bytes_no_recompute for layer in others)
        )
    return per_sequence * strategy.micro_batch


def _buffer_bytes(layers: Sequence[LayerStats], training: TrainingConfig, strategy: Strategy) -> int:
    if strategy.zero == 0:
        return 2 * DDP_BUCKET_BYTES if strategy.dp > 1 else 0
    largest = max((layer.param_count for layer in layers), default=0)
    # Unsharded compute-dtype parameters of the gathered blocks plus one block's unsharded fp32 gradient.
    return largest * (FSDP_PREFETCH_BLOCKS * compute_dtype_bytes(training) + FP32)
