"""Attention cores priced at their kernel's published rate per device (``cost_models.compute.attention_efficiency``)."""

import itertools
from dataclasses import replace

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import (
    BACKWARD_CORE_FLOPS, CAUSAL_WORK, Calibration, attention_efficiency, compute_lower_bound_s, curve_at, stage_compute_s,
)
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.partition import block_policies, stage_totals
from tessera.cost_models.profiles import MEGATRON, MEGATRON_2021, PYTORCH_FSDP_TE, TESSERA, TORCHTITAN
from tessera.errors import ClusterSpecError
from tessera.topology import load_cluster
from tessera.topology.hardware import attention_curve, attention_curves_from_raw, device

GiB = 2**30
FALLBACK = 0.4
FLAT = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0, attention_efficiency=FALLBACK)
CORE = 2e12  # forward FLOPs of each block's attention core (full s x s count, as FlopCounterMode measures it)
A100, H100 = load_cluster("dgx-a100:nodes=1"), load_cluster("dgx-h100:nodes=1")


def block(i: int) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="b", param_count=10**9, forward_flops=1e13,
        backward_flops=2e13 + 0.5 * CORE, saved_bytes_no_recompute=2 * GiB, saved_bytes_full_recompute=GiB // 16,
        output_bytes=GiB // 16, hidden_size=8192, attention_heads=64, kv_heads=8, selective_recompute_flops=CORE,
        saved_bytes_selective=GiB,
    )


LAYERS = [block(i) for i in range(4)]


def training(seq_len: int = 2048, precision: str = "bf16") -> TrainingConfig:
    return TrainingConfig(global_batch=8, seq_len=seq_len, precision=precision)


def compute_s(cluster, profile, *, seq_len: int = 2048, strategy: str = "dp=8,zero=3,mbs=1", precision: str = "bf16"):
    """(forward, backward, recompute) seconds of one micro-batch of the four blocks."""
    s = Strategy.parse(strategy)
    stage = stage_totals(LAYERS, 0, block_policies(LAYERS, s))
    return stage_compute_s(stage, cluster.device, training(seq_len, precision), s, calibration=FLAT, profile=profile)


def hand_s(peak: float, attention_flops_per_s: float) -> tuple[float, float]:
    """(forward, backward) by hand: linears at half of ``peak``, the cores at ``attention_flops_per_s``."""
    linear = 0.5 * peak
    forward = 4 * ((1e13 - CORE) / linear + CORE / attention_flops_per_s)
    backward = 4 * ((2e13 + 0.5 * CORE - BACKWARD_CORE_FLOPS * CORE) / linear + BACKWARD_CORE_FLOPS * CORE / attention_flops_per_s)
    return forward, backward


def test_a100_and_h100_attention_cores_run_at_their_own_published_kernel_rate():
    # FlashAttention-2, causal, head dim 128, 2K tokens: 155 TFLOP/s on A100 (Dao 2023 Fig. 4d), 265 on H100 (Fig. 7),
    # counted on half the s x s product: the measured (full) FLOPs run at twice that.
    for cluster, peak, published in ((A100, 312e12, 155e12), (H100, 989e12, 265e12)):
        assert attention_curve(cluster.device.name, "fa2")[2] == (2048, published)
        forward, backward, _ = compute_s(cluster, TORCHTITAN)
        assert (forward, backward) == pytest.approx(hand_s(peak, published / CAUSAL_WORK))
    a100 = attention_efficiency(A100.device, "bf16", kernels=("fa2",), seq_len=2048)
    h100 = attention_efficiency(H100.device, "bf16", kernels=("fa2",), seq_len=2048)
    assert a100 == pytest.approx(155 / (0.5 * 312)) and h100 == pytest.approx(265 / (0.5 * 989))
    assert a100 > 0.9 > 0.6 > h100  # one constant cannot serve both generations


