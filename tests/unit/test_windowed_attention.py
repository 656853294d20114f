"""Sliding-window attention priced by what the kernel computes (``planner.layer_info``): a windowed kernel
(FlashAttention's ``window_size``, flex attention) computes ``s w - w^2 / 2`` of causal attention's ``s^2 / 2``
query-key pairs; a dense mask (SDPA, eager) computes them all."""

from __future__ import annotations

import pytest

from tessera.cost_models.layer_stats import LayerStats
from tessera.planner import layer_info


def block(window: int) -> LayerStats:
    return LayerStats(fqn="blocks.0", kind="block", signature="b", param_count=1000, forward_flops=10e12,
                      backward_flops=20e12, selective_recompute_flops=4e12, block_kind="local-attention",
                      attention_window=window, saved_bytes_no_recompute=2**30, saved_bytes_full_recompute=2**20,
                      output_bytes=2**20)


@pytest.mark.parametrize(("seq_len", "window", "share"), [
    (32768, 1024, (32768 * 1024 - 1024**2 / 2) / (32768**2 / 2)),  # Gemma 3 at 32K: about 6%
    (4096, 4096, 1.0), (4096, 8192, 1.0), (4096, 0, 1.0),  # a window covering the sequence is global attention
])
def test_window_pair_share(seq_len, window, share):
    assert layer_info.window_pair_share(seq_len, window) == pytest.approx(share)


def test_a_windowed_block_loses_its_cores_pairs_outside_the_window_and_nothing_else():
    local = layer_info.with_windowed_attention(block(1024), seq_len=32768)
    cut = 4e12 * (1 - layer_info.window_pair_share(32768, 1024))
    assert local.selective_recompute_flops == pytest.approx(4e12 - cut)
    assert local.forward_flops == pytest.approx(10e12 - cut)
    assert local.backward_flops == pytest.approx(20e12 - 2.5 * cut)  # flash backward: 5 matmuls to the forward's 2
    assert (local.saved_bytes_no_recompute, local.param_count) == (block(1024).saved_bytes_no_recompute, 1000)
    assert layer_info.with_windowed_attention(block(0), seq_len=32768) == block(0)  # global: unchanged


def test_only_kernels_that_skip_masked_pairs_are_windowed():
    config = type("Config", (), {})
    for implementation, windowed in [("flash_attention_2", True), ("flex_attention", True), ("sdpa", False),
                                     ("eager", False), (None, False)]:
        config._attn_implementation = implementation
        assert layer_info.windowed_kernel(config) is windowed, implementation
