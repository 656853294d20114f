"""Attention kernels priced at their rate on the model's heads (``topology.head_dims``)."""

from dataclasses import replace

import pytest

from tessera.cost_models import estimate
from tessera.cost_models.compute import attention_efficiency, compute_lower_bound_s, stage_compute_s
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.layer_sums import attention_head_widths
from tessera.cost_models.partition import block_policies, stage_totals
from tessera.cost_models.profiles import MEGATRON, TESSERA
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.topology import load_cluster
from tessera.topology.head_dims import HeadDims, head_dim_rate, stage_head_rate

H100, A100 = load_cluster("dgx-h100:nodes=1"), load_cluster("dgx-a100:nodes=1")


def heads(width: float) -> HeadDims:
    return HeadDims(width, width)


def test_rates_are_the_figures_medians_and_one_at_the_catalogs_head_dim():
    # cuDNN's forward, causal, on an H100 (FlashAttention-3 paper Fig. 5 b, d): 225/315, 288/410, ... median 0.708
    assert round(head_dim_rate("cudnn", heads(64)), 3) == 0.708
    assert round(head_dim_rate("fa2", heads(64)), 3) == 0.888  # FlashAttention-2 figures, A100 and H100
    for kernel in ("fa2", "fa-triton", "cudnn", "fa3"):
        assert head_dim_rate(kernel, heads(128)) == 1.0
    assert head_dim_rate("cudnn", HeadDims()) == 1.0  # unmeasured: the catalog's 128
    assert head_dim_rate("cudnn", heads(32)) == head_dim_rate("cudnn", heads(64))  # below the figures: flat


def test_between_measured_head_dims_the_rate_is_linear_where_the_kernel_has_a_compiled_size():
    assert abs(head_dim_rate("cudnn", heads(96)) - (head_dim_rate("cudnn", heads(64)) + 1.0) / 2) < 1e-12
    assert abs(head_dim_rate("fa2", heads(96)) - (head_dim_rate("fa2", heads(64)) + 1.0) / 2) < 1e-12


def test_a_kernel_runs_a_head_at_its_next_compiled_size_and_wastes_the_padding():
    # heads of 112: FlashAttention-2 and Triton run their kernels for 128; cuDNN's rounding is unknown
    assert head_dim_rate("fa2", heads(112)) == 112 / 128
    assert head_dim_rate("fa-triton", heads(112)) == 112 / 128
    assert head_dim_rate("fa3", heads(80)) == head_dim_rate("fa3", heads(96)) * 80 / 96
    assert head_dim_rate("cudnn", heads(112)) > head_dim_rate("fa2", heads(112))
    # SDPA's FlashAttention-2 has a kernel for 160 (FlashAttention-3 does not); Triton's stops at 128
    assert head_dim_rate("fa2", heads(160)) > head_dim_rate("fa3", heads(160))
    assert head_dim_rate("fa-triton", heads(160)) == 1.0
    # latent attention (keys of 192, values of 128): run at 192, the values padded; cuDNN takes it as it is
    assert head_dim_rate("fa3", HeadDims(192, 128)) == head_dim_rate("fa3", heads(192)) * (192 + 128) / (2 * 192)
    at_160 = 1.0 + (head_dim_rate("cudnn", heads(256)) - 1.0) / 4  # a quarter of the way from 128 to 256
    assert abs(head_dim_rate("cudnn", HeadDims(192, 128)) - at_160) < 1e-12


def test_a_stage_of_several_widths_runs_at_the_rate_that_adds_up_its_cores_times():
    mixed = ((1e12, heads(96)), (3e12, heads(128)))
    time = 1e12 / head_dim_rate("fa2", heads(96)) + 3e12 / head_dim_rate("fa2", heads(128))
    assert abs(stage_head_rate("fa2", mixed) - 4e12 / time) < 1e-12
    assert stage_head_rate("fa2", ()) == 1.0


def test_attention_efficiency_follows_the_heads():
    at = {width: attention_efficiency(H100.device, "bf16", kernels=("cudnn",), seq_len=4096,
                                      head_widths=((1.0, heads(width)),)) for width in (0, 64, 128)}
    assert at[0] == at[128]
    assert abs(at[64] / at[128] - head_dim_rate("cudnn", heads(64))) < 1e-12


