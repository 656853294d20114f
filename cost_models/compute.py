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

The attention cores (the SDPA calls, ``StageTotals.attention_core_flops``) run fused kernels, not GEMMs: their rate is
the published forward + backward rate of the kernel the framework runs (``ImplementationProfile.attention_kernels``)
on the device (``topology/catalog.yaml`` ``attention_tflops``, from the FlashAttention-2 and -3 papers), at the run's
sequence length (``attention_efficiency``). A device or kernel with no published figure falls back to the calibrated
``Calibration.attention_efficiency`` (the behaviour before per-device figures), 0 there meaning the matmul curve.
Split over a PyTorch-style context-parallel ring (``ImplementationProfile.cp_ring_slowdown``), they run
``Calibration.cp_attention_slowdown`` times slower (fitted).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from tessera.cost_models.fp8 import bf16_flops, cast_traffic_bytes
from tessera.cost_models.partition import StageTotals
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.cost_models.stage_views import op_level_selective, with_loss_kernel
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology.cluster import DeviceSpec
from tessera.topology.head_dims import HeadDims, stage_head_rate
from tessera.topology.hardware import ATTENTION_KERNELS, LOCAL_CPU, AttentionCurve, attention_curve, matmul_scale


@dataclass(frozen=True)
class Calibration:
    """The fitted constants of the cost model for one kind of device.

    Matmuls of local width ``d`` reach ``peak_fraction * d / (d + half_width)`` of peak FLOP/s (FP8 matmuls
    ``fp8_peak_fraction * d / (d + fp8_half_width)`` of the FP8 peak); the non-matmul work (norms,
    activations, softmax, which FlopCounterMode counts as zero FLOPs) costs ``traffic_factor`` passes over the
    layer's saved activations at memory bandwidth, forward and twice that backward, less the fp32 copies a
    composite RMSNorm saves where the framework runs the fused kernel (``profiles.fused_rms_norm``; fitted so since
    2026-12-06, when the calibration objective, over the 60 training rows of the 132 published ones, went from 0.0557
    to 0.0547 with it). ``jitter``
    is the relative spread of one rank's step time (kernels, clocks, network noise): every step waits for the
    slowest of the ``n`` ranks, the expected maximum of ``n`` normal draws, ``jitter * sqrt(2 ln n)`` of the
    step (stragglers grow with the number of ranks). The attention cores run at their kernel's published rate
    (module docstring); where the device has no figure for the framework's kernel (or the framework runs attention
    unfused), at ``attention_efficiency`` of the bf16 peak whatever the width (0: the matmul curve): the fitted
    fallback. Split over PyTorch's context-parallel ring (and Tessera's, alike: ``profiles.cp_ring_slowdown``), they
    run ``cp_attention_slowdown`` times slower than that rate: fitted on torchtitan's published context-parallel runs,
    whose attention runs ~1.5-1.6x slower than FlashAttention-2's published rate at degrees 2 to 8 (its 8B at cp 2
    implies ~1.1; ``benchmarks/attention_gap.py``), for a reason not yet identified: the load-balanced ring's own
    published overhead is ~1.1x (zhuzilin/ring-flash-attention README, zigzag ring vs flash_attn on 8 GPUs).
    Transformer Engine's ring is not slowed: NeMo 24.03's runs at cp 2 to 32 imply 0.95-1.00 on the
    FlashAttention-2 its launcher ran (they implied ~1.5 while priced on cuDNN's rate, as the constant was first
    fitted to all context-parallel runs alike). How well
    ZeRO-3's collectives overlap is the framework's, not the device's: ``cost_models.profiles``.
    ``overlap_contention``: compute that runs beside a data-parallel collective it hides runs that much slower, the
    NCCL kernel holding SMs and memory bandwidth. Taken from a measurement, not fitted: compute overlapped with
    communication ran a mean 18.9% slower (max 40%) than alone, over GPT and Llama training on 4 A100s, H100s,
    MI250s and MI210s (Lee et al. 2025, 'Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed
    Deep Learning', arXiv 2507.03114, abstract). Not charged again on the context-parallel ring, whose fitted
    slowdown measures whatever slows a ring's attention, contention included, on those very runs; nor on
    tensor-parallel overlap, whose transfers (PyTorch's async TP, Transformer Engine's ring exchange) run on copy
    engines.
    """

    peak_fraction: float
    half_width: float
    traffic_factor: float = 0.0
    fp8_peak_fraction: float = 0.0
    fp8_half_width: float = 0.0
    jitter: float = 0.0
    attention_efficiency: float = 0.0
    cp_attention_slowdown: float = 1.0
    overlap_contention: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap_contention <= 1.0:  # a share of the hidden time (the search's floor relies on it)
            raise ValueError(f"overlap_contention={self.overlap_contention!r} is not between 0 and 1")

    def at(self, width: float) -> float:
        """Efficiency at local matmul width ``width`` (unknown width: the asymptote)."""
        return self.peak_fraction if width <= 0 else self.peak_fraction * width / (width + self.half_width)

    def fp8_at(self, width: float) -> float:
        """Efficiency of an FP8 matmul at local width ``width`` against the FP8 peak."""
        return self.fp8_peak_fraction if width <= 0 else self.fp8_peak_fraction * width / (width + self.fp8_half_width)