def test_tesseras_runtime_is_priced_on_the_kernel_torch_chooses():
    """torch 2.13's SDPA puts cuDNN first on Hopper and Blackwell (its bundled cuDNN is past 9.15.0) and runs
    FlashAttention-2 on the A100: Tessera's own plans are priced so, not on FlashAttention-2 everywhere."""
    assert compute_s(H100, TESSERA)[:2] == pytest.approx(hand_s(989e12, 425e12 / CAUSAL_WORK))  # cuDNN, 2K tokens
    assert compute_s(A100, TESSERA)[:2] == pytest.approx(hand_s(312e12, 155e12 / CAUSAL_WORK))  # FlashAttention-2
    b200 = load_cluster("dgx-b200:nodes=1")
    assert compute_s(b200, TESSERA)[:2] == pytest.approx(compute_s(b200, MEGATRON)[:2])
    # its context-parallel ring calls the flash kernel's op itself (runtime.context_parallel): FlashAttention-2
    ring = "dp=4,cp=2,zero=3,mbs=1"
    assert compute_s(H100, TESSERA, seq_len=4096, strategy=ring) == pytest.approx(
        compute_s(H100, TORCHTITAN, seq_len=4096, strategy=ring))
    assert TESSERA.kernels_at(2) == ("fa2",) and MEGATRON.kernels_at(2) == MEGATRON.attention_kernels


def test_b200_attention_runs_at_cudnn_frontends_published_rate():
    """The B200's curves come from cudnn-frontend's SDPA benchmark (cuDNN 9.10.2, flash-attn 2.7.4): forward and
    backward TFLOP/s combined as 3.5 / (1/forward + 2.5/backward), which at 8K tokens are 1197.391 and 939.954 for
    cuDNN; Transformer Engine's kernel there runs 2.85x FlashAttention-2's rate."""
    b200 = load_cluster("dgx-b200:nodes=1").device
    assert curve_at(attention_curve(b200.name, "cudnn"), 8192) == pytest.approx(3.5 / (1 / 1197.391 + 2.5 / 939.954) * 1e12,
                                                                                rel=1e-3)
    cudnn = attention_efficiency(b200, "bf16", kernels=MEGATRON.attention_kernels, seq_len=8192, calibration=FLAT)
    flash = attention_efficiency(b200, "bf16", kernels=TORCHTITAN.attention_kernels, seq_len=8192, calibration=FLAT)
    assert cudnn == pytest.approx(1001 / (0.5 * 2250)) and cudnn > 2.5 * flash
    assert flash == pytest.approx(351 / (0.5 * 2250)) and flash != FALLBACK
    assert curve_at(attention_curve(b200.name, "cudnn"), 512) == 395e12  # its 512 and 1K rows left out: the 2K rate
    # GB200's B200 runs cuDNN 9.17 in its benchmark: 1.389 ms forward and 4.542 ms backward at 8K tokens
    gb200 = curve_at(attention_curve("B200-GB200-NVL72", "cudnn"), 8192)
    assert gb200 == pytest.approx(3.5 * 4 * 8192**2 * 128 * 128 / 2 / ((1.389 + 4.542) * 1e-3), rel=1e-3)


def test_the_framework_decides_the_kernel():
    te_h100 = attention_efficiency(H100.device, "bf16", kernels=MEGATRON.attention_kernels, seq_len=2048)
    assert te_h100 == pytest.approx(425 / (0.5 * 989))  # cuDNN on Hopper (derived from Shah et al. 2024)
    te_a100 = attention_efficiency(A100.device, "bf16", kernels=MEGATRON.attention_kernels, seq_len=2048)
    assert te_a100 == attention_efficiency(A100.device, "bf16", kernels=TORCHTITAN.attention_kernels, seq_len=2048)
    triton = attention_efficiency(A100.device, "bf16", kernels=PYTORCH_FSDP_TE.attention_kernels, seq_len=2048)
    assert triton == pytest.approx(68 / (0.5 * 312))  # Triton FlashAttention at 2K tokens (Dao 2023 Fig. 4d)
    assert compute_s(H100, MEGATRON)[1] < compute_s(H100, TORCHTITAN)[1]


