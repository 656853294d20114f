"""A part's measured GEMM efficiency relative to the H100's scales the fitted matmul curve (``catalog.yaml``
``matmul_scale``, ``cost_models.compute.device_calibration``)."""

import pytest

from tessera.cost_models.compute import GPU_CALIBRATION, achievable_flops, device_calibration
from tessera.errors import ClusterSpecError
from tessera.topology.hardware import device, local_cpu_device, matmul_scale


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_b200_reaches_its_measured_share_of_the_h100s_efficiency(precision):
    b200, h100 = device("B200-SXM-180GB"), device("H100-SXM-80GB")
    assert matmul_scale(b200.name) == 0.80 and matmul_scale(h100.name) == 1.0
    curve = GPU_CALIBRATION.at if precision == "bf16" else GPU_CALIBRATION.fp8_at
    assert achievable_flops(h100, "bf16", width=4096) == pytest.approx(989e12 * GPU_CALIBRATION.at(4096))
    rate = (achievable_flops(b200, "bf16", width=4096) if precision == "bf16"
            else b200.peak_flops("fp8") * device_calibration(b200).fp8_at(4096))
    assert rate == pytest.approx(0.80 * b200.peak_flops(precision) * curve(4096))


def test_parts_without_a_measurement_and_the_cpu_keep_their_constants():
    assert device_calibration(device("A100-SXM-80GB")) == GPU_CALIBRATION  # no shared-shape benchmark beside the H100
    assert matmul_scale("B200-GB200-NVL72") == 0.80  # the GB200's B200 takes the SXM B200's (its source says why)
    assert device_calibration(local_cpu_device(2)).peak_fraction == 1.0
    assert matmul_scale("my-own-accelerator") == 1.0


@pytest.mark.parametrize("entry, message", [
    ({"name": "x", "matmul_scale": 3, "matmul_source": "a benchmark"}, "must be at most 2"),
    ({"name": "x", "matmul_scale": 0.9}, "name its benchmark in 'matmul_source'"),
    ({"name": "x", "matmul_scale": -1, "matmul_source": "a benchmark"}, "matmul_scale"),
    ({"name": "x", "matmul_scale": "fast", "matmul_source": "a benchmark"}, "matmul_scale"),
])
def test_a_bad_matmul_scale_is_one_line(monkeypatch, entry, message):
    from tessera.topology import hardware

    monkeypatch.setattr(hardware, "_entries", lambda: [entry])
    hardware._matmul_scales.cache_clear()
    try:
        with pytest.raises(ClusterSpecError, match=message):
            hardware.matmul_scale("x")
    finally:
        hardware._matmul_scales.cache_clear()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_stages_linears_on_the_b200_take_the_scaled_rate(precision):
    """End to end through ``stage_compute_s``: a block of linears only takes 1/0.80 as long on a B200 as its peak
    alone would say, against the H100, in bf16 and in FP8 alike."""
    from tessera.cost_models import Strategy, TrainingConfig
    from tessera.cost_models.compute import stage_compute_s
    from tessera.cost_models.layer_stats import LayerStats
    from tessera.cost_models.partition import stage_totals
    from tessera.cost_models.profiles import TESSERA

    block = LayerStats(fqn="blocks.0", kind="block", signature="b", param_count=10**9, forward_flops=1e13,
                       backward_flops=2e13, saved_bytes_no_recompute=0, saved_bytes_full_recompute=0, output_bytes=0,
                       hidden_size=4096)
    stage = stage_totals([block], 0, {"blocks.0": "none"})
    training, strategy = TrainingConfig(global_batch=8, seq_len=2048, precision=precision), Strategy.parse("dp=8")
    b200, h100 = (stage_compute_s(stage, device(name), training, strategy, profile=TESSERA)[0]
                  for name in ("B200-SXM-180GB", "H100-SXM-80GB"))
    peaks = device("H100-SXM-80GB").peak_flops(precision) / device("B200-SXM-180GB").peak_flops(precision)
    assert b200 / h100 == pytest.approx(peaks / 0.80)
