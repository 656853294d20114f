"""Compute time from measured FLOPs against the device's achievable throughput."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.types import LayerStats, Strategy, TrainingConfig
from tessera.topology.cluster import DeviceSpec

# Fraction of peak dense FLOP/s that large transformer matmuls reach in end-to-end training.
# Megatron-LM on A100 sustains 44-52% of peak on GPT models of 1.7B-1T parameters including every
# overhead (Narayanan et al. SC'21, Table 1); the compute-only share is higher. 0.55 is the single
# constant the thin slice uses; the cost-model issue replaces it by a matmul-size-dependent curve.
GPU_MATMUL_EFFICIENCY = 0.55
# CPU ranks: the nominal per-core peak in topology.hardware already is a sustained figure.
CPU_MATMUL_EFFICIENCY = 1.0


def achievable_flops(device: DeviceSpec, precision: str) -> float:
    """FLOP/s a well-shaped training matmul reaches on ``device`` in ``precision``."""
    efficiency = CPU_MATMUL_EFFICIENCY if device.name == "local-cpu" else GPU_MATMUL_EFFICIENCY
    return device.peak_flops(precision) * efficiency


def microbatch_compute_s(
    layers: Sequence[LayerStats], device: DeviceSpec, training: TrainingConfig, strategy: Strategy
) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds for one micro-batch on one device."""
    rate = achievable_flops(device, training.precision)
    forward = sum(layer.forward_flops for layer in layers) * strategy.micro_batch / rate
    backward = sum(layer.backward_flops for layer in layers) * strategy.micro_batch / rate
    recomputed = [layer for layer in layers if layer.kind == "block"] if strategy.recompute == "full" else []
    recompute = sum(layer.forward_flops for layer in recomputed) * strategy.micro_batch / rate
    return forward, backward, recompute


def optimizer_step_s(local_params: float, device: DeviceSpec) -> float:
    """AdamW update time: memory-bound, it reads and writes params, grads and two moments in fp32."""
    bytes_touched = local_params * 4 * (2 + 1 + 2 + 2)  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w
    return bytes_touched / device.memory_bandwidth_bytes_per_s