# Fitted on the training split of benchmarks/reference/published_runs.yaml and fsdp_fp8_runs.yaml (see
# benchmarks/published.py, which prints the fit and the held-out error). Re-fit there; do not hand-edit.
GPU_CALIBRATION = Calibration(peak_fraction=0.78, half_width=160.0, traffic_factor=4.0, fp8_peak_fraction=0.7,
                              fp8_half_width=0.0, jitter=0.015, attention_efficiency=0.35,
                              cp_attention_slowdown=1.55, overlap_contention=0.189)
# CPU ranks: the profiled matmul rate is already a sustained rate, flat in width (1 thread: 105-115 GF/s per
# CPU-second from 256^2 to 1024^2). The non-matmul work (norms, GELU, softmax, attention backward, loss) is
# charged as on GPUs, ``traffic_factor`` passes at the profiled copy bandwidth: one thread runs the small GPT of
# benchmarks/local_truth.py at ~0.095 CPU-s per sequence forward + backward, ~0.055 s of it matmul FLOPs at the
# matmul rate, the other ~0.04 s about 4-5.5 passes over its 21 MiB of saved activations (2026-11-30).
# FP8 likewise: the profiled rate is torch's CPU ``_scaled_mm`` itself (``topology.measure_device.fp8_matmul_flops``).
CPU_CALIBRATION = Calibration(peak_fraction=1.0, half_width=0.0, traffic_factor=GPU_CALIBRATION.traffic_factor,
                              fp8_peak_fraction=1.0)


CAUSAL_WORK = 0.5
"""Share of the measured attention-core FLOPs a causal kernel performs: FlopCounterMode counts the whole ``s x s``
product of every SDPA call, the fused kernels skip the masked half, and their benchmarks count only the half they
do (FlashAttention-2 paper Sec. 4.1). Tessera's models and the published runs are causal decoders; an encoder's
unmasked attention would be priced twice too fast (capture records no mask kind yet)."""
BACKWARD_CORE_FLOPS = 2.5
"""An attention core's backward FLOPs over its forward's, as FlopCounterMode counts SDPA
(``torch.utils.flop_counter.sdpa_backward_flop_count``: the scores recomputed, then four gradient matmuls, against
the forward's two) and as the kernel benchmarks count them: all of it runs inside the fused backward kernel."""