def test_unknown_device_unfused_kernels_and_fp32_fall_back_to_the_calibrated_efficiency():
    nvl = load_cluster("dgx-h100:nodes=1,gpu=H100-NVL-94GB")  # in the catalog, no attention figures
    assert attention_curve("H100-NVL-94GB", "fa2") is None and attention_curve("no-such-gpu", "fa2") is None
    for dev, kernels, precision in ((nvl.device, ("fa2",), "bf16"), (H100.device, (), "bf16"),
                                    (H100.device, ("fa2",), "fp32")):
        assert attention_efficiency(dev, precision, kernels=kernels, seq_len=2048, calibration=FLAT) == FALLBACK
    forward, backward, _ = compute_s(nvl, TESSERA)
    assert (forward, backward) == pytest.approx(hand_s(835.5e12, FALLBACK * 835.5e12))
    forward, backward, _ = compute_s(H100, MEGATRON_2021)
    assert (forward, backward) == pytest.approx(hand_s(989e12, FALLBACK * 989e12))


def test_rate_follows_the_sequence_length_and_is_flat_beyond_the_published_points():
    curve = attention_curve("A100-SXM-80GB", "fa2")
    assert curve_at(curve, 2048) == 155e12 and curve_at(curve, 256) == 99e12 and curve_at(curve, 131072) == 189e12
    assert curve_at(curve, 2896) == pytest.approx((155e12 + 173e12) / 2, rel=1e-3)  # half-way in log2(seq)
    short, long = compute_s(A100, TESSERA, seq_len=512), compute_s(A100, TESSERA, seq_len=8192)
    assert short[0] > long[0]
    # under context parallelism each rank's kernel runs its share of the sequence
    cp = compute_s(A100, TESSERA, seq_len=8192, strategy="dp=4,cp=2,zero=3,mbs=1")
    assert cp[0] == pytest.approx(compute_s(A100, TESSERA, seq_len=4096)[0] / 2)


def test_a_context_parallel_ring_runs_its_attention_cores_slower_by_the_fitted_factor():
    ring = replace(FLAT, cp_attention_slowdown=1.5)
    s = Strategy.parse("dp=4,cp=2,zero=3,mbs=1")
    stage = stage_totals(LAYERS, 0, block_policies(LAYERS, s))
    forward, backward, _ = stage_compute_s(stage, A100.device, training(8192), s, calibration=ring, profile=TESSERA)
    hand_forward, hand_backward = hand_s(312e12, 173e12 / CAUSAL_WORK / 1.5)  # the 4K-token kernel rate, slowed
    assert (forward, backward) == pytest.approx((hand_forward / 2, hand_backward / 2))  # each rank: half the work
    unsplit = Strategy.parse("dp=8,zero=3,mbs=1")  # no ring: the factor does not apply
    whole = stage_totals(LAYERS, 0, block_policies(LAYERS, unsplit))
    assert stage_compute_s(whole, A100.device, training(), unsplit, calibration=ring) == \
        stage_compute_s(whole, A100.device, training(), unsplit, calibration=FLAT)
    cpu = load_cluster("cpu:ranks=2")  # CPU ranks keep their own calibration
    assert stage_compute_s(stage, cpu.device, training(8192), s, calibration=ring) == \
        stage_compute_s(stage, cpu.device, training(8192), s, calibration=FLAT)
    # Transformer Engine's ring runs at the unsplit kernel's rate (profiles.cp_ring_slowdown): Megatron's is priced
    # alike under either calibration, as a slowed ring is with the factor at 1
    te_ring = [stage_compute_s(stage, A100.device, training(8192), s, calibration=c, profile=MEGATRON)
               for c in (ring, FLAT)]
    assert te_ring[0] == te_ring[1]
    assert te_ring[0] == pytest.approx(stage_compute_s(stage, A100.device, training(8192), s, calibration=FLAT,
                                                       profile=replace(MEGATRON, cp_ring_slowdown=True)))