def layer(fqn: str, kv_head_width: int, core_flops: float, query_head_width: int = 0) -> LayerStats:
    return LayerStats(fqn=fqn, kind="block", signature=fqn, param_count=10**8, forward_flops=1e12, backward_flops=2e12,
                      saved_bytes_no_recompute=2**30, saved_bytes_full_recompute=2**20, output_bytes=2**24,
                      hidden_size=2048, attention_heads=32, kv_heads=8, kv_head_width=kv_head_width,
                      query_head_width=query_head_width, selective_recompute_flops=core_flops, saved_bytes_selective=2**29)


def test_a_stages_heads_are_its_cores_flops_by_their_key_and_value_widths():
    # latent attention (keys of 192, values of 128); a layer whose query width is unmeasured splits its width in two;
    # a layer with no width measured: unknown widths
    layers = [layer("a", 192 + 128, 3e11, query_head_width=192), layer("b", 128, 1e11), layer("c", 0, 5e11),
              layer("d", 128, 2e11)]
    widths = attention_head_widths(layers)  # shares of the cores' FLOPs: 3, 1 + 2 and 5 of 11
    assert [dims for _, dims in widths] == [HeadDims(192, 128), HeadDims(64, 64), HeadDims()]
    assert [share * 11 for share, _ in widths] == pytest.approx([3, 3, 5])


def test_the_lower_bound_holds_over_stages_of_different_head_widths():
    # one stage of 96-wide heads, one of 128 (FlashAttention-2 on A100s): no stage is faster than the bound
    narrow = [layer(f"blocks.{i}", 192, 4e11) for i in range(2)]
    wide = [layer(f"blocks.{i}", 256, 4e11) for i in range(2, 4)]
    training, strategy = TrainingConfig(global_batch=8, seq_len=8192), Strategy.parse("dp=4,pp=2,mbs=1")
    est = estimate(narrow + wide, A100, training, strategy, profile=replace(TESSERA, attention_kernels=("fa2",)))
    whole = stage_totals(narrow + wide, 0, block_policies(narrow + wide, strategy))
    bound = compute_lower_bound_s(whole, A100.device, training, strategy)
    slowest = max(stage["forward"] + stage["backward"] + stage["recompute"] for stage in est.stage_time_per_micro_batch_s)
    assert bound <= slowest


def test_narrow_heads_make_the_attention_cores_slower_and_nothing_else():
    training, strategy = TrainingConfig(global_batch=8, seq_len=4096), Strategy.parse("dp=8,mbs=1")
    times = {}
    for width in (128, 256):  # head dims 64 and 128
        layers = [layer(f"blocks.{i}", width, 2e11) for i in range(4)]
        stage = stage_totals(layers, 0, block_policies(layers, strategy))
        times[width] = stage_compute_s(stage, H100.device, training, strategy, profile=MEGATRON)
    rate = attention_efficiency(H100.device, "bf16", kernels=MEGATRON.attention_kernels, seq_len=4096)
    core_s = 4 * 2e11 / (rate * H100.device.peak_flops("bf16"))  # the four cores' forward at head dim 128
    extra = core_s * (1 / head_dim_rate(MEGATRON.attention_kernels[0], heads(64)) - 1)
    assert abs(times[128][0] - times[256][0] - extra) < 1e-9 * times[256][0]


def test_an_estimate_on_heads_other_than_128_wide_says_what_share_of_the_kernel_rate_they_get():
    training, strategy = TrainingConfig(global_batch=8, seq_len=4096), Strategy.parse("dp=8,mbs=1")
    notes = {width: [note for note in estimate([layer(f"blocks.{i}", width, 2e11) for i in range(2)], H100, training,
                                               strategy, profile=MEGATRON).notes if note.startswith("attention: heads")]
             for width in (128, 256)}
    assert notes[256] == []
    assert notes[128] == ["attention: heads 64 wide run cudnn at 0.71 of its rate at 128 (the kernel papers' A100 and "
                          "H100 figures; topology/head_dims.py)"]