def device_calibration(device: DeviceSpec, calibration: Calibration = GPU_CALIBRATION) -> Calibration:
    """The constants for a device kind: ``calibration`` for accelerators, its matmul efficiencies scaled by the part's
    measured GEMM efficiency relative to the H100's (``topology.hardware.matmul_scale``: the B200 reaches a smaller
    share of its peak)."""
    if device.name == LOCAL_CPU:
        return CPU_CALIBRATION
    scale = matmul_scale(device.name)
    return calibration if scale == 1.0 else _matmul_scaled(calibration, scale)  # no hashing on the common path


@functools.lru_cache(maxsize=512)  # the calibration fit tries a few hundred constants
def _matmul_scaled(calibration: Calibration, scale: float) -> Calibration:
    return replace(calibration, peak_fraction=calibration.peak_fraction * scale,
                   fp8_peak_fraction=calibration.fp8_peak_fraction * scale)


def achievable_flops(
    device: DeviceSpec, precision: str, *, width: float = 0.0, calibration: Calibration = GPU_CALIBRATION
) -> float:
    """FLOP/s a training matmul of local width ``width`` reaches on ``device`` in ``precision``."""
    return device.peak_flops(precision) * device_calibration(device, calibration).at(width)


def bf16_or(precision: str) -> str:
    """The dtype of the matmuls that are not FP8: bf16 under ``fp8``, else ``precision`` itself."""
    return "bf16" if precision == "fp8" else precision


def attention_efficiency(
    device: DeviceSpec, precision: str, *, kernels: tuple[str, ...], seq_len: float,
    calibration: Calibration = GPU_CALIBRATION, head_widths: tuple[tuple[float, HeadDims], ...] = (),
) -> float:
    """Fraction of the ``precision`` peak at which the attention cores' measured FLOPs run on ``device``.

    The first of ``kernels`` (the framework's, in its order of preference) that the device's catalog entry has a
    published rate for: that rate at query length ``seq_len`` over ``CAUSAL_WORK`` (the kernel does half the
    measured FLOPs) and the peak; so an A100 running FlashAttention-2 at 2K tokens (155 TFLOP/s counted causal)
    prices the measured FLOPs at 0.99 of its 312 TFLOP/s; on heads other than the rates' 128 wide (``head_widths``:
    FLOPs and widths, ``StageTotals.attention_head_widths``), at the kernel's rate on them (``topology.head_dims``).
    The published rates are for bf16/fp16; other precisions (fp32: no flash kernel) and devices or kernels without a figure take ``calibration``'s fitted
    ``attention_efficiency`` (0: the caller's matmul rate).
    """
    published = published_attention_flops(device.name, precision, kernels, seq_len, head_widths)
    if published is None:
        return device_calibration(device, calibration).attention_efficiency
    return published / (CAUSAL_WORK * device.peak_flops(precision))


@functools.lru_cache(maxsize=4096)  # the catalog is read once; a search asks the same few lengths ~10^5 times
def published_attention_flops(
    device_name: str, precision: str, kernels: tuple[str, ...], seq_len: float,
    head_widths: tuple[tuple[float, HeadDims], ...] = (),
) -> float | None:
    """FLOP/s of the first of ``kernels`` with a published curve on the catalogued ``device_name`` in
    ``precision`` (bf16/fp16 only) at ``seq_len`` (``curve_at``) on heads of ``head_widths``
    (``head_dims.stage_head_rate``), or ``None``."""
    kernel = priced_attention_kernel(device_name, precision, kernels)
    if kernel is None:
        return None
    return curve_at(attention_curve(device_name, kernel), seq_len) * stage_head_rate(kernel, head_widths)


def priced_attention_kernel(device_name: str, precision: str, kernels: tuple[str, ...]) -> str | None:
    """The first of ``kernels`` with a published curve on ``device_name`` in ``precision`` (the benchmarks are bf16
    and fp16 only), or ``None``: the calibrated fallback prices the attention."""
    if precision not in ("bf16", "fp16"):
        return None
    return next((kernel for kernel in kernels if attention_curve(device_name, kernel)), None)