def test_selective_recompute_reruns_the_cores_at_the_kernel_rate():
    _, _, recompute = compute_s(A100, TESSERA, strategy="dp=8,zero=3,mbs=1,recompute=selective")
    assert recompute == pytest.approx(4 * CORE / (155e12 / CAUSAL_WORK))


def test_lower_bound_holds_for_every_framework():
    ring = replace(FLAT, cp_attention_slowdown=1.5)
    fused_savings = [layer.model_copy(update={"fused_gate_saving_bytes": 2**28, "declared_norm_saving_bytes": 2**27,
                                              "fused_norm_saving_bytes": 2**27}) for layer in LAYERS]
    for (spec, plain), layers, traffic in itertools.product(
            (("dp=8,zero=3,mbs=1", FLAT), ("dp=4,cp=2,zero=3,mbs=1", ring)), (LAYERS, fused_savings), (0.0, 4.0)):
        calibration = replace(plain, traffic_factor=traffic)  # with elementwise time, the fused kernels' savings count
        s = Strategy.parse(spec)
        whole = stage_totals(layers, 0, block_policies(layers, s))
        for cluster in (A100, H100):
            for profile in (TESSERA, MEGATRON, MEGATRON_2021, PYTORCH_FSDP_TE):
                bound = compute_lower_bound_s(whole, cluster.device, training(), s, calibration=calibration,
                                              profile=profile)
                times = stage_compute_s(whole, cluster.device, training(), s, calibration=calibration, profile=profile)
                assert bound <= sum(times)


def test_estimate_prices_a_published_run_as_its_framework():
    t, s = training(), Strategy.parse("dp=8,zero=3,mbs=1")
    te, sdpa = (estimate(LAYERS, H100, t, s, calibration=FLAT, profile=p).compute_time_s for p in (MEGATRON, TORCHTITAN))
    assert te < sdpa  # cuDNN against the FlashAttention-2 torchtitan's runs pinned


def test_catalog_attention_figures_are_checked():
    with pytest.raises(ClusterSpecError, match="unknown kernel 'fa9'; known: fa2"):
        attention_curves_from_raw({"fa9": {2048: 100}}, where="x")
    with pytest.raises(ClusterSpecError, match="sequence length '2k' must be a positive integer"):
        attention_curves_from_raw({"fa2": {"2k": 100}}, where="x")
    with pytest.raises(ClusterSpecError, match="fa2.2048"):
        attention_curves_from_raw({"fa2": {2048: -1}}, where="x")
    assert device("A100-SXM-80GB").name == "A100-SXM-80GB"  # the catalog-only fields do not reach DeviceSpec


def test_a_part_priced_from_a_siblings_figures_scales_them():
    """torchtitan's 500 W H100 has no attention benchmark of its own: the catalog scales the H100 SXM's figures by
    its peak over the SXM's (``attention_scale``)."""
    sxm, capped = attention_curve("H100-SXM-80GB", "fa2"), attention_curve("H100-SXM-96GB-500W", "fa2")
    assert [seq for seq, _ in capped] == [seq for seq, _ in sxm]
    assert all(rate == pytest.approx(full * 912.25 / 989, rel=1e-4) for (_, rate), (_, full) in zip(capped, sxm))
    assert device("H100-SXM-96GB-500W").peak_flops("bf16") == pytest.approx(912.25e12)


