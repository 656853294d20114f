"""Compute time from measured FLOPs against the device's achievable throughput."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.types import LayerStats, Strategy, TrainingConfig
from tessera.topology.cluster import DeviceSpec

# Fraction of peak dense FLOP/s that transformer training reaches on GPUs, end to end. Fitted (in-sample)
# to the three compute-bound data-parallel runs in benchmarks/reference/published_dp_runs.yaml
# (Megatron-LM 1.7B on 32 A100, DeepSpeed ZeRO-3 175B on 384 A100, Megatron-Core 1.7B on 48 H100),
# whose step times it then predicts within ~5% (benchmarks/published_dp.py). The cost-model issue
# replaces this single constant by a matmul-size-dependent curve checked on held-out runs.
GPU_MATMUL_EFFICIENCY = 0.46
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
    blocks = [layer for layer in layers if layer.kind == "block"]
    recomputed_flops = {
        "none": 0.0,
        "selective": sum(layer.selective_recompute_flops for layer in blocks),
        "full": sum(layer.forward_flops for layer in blocks),
    }[strategy.recompute]
    recompute = recomputed_flops * strategy.micro_batch / rate
    return forward, backward, recompute


def optimizer_step_s(local_params: float, device: DeviceSpec) -> float:
    """AdamW update time: memory-bound, it reads and writes params, grads and two moments in fp32."""
    bytes_touched = local_params * 4 * (2 + 1 + 2 + 2)  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w
    return bytes_touched / device.memory_bandwidth_bytes_per_s