def curve_at(curve: AttentionCurve, seq_len: float) -> float:
    """The curve's FLOP/s at ``seq_len``: linear in log2 of the length between the published lengths, flat beyond
    them (the kernels' rate saturates: FA2 on A100 moves 0-4% from 8K to 16K tokens; below 512 tokens, where it
    still rises, attention is a small share of a step)."""
    lengths = [point[0] for point in curve]
    if seq_len <= lengths[0]:
        return curve[0][1]
    if seq_len >= lengths[-1]:
        return curve[-1][1]
    upper = next(i for i, length in enumerate(lengths) if length >= seq_len)
    (s0, r0), (s1, r1) = curve[upper - 1], curve[upper]
    t = (math.log2(seq_len) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
    return r0 + t * (r1 - r0)


def stage_compute_s(
    stage: StageTotals, device: DeviceSpec, training: TrainingConfig, strategy: Strategy,
    *, calibration: Calibration = GPU_CALIBRATION, profile: ImplementationProfile = TESSERA,
) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one micro-batch on one device of ``stage``, its attention cores
    on the kernels of ``profile`` (the framework that runs it)."""
    waiting = measured_by_degree(device.tp_compute_slowdown, strategy.tp, default=1.0)
    share = waiting * strategy.micro_batch / (strategy.tp * strategy.cp)
    op_level = op_level_selective(stage, profile.selective_policy)
    forward, backward, recompute = arithmetic_s(stage, device, training, width=stage.hidden_size / strategy.tp,
                                                expert_width=stage.expert_width / strategy.expert_tp,
                                                calibration=calibration, kernels=profile.kernels_at(strategy.cp),
                                                seq_len=training.seq_len / strategy.cp, cp=strategy.cp,
                                                ring_slowed=profile.cp_ring_slowdown, op_level=op_level)
    constants = device_calibration(device, calibration)
    per_byte = share * constants.traffic_factor / device.memory_bandwidth_bytes_per_s
    elementwise = per_byte * (stage.activation_traffic_bytes - fused_traffic_saving_bytes(stage, device, profile))
    passes = elementwise - per_byte * stage.loss_traffic_saving_bytes  # less what a fused loss kernel does not make
    casts = (share * cast_traffic_bytes(stage, training, per_linear=profile.fp8_casts_per_linear)
             / device.memory_bandwidth_bytes_per_s)
    forward_overhead, backward_overhead = framework_overhead_s(stage, device, tp=strategy.tp)
    if op_level:  # the selective blocks' elementwise work re-runs whole, their casts with their matmuls
        full_share = (stage.recompute_flops - stage.selective_core_flops) / stage.forward_flops
        traffic = stage.activation_traffic_bytes
        traffic_share = stage.selective_traffic_bytes / traffic if traffic else 0.0
        linear_share = full_share + (stage.op_selective_recompute_flops + stage.module_recompute_flops) / stage.forward_flops
        rerun = elementwise * (full_share + traffic_share) + (forward_overhead + casts) * linear_share
        return (forward * share + passes + casts + forward_overhead,
                backward * share + 2 * (passes + casts) + backward_overhead, recompute * share + rerun)
    module_share = stage.module_recompute_flops / stage.forward_flops if stage.forward_flops else 0.0
    recompute_share = (stage.recompute_flops / stage.forward_flops if stage.forward_flops else 0.0) + module_share
    # the linears re-run cast their inputs again: a full block's, and the named pieces' (a selective core has none)
    recast = casts * (recompute_share if stage.full_recompute_blocks else module_share)
    return (
        forward * share + passes + casts + forward_overhead,
        backward * share + 2 * (passes + casts) + backward_overhead,
        recompute * share + (elementwise + forward_overhead) * recompute_share + recast
        + _matmul_policy_rerun_s(stage, profile, elementwise=elementwise, casts=casts),
    )


def fused_traffic_saving_bytes(stage: StageTotals, device: DeviceSpec, profile: ImplementationProfile) -> int:
    """Per sequence, what the framework's fused kernels do not write of the activation traffic capture measured: a
    fused rms_norm no fp32 copies of its input (``profiles.fused_rms_norm``; ``profiles.fused_declared_norms`` for the
    norms the model declares RMSNorm layers), a fused gated MLP no activation output
    (``profiles.fused_gated_activation``); nothing on CPU ranks, which run the composites."""
    if device.name == LOCAL_CPU:
        return 0
    return ((stage.norm_traffic_saving_bytes if profile.fused_rms_norm else 0)
            + (stage.declared_norm_traffic_saving_bytes if profile.fused_declared_norms else 0)
            + (stage.gate_traffic_saving_bytes if profile.fused_gated_activation else 0))


def _matmul_policy_rerun_s(stage: StageTotals, profile: ImplementationProfile, *, elementwise: float, casts: float) -> float:
    """Under the ``matmuls`` selective policy (``profiles.selective_policy``), what the selective blocks re-run
    besides their attention cores: all their elementwise work and casts (everything but the matmuls), their share
    of the stage's activation traffic, less the elementwise share :func:`stage_compute_s` already charges with
    their cores' FLOPs."""
    traffic = stage.activation_traffic_bytes
    if profile.selective_policy != "matmuls" or not traffic or not stage.forward_flops:
        return 0.0
    rerun = (elementwise + casts) * stage.matmul_selective_traffic_bytes / traffic
    return max(0.0, rerun - elementwise * stage.matmul_selective_core_flops / stage.forward_flops)


def recomputed_flops(stage: StageTotals, profile: ImplementationProfile) -> float:
    """Forward FLOPs ``stage`` re-runs per sequence under its activation policies, as ``profile`` runs them."""
    if op_level_selective(stage, profile.selective_policy):
        return (stage.recompute_flops - stage.selective_core_flops + stage.op_selective_recompute_flops
                + stage.module_recompute_flops)
    return stage.recompute_flops + stage.module_recompute_flops


def arithmetic_s(
    stage: StageTotals, device: DeviceSpec, training: TrainingConfig, *, width: float, calibration: Calibration,
    kernels: tuple[str, ...] = TESSERA.attention_kernels, seq_len: float = 0.0, cp: int = 1, ring_slowed: bool = True,
    op_level: bool = False, expert_width: float = 0.0,
) -> tuple[float, float, float]:
    """(forward, backward, recompute) matmul seconds of ONE sequence of ``stage`` on one device's whole rate.

    The attention cores (their forward FLOPs ``stage.attention_core_flops``, backward ``BACKWARD_CORE_FLOPS``
    times that) run at the rate of the first of ``kernels`` the device has a figure for at query length
    ``seq_len`` (``attention_efficiency``; one forward + backward rate for both passes, as the benchmarks give
    it), slower on a ring of ``cp`` > 1 ranks that is ``ring_slowed`` (``attention_core_rate``); under FP8 the
    blocks' other linears run at the FP8 rate and the head at the bf16 rate (``cost_models.fp8``). A selective
    recomputation re-runs attention cores only, a full one the blocks' forward at its mixed rate; with ``op_level``
    (``stage_views.op_level_selective``), a selective block re-runs its ``op_selective_recompute_flops`` at the
    linears' rate instead (``profiles.selective_policy``). The routed experts' matmuls run at the curve's rate at
    their own local width where it is narrower (``expert_width``: an expert's narrowest matrix dimension over the
    expert tensor-parallel degree), as a dense block's run at the hidden size over tp.
    """
    rate = achievable_flops(device, bf16_or(training.precision), width=width, calibration=calibration)
    attention_rate = attention_core_rate(device, training, rate, calibration=calibration, kernels=kernels,
                                         seq_len=seq_len or training.seq_len, cp=cp, ring_slowed=ring_slowed,
                                         head_widths=stage.attention_head_widths)
    core = min(stage.attention_core_flops, stage.forward_flops)
    linear_rate, head_forward, head_backward = rate, 0.0, 0.0
    if training.precision == "fp8":
        linear_rate = device.peak_flops("fp8") * device_calibration(device, calibration).fp8_at(width)
        kept_forward, kept_backward = bf16_flops(stage)
        head_forward, head_backward = kept_forward - core, max(0.0, kept_backward - 2 * core)  # fp8.bf16_flops' head
    backward_core = min(BACKWARD_CORE_FLOPS * core, stage.backward_flops - head_backward)
    expert_slowdown = _expert_slowdown(device, training, width, expert_width, calibration)
    forward = ((stage.forward_flops - core - head_forward) / linear_rate + core / attention_rate + head_forward / rate
               + min(stage.expert_forward_flops, stage.forward_flops) * expert_slowdown / linear_rate)
    backward = ((stage.backward_flops - backward_core - head_backward) / linear_rate + backward_core / attention_rate
                + head_backward / rate + min(stage.expert_backward_flops, stage.backward_flops) * expert_slowdown / linear_rate)
    mixed = forward / stage.forward_flops if stage.forward_flops else 0.0
    modules = stage.module_recompute_flops  # the named pieces recomputed: their linears (Strategy.recompute_modules)
    if op_level:
        full = stage.recompute_flops - stage.selective_core_flops
        return forward, backward, full * mixed + (stage.op_selective_recompute_flops + modules) / linear_rate
    recompute = stage.recompute_flops * mixed if stage.full_recompute_blocks else stage.recompute_flops / attention_rate
    return forward, backward, recompute + modules / linear_rate


def _expert_slowdown(device: DeviceSpec, training: TrainingConfig, width: float, expert_width: float,
                     calibration: Calibration) -> float:
    """How much longer the routed experts' FLOPs take than the block's other linears' (0: not narrower): the
    efficiency curve at the hidden width over tp against at the experts' own narrower width."""
    if not 0 < expert_width < width:
        return 0.0
    constants = device_calibration(device, calibration)
    curve = constants.fp8_at if training.precision == "fp8" else constants.at
    return curve(width) / curve(expert_width) - 1.0


def attention_core_rate(
    device: DeviceSpec, training: TrainingConfig, rate: float,
    *, calibration: Calibration, kernels: tuple[str, ...], seq_len: float, cp: int = 1, ring_slowed: bool = True,
    head_widths: tuple[tuple[float, HeadDims], ...] = (),
) -> float:
    """FLOP/s at which the attention cores get through their measured FLOPs (the whole ``s x s`` of each call):
    ``attention_efficiency`` of the peak of their dtype (bf16 under FP8) on their ``head_widths``, else the matmul
    ``rate`` (no kernel figure and no calibrated fallback); split over a ring of ``cp`` > 1 ranks that is
    ``ring_slowed`` (``profiles.cp_ring_slowdown``), ``cp_attention_slowdown`` times slower."""
    precision = bf16_or(training.precision)
    efficiency = attention_efficiency(device, precision, kernels=kernels, seq_len=seq_len, calibration=calibration,
                                      head_widths=head_widths)
    unsplit = device.peak_flops(precision) * efficiency if efficiency else rate
    if cp > 1 and ring_slowed:
        return unsplit / device_calibration(device, calibration).cp_attention_slowdown
    return unsplit


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
    *, calibration: Calibration = GPU_CALIBRATION, profile: ImplementationProfile = TESSERA,
) -> float:
    """Seconds of one micro-batch's compute that no pipeline stage of ``strategy`` goes below, as ``profile`` runs it.

    ``model`` is the whole model summed as one stage: its compute spread perfectly over the ``pp`` stages,
    at the rate of its widest block (a stage is never faster). Recomputation's memory traffic is left out
    (per stage it is not additive), so this is a bound, not an estimate. The attention cores are taken at the
    fastest kernel the device has a figure for, so the bound holds whichever framework's profile the estimate
    uses, and so is the loss at a fused kernel's traffic (``stage_views.with_loss_kernel``) without tensor parallelism,
    and ``torch.rms_norm`` at the fused kernel's (``profiles.fused_rms_norm``); the declared norms and gated MLPs at
    the fused kernels' where ``profile`` runs them (``fused_declared_norms``, ``fused_gated_activation``).
    """
    model = with_loss_kernel(model, "flash-attn") if strategy.tp == 1 else model
    seq_len = training.seq_len / strategy.cp
    width = model.hidden_size / strategy.tp
    rate = achievable_flops(device, bf16_or(training.precision), width=width, calibration=calibration)
    head_widths = model.attention_head_widths
    kernels = _fastest_attention(device, training, rate, seq_len=seq_len, calibration=calibration,
                                 head_widths=head_widths)
    bounding = _tessera_with(kernels, profile.fused_declared_norms, profile.fused_gated_activation)
    forward, backward, _ = stage_compute_s(model, device, training, strategy, calibration=calibration,
                                           profile=bounding)
    attention = attention_core_rate(device, training, rate, calibration=calibration, kernels=kernels, seq_len=seq_len,
                                    head_widths=head_widths)
    fastest = max(rate, attention,
                  device.peak_flops("fp8") * device_calibration(device, calibration).fp8_at(width)
                  if training.precision == "fp8" else 0.0)
    selective = min(model.selective_core_flops, model.op_selective_recompute_flops or model.selective_core_flops)
    recomputed = model.recompute_flops - model.selective_core_flops + selective  # the lesser of either policy
    recompute = recomputed * strategy.micro_batch / (strategy.tp * strategy.cp * fastest)
    return (forward + backward + recompute) / strategy.pp


