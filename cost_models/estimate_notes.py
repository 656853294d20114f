"""The assumptions an ``Estimate`` states in its ``notes``: what it priced in a way a reader should know (FP8's
curves, the stragglers' wait, named pieces capture did not find, the host's time under mixture of experts, how the
attention cores were priced). The report shows them under the prediction."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.cost_models.compute import (
    Calibration, bf16_or, device_calibration, priced_attention_kernel, published_attention_flops,
)
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.module_recompute import unmeasured_pieces_note
from tessera.cost_models.profiles import ImplementationProfile
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology.cluster import DeviceSpec
from tessera.topology.hardware import LOCAL_CPU
from tessera.topology.head_dims import HeadDims, stage_head_rate


def estimate_notes(
    layers: Sequence[LayerStats], device: DeviceSpec, training: TrainingConfig, strategy: Strategy,
    profile: ImplementationProfile, calibration: Calibration, *, straggling: float,
    head_widths: tuple[tuple[float, HeadDims], ...] = (),
) -> tuple[str, ...]:
    """Every note of an estimate of ``strategy`` on ``device`` (``straggling``: seconds a step waits for its slowest
    rank; ``head_widths``: the slowest stage's attention cores by head width)."""
    return (_notes(training, straggling) + unmeasured_pieces_note(layers, strategy.recompute_modules)
            + _host_time_note(device, layers)
            + _attention_note(device, training, strategy, profile, calibration, head_widths))


def _notes(training: TrainingConfig, straggling: float) -> tuple[str, ...]:
    notes = []
    if training.precision == "fp8":
        notes.append(f"fp8 ({training.fp8_scaling} scaling): the blocks' linears at the FP8 peak on their own efficiency "
                     "curve; attention cores, norms, embedding and head in bf16")
        if training.fp8_scaling == "rowwise":
            notes.append("fp8 rowwise scaling: its matmul efficiency is not calibrated on public runs "
                         "(the per-tensor curve is used)")
        elif training.fp8_scaling in ("block", "mx"):
            notes.append(f"fp8 {training.fp8_scaling} scaling: the per-tensor curve, plus its extra cost over current "
                         "scaling as Transformer Engine's GEMM benchmark measures it (cost_models.fp8.CAST_PASSES); "
                         "not calibrated on public runs")
    if straggling:
        notes.append(f"stragglers: {straggling:.3g} s per step waiting for the slowest rank")
    return tuple(notes)


def _host_time_note(device: DeviceSpec, layers: Sequence[LayerStats]) -> tuple[str, ...]:
    """On a GPU, for a model with routed experts, a note that the host's time is not priced. Published Megatron-Core
    MoE runs mostly ran slower than predicted, most of all under FP8, and NVIDIA's own tuning notes name host overhead
    (``docs/calibration-log.md``, 2026-12-07); no public measurement says how much per layer. On this machine's CPU the
    profiled per-linear host overhead is priced already (``DeviceSpec.linear_overhead_s``)."""
    if device.name == LOCAL_CPU or not any(layer.experts for layer in layers):
        return ()
    return ("mixture of experts: the host's (CPU's) time is not priced; a dropless dispatcher's device-to-host sync in "
            "every MoE layer and the experts' many small kernels (more under FP8, with its quantization kernels) can "
            "leave the GPU idle, so published MoE runs mostly ran slower than predicted (see the likely step time)",)


def _attention_note(device: DeviceSpec, training: TrainingConfig, strategy: Strategy, profile: ImplementationProfile,
                    calibration: Calibration, head_widths: tuple[tuple[float, HeadDims], ...] = ()) -> tuple[str, ...]:
    """Where no published kernel rate prices the attention on this GPU (``compute.published_attention_flops``, as
    the pricing decides), a note saying what does instead; where one does on heads other than its 128 wide, the
    share of that rate they get (``topology.head_dims``); under context parallelism, one saying the ring's fitted
    slowdown prices it too."""
    if device.name == LOCAL_CPU:
        return ()
    precision, kernels = bf16_or(training.precision), profile.kernels_at(strategy.cp)
    constants = device_calibration(device, calibration)
    notes = []
    if published_attention_flops(device.name, precision, kernels, training.seq_len / strategy.cp) is None:
        share = constants.attention_efficiency
        rate = f"the calibration's fallback, {share:.0%} of the {precision} peak" if share else "the matmul rate"
        what = f"no published rate of {'/'.join(kernels)} in {precision} on" if kernels else "it runs unfused on"
        notes.append(f"attention: {what} {device.name}; its cores are priced at {rate}")
    elif any(dims.key and dims != (128, 128) for _, dims in head_widths):
        kernel = priced_attention_kernel(device.name, precision, kernels)
        widths = ", ".join(f"{dims.key:g}" + ("" if dims.key == dims.value else f"/{dims.value:g}")
                           for _, dims in head_widths if dims.key)
        notes.append(f"attention: heads {widths} wide run {kernel} at {stage_head_rate(kernel, head_widths):.2f} of its "
                     "rate at 128 (the kernel papers' A100 and H100 figures; topology/head_dims.py)")
    if strategy.cp > 1 and profile.cp_ring_slowdown and constants.cp_attention_slowdown != 1.0:
        notes.append(f"attention: split over a context-parallel ring of {strategy.cp}, its cores are priced "
                     f"{constants.cp_attention_slowdown:g}x slower than unsplit (fitted on torchtitan's published "
                     "context-parallel runs; the cause is not identified)")
    return tuple(notes)
