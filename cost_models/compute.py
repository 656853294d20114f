"""Compute time from measured FLOPs against the device's achievable throughput.

Achievable throughput follows a saturating curve in the width of the local matrix multiplications
(``d = hidden / tp``): ``efficiency(d) = peak_fraction * d / (d + half_width)``. Narrow matmuls (small
models, or large tensor-parallel degrees) reach a smaller share of peak, as the Megatron-LM tables show.
The two constants are fitted on the training split of the published runs (``benchmarks/published.py``).

Where the profiler measured it (CPU ranks), each micro-batch also pays the framework's host overhead per
linear (``DeviceSpec.linear_overhead_s``: Python, dispatch, autograd, DTensor under tensor parallelism): on
a CPU the host and the arithmetic share the same cores, so it adds to the compute time. Tensor-parallel
arithmetic there is also slowed by ``DeviceSpec.tp_compute_slowdown``: ranks sharing cores wait for their
partners at every collective of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.cost_models.partition import StageTotals
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology.cluster import DeviceSpec


@dataclass(frozen=True)
class Calibration:
    """The fitted constants of the cost model for one kind of device.

    Matmuls of local width ``d`` reach ``peak_fraction * d / (d + half_width)`` of peak FLOP/s; the
    non-matmul work (norms, activations, softmax, which FlopCounterMode counts as zero FLOPs) costs
    ``traffic_factor`` passes over the layer's saved activations at memory bandwidth, forward and twice
    that backward. ZeRO-3 parameter gathers and gradient reduce-scatters take ``zero3_comm_slowdown``
    times the ideal ring time of ``topology.collectives``.
    """

    peak_fraction: float
    half_width: float
    traffic_factor: float = 0.0
    zero3_comm_slowdown: float = 1.0

    def at(self, width: float) -> float:
        """Efficiency at local matmul width ``width`` (unknown width: the asymptote)."""
        return self.peak_fraction if width <= 0 else self.peak_fraction * width / (width + self.half_width)


# Fitted on the training split of benchmarks/reference/published_runs.yaml (see benchmarks/published.py,
# which prints the fit and the held-out error). Re-fit there; do not hand-edit. zero3_comm_slowdown is fitted
# on DeepSpeed ZeRO-3 runs (SC'21 Table 2), the only sharded-data-parallel measurements at scale in the set:
# until FSDP2 is measured at scale, Tessera assumes it communicates no better than they did.
GPU_CALIBRATION = Calibration(peak_fraction=0.7, half_width=160.0, traffic_factor=4.0, zero3_comm_slowdown=5.0)
# CPU ranks: the profiled matmul rate is already a sustained rate, flat in width (1 thread: 105-115 GF/s per
# CPU-second from 256^2 to 1024^2). The non-matmul work (norms, GELU, softmax, attention backward, loss) is
# charged as on GPUs, ``traffic_factor`` passes at the profiled copy bandwidth: one thread runs the small GPT of
# benchmarks/local_truth.py at ~0.095 CPU-s per sequence forward + backward, ~0.055 s of it matmul FLOPs at the
# matmul rate, the other ~0.04 s about 4-5.5 passes over its 21 MiB of saved activations (2026-11-30).
CPU_CALIBRATION = Calibration(peak_fraction=1.0, half_width=0.0, traffic_factor=GPU_CALIBRATION.traffic_factor)


def device_calibration(device: DeviceSpec, calibration: Calibration = GPU_CALIBRATION) -> Calibration:
    """The constants for a device kind (``calibration`` for accelerators)."""
    return CPU_CALIBRATION if device.name == "local-cpu" else calibration


def achievable_flops(
    device: DeviceSpec, precision: str, *, width: float = 0.0, calibration: Calibration = GPU_CALIBRATION
) -> float:
    """FLOP/s a training matmul of local width ``width`` reaches on ``device`` in ``precision``."""
    return device.peak_flops(precision) * device_calibration(device, calibration).at(width)


def stage_compute_s(
    stage: StageTotals, device: DeviceSpec, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION,
) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one micro-batch on one device of ``stage``."""
    width = stage.hidden_size / strategy.tp
    rate = achievable_flops(device, training.precision, width=width, calibration=calibration)
    waiting = measured_by_degree(device.tp_compute_slowdown, strategy.tp, default=1.0)
    scale = waiting * strategy.micro_batch / (strategy.tp * strategy.cp * rate)
    constants = device_calibration(device, calibration)
    traffic = waiting * constants.traffic_factor * stage.activation_traffic_bytes * strategy.micro_batch / (
        strategy.tp * strategy.cp * device.memory_bandwidth_bytes_per_s
    )
    recompute_share = stage.recompute_flops / stage.forward_flops if stage.forward_flops else 0.0
    forward_overhead, backward_overhead = framework_overhead_s(stage, device, tp=strategy.tp)
    return (
        stage.forward_flops * scale + traffic + forward_overhead,
        stage.backward_flops * scale + 2 * traffic + backward_overhead,
        stage.recompute_flops * scale + (traffic + forward_overhead) * recompute_share,
    )


def framework_overhead_s(stage: StageTotals, device: DeviceSpec, *, tp: int) -> tuple[float, float]:
    """(forward, backward) host seconds one micro-batch of ``stage`` costs beyond its arithmetic: its linears
    times the device's measured overhead per linear at this tensor-parallel degree (0 where not measured),
    split between the passes as their FLOPs are."""
    per_linear = linear_overhead_s(device, tp)
    total_flops = stage.forward_flops + stage.backward_flops
    if not per_linear or not total_flops:
        return 0.0, 0.0
    overhead = stage.linears * per_linear
    forward = overhead * stage.forward_flops / total_flops
    return forward, overhead - forward


def linear_overhead_s(device: DeviceSpec, tp: int) -> float:
    """The device's host overhead per linear and micro-batch at tensor-parallel degree ``tp`` (0 unmeasured)."""
    return measured_by_degree(device.linear_overhead_s, tp, default=0.0)


def measured_by_degree(values: dict[int, float], tp: int, *, default: float) -> float:
    """A per-degree measurement at tensor-parallel degree ``tp``: measured at that degree, else at the largest
    measured degree below it (a lower bound: both grow with the degree), else ``default``."""
    measured = [degree for degree in values if degree <= tp]
    return values[max(measured)] if measured else default


def compute_lower_bound_s(
    model: StageTotals, device: DeviceSpec, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION,
) -> float:
    """Seconds of one micro-batch's compute that no pipeline stage of ``strategy`` goes below.

    ``model`` is the whole model summed as one stage: its compute spread perfectly over the ``pp`` stages,
    at the rate of its widest block (a stage is never faster). Recomputation's memory traffic is left out
    (per stage it is not additive), so this is a bound, not an estimate.
    """
    forward, backward, _ = stage_compute_s(model, device, training, strategy, calibration=calibration)
    rate = achievable_flops(device, training.precision, width=model.hidden_size / strategy.tp, calibration=calibration)
    recompute = model.recompute_flops * strategy.micro_batch / (strategy.tp * strategy.cp * rate)
    return (forward + backward + recompute) / strategy.pp


def optimizer_step_s(local_params: float, device: DeviceSpec) -> float:
    """AdamW update time: memory-bound, it reads and writes params, grads and two moments in fp32."""
    bytes_touched = local_params * 4 * (2 + 1 + 2 + 2)  # param r/w, grad r, exp_avg r/w, exp_avg_sq r/w
    return bytes_touched / device.memory_bandwidth_bytes_per_s