@functools.lru_cache(maxsize=64)
def _tessera_with(kernels: tuple[str, ...], declared_norms: bool, gates: bool) -> ImplementationProfile:
    """Tessera's profile on ``kernels`` with the fused RMSNorm's smaller elementwise traffic (and the declared norms'
    and gated MLPs' where asked) and a ring as fast as the unsplit kernel, whatever Tessera's own defaults (built once
    per choice: the bound is taken ~10^5 times a search)."""
    return replace(TESSERA, attention_kernels=kernels, cp_attention_kernels=None, fused_rms_norm=True,
                   fused_declared_norms=declared_norms, fused_gated_activation=gates, cp_ring_slowdown=False)


def _fastest_attention(
    device: DeviceSpec, training: TrainingConfig, rate: float, *, seq_len: float, calibration: Calibration,
    head_widths: tuple[tuple[float, HeadDims], ...] = (),
) -> tuple[str, ...]:
    """The ``kernels`` argument that gives the fastest attention any profile can get on ``device``: the catalogued
    kernel of the highest rate, or none (the fallback) where the fallback is faster; compared as each is priced
    (``attention_core_rate``: a kernel's published causal rate counts half the FLOPs the fallback's does)."""
    precision = bf16_or(training.precision)
    options = [(kernel,) for kernel in ATTENTION_KERNELS
               if published_attention_flops(device.name, precision, (kernel,), seq_len)] + [()]
    return max(options, key=lambda kernels: attention_core_rate(
        device, training, rate, calibration=calibration, kernels=kernels, seq_len=seq_len, head_widths=head_widths))


def optimizer_step_s(local_params: float, device: DeviceSpec, *, master_bytes: int = 4, moment_bytes: int = 4) -> float:
    """AdamW update time: memory-bound, it reads and writes the parameters it steps on (fp32 masters in mixed
    precision; ``master_bytes``), reads their gradients (in the same dtype: FSDP2 casts reduced gradients to the
    parameters' dtype) and reads and writes two moments (``moment_bytes`` each)."""
    bytes_touched = local_params * (master_bytes * (2 + 1) + moment_bytes * (2 + 2))  # param r/w, grad r, moments r/w
    return bytes_touched / device.memory_bandwidth_bytes_per_s