def test_blackwell_ultra_attention_runs_at_cudnn_frontends_gb300_rate():
    """GB300's curves come from the same cudnn-frontend run as GB200's (cuDNN 9.17): 1.158 ms forward and 4.256 ms
    backward at 8K tokens; the HGX B300, which no benchmark times, takes them at its bf16 peak over the GB300's."""
    gb300 = curve_at(attention_curve("B300-GB300-NVL72", "cudnn"), 8192)
    assert gb300 == pytest.approx(3.5 * 4 * 8192**2 * 128 * 128 / 2 / ((1.158 + 4.256) * 1e-3), rel=1e-3)
    assert gb300 > curve_at(attention_curve("B200-GB200-NVL72", "cudnn"), 8192)  # the same cuDNN, 1.10x at one peak
    hgx = attention_curve("B300-SXM-288GB", "cudnn")
    assert all(rate == pytest.approx(full * 2250 / 2500) for (_, rate), (_, full) in
               zip(hgx, attention_curve("B300-GB300-NVL72", "cudnn")))
    assert device("B300-SXM-288GB").peak_flops("fp8") == 4500e12 and device("B300-GB300-NVL72").peak_flops("fp8") == 5000e12


def test_an_estimate_says_when_no_published_kernel_rate_prices_its_attention():
    """On a part the catalog has no attention figure for (the H100 NVL), the estimate's notes say the calibrated fallback
    prices the attention; on an H100 running cuDNN they say nothing of it."""
    t, s = training(), Strategy.parse("dp=8,zero=3,mbs=1")
    nvl = estimate(LAYERS, load_cluster("dgx-h100:nodes=1,gpu=H100-NVL-94GB"), t, s, calibration=FLAT, profile=TESSERA)
    assert any(note.startswith("attention: no published rate of cudnn/fa2 in bf16 on H100-NVL-94GB") and
               "40% of the bf16 peak" in note for note in nvl.notes)
    for blackwell in ("dgx-b200:nodes=1", "dgx-b200:nodes=1,gpu=B200-GB200-NVL72"):
        b200 = estimate(LAYERS, load_cluster(blackwell), t, s, calibration=FLAT, profile=TESSERA)
        assert not any(note.startswith("attention:") for note in b200.notes)
    h100 = estimate(LAYERS, H100, t, s, calibration=FLAT, profile=TESSERA)
    assert not any(note.startswith("attention:") for note in h100.notes)
    fp32 = estimate(LAYERS, H100, TrainingConfig(global_batch=64, seq_len=2048, precision="fp32"), s, calibration=FLAT)
    assert any("no published rate of cudnn/fa2 in fp32 on H100-SXM-80GB" in note for note in fp32.notes)  # as priced
    unfused = estimate(LAYERS, A100, t, s, calibration=FLAT, profile=MEGATRON_2021)
    assert any("attention: it runs unfused on A100-SXM-80GB" in note for note in unfused.notes)
    ring, split = replace(FLAT, cp_attention_slowdown=1.5), Strategy.parse("dp=4,cp=2,zero=3,mbs=1")
    assert any("context-parallel ring of 2, its cores are priced 1.5x slower than unsplit" in note
               for note in estimate(LAYERS, H100, t, split, calibration=ring).notes)
    assert not any("context-parallel ring" in note for note in estimate(LAYERS, H100, t, split, calibration=FLAT).notes)
    assert not any("context-parallel ring" in note  # Transformer Engine's ring is not slowed: nothing to say
                   for note in estimate(LAYERS, H100, t, split, calibration=ring, profile=MEGATRON).notes)


@pytest.mark.parametrize("entry, message", [
    ({"name": "x", "attention_scale": 0.9}, "scales attention_tflops, which the entry does not give"),
    ({"name": "x", "attention_tflops": {"fa2": {2048: 100}}, "attention_scale": 9}, "is 9; a factor on a sibling"),
    ({"name": "x", "attention_tflops": {"fa2": {2048: 100}}, "attention_scale": -1}, "attention_scale"),
])
def test_a_bad_attention_scale_is_one_line(monkeypatch, entry, message):
    from tessera.topology import hardware

    monkeypatch.setattr(hardware, "_entries", lambda: [entry])
    hardware._attention_catalog.cache_clear()
    try:
        with pytest.raises(ClusterSpecError, match=message):
            hardware._attention_catalog()
    finally:
        hardware._attention_catalog.cache_clear()
