"""Megatron-Core's model state per parameter as its documentation tabulates it (Megatron-LM ``core_v0.14.0``,
``docs/source/api-guide/dist_optimizer.md``: bf16 parameters with fp32 gradients hold 18 bytes a parameter without
the distributed optimizer and 6 + 12/d with it): its contiguous gradient buffer, its bf16 weights beside the fp32
masters and its fused Adam (``profiles.contiguous_grad_buffer``, ``fused_optimizer``), not DDP's buckets and
``foreach`` AdamW's temporaries of Tessera's runtime."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.profiles import MEGATRON, NEMO_2024, TESSERA
from tessera.topology import load_cluster

PARAMS = 4 * 10**9


def state_bytes_per_param(strategy: str, profile=MEGATRON, precision: str = "bf16") -> float:
    """Model state (all but activations and the reserve) at the step's peak, per parameter, for a model whose
    activations are negligible."""
    blocks = [LayerStats(fqn=f"blocks.{i}", kind="block", signature="b", param_count=PARAMS // 4, forward_flops=1e12,
                         backward_flops=2e12, saved_bytes_no_recompute=1, saved_bytes_full_recompute=1, output_bytes=1,
                         hidden_size=4096, attention_heads=32, kv_heads=8) for i in range(4)]
    training = TrainingConfig(global_batch=64, seq_len=4096, precision=precision)
    memory = estimate(blocks, load_cluster("dgx-b200:nodes=1"), training, Strategy.parse(strategy),
                      profile=profile).memory_by_category_bytes
    return sum(memory[k] for k in ("parameters", "gradients", "optimizer", "buffers")) / PARAMS


@pytest.mark.parametrize("row, precision, profile, plain, distributed", [
    ("bf16 parameters, fp32 gradients", "bf16", MEGATRON, 18, 6 + 12 / 8),
    ("fp16 parameters, fp16 gradients", "bf16", replace(MEGATRON, gradient_bytes=2), 20, 4 + 16 / 8),
    ("fp32 parameters, fp32 gradients", "fp32", MEGATRON, 16, 8 + 8 / 8),
    ("NeMo's recipes (bf16 gradients)", "bf16", NEMO_2024, 20, 4 + 16 / 8),
])
def test_megatron_model_state_is_its_documented_bytes_per_parameter(row, precision, profile, plain, distributed):
    assert state_bytes_per_param("dp=8,zero=0,mbs=1", profile, precision) == pytest.approx(plain, abs=0.01), row
    assert state_bytes_per_param("dp=8,zero=1,mbs=1", profile, precision) == pytest.approx(distributed, abs=0.01), row


def test_megatrons_gradient_buffer_is_there_before_the_first_backward():
    """One micro-batch a step: the backward's start, not the step's end, is the peak, and Megatron's buffer (allocated
    with the model) is whole there; Tessera's runtime has no gradients yet."""
    big = LayerStats(fqn="blocks.0", kind="block", signature="b", param_count=PARAMS, forward_flops=1e12,
                     backward_flops=2e12, saved_bytes_no_recompute=40 * 2**30, saved_bytes_full_recompute=1,
                     output_bytes=1, hidden_size=4096, attention_heads=32, kv_heads=8)
    training = TrainingConfig(global_batch=8, seq_len=4096)
    peak = {name: estimate([big], load_cluster("dgx-b200:nodes=1"), training, Strategy.parse("dp=8,zero=1,mbs=1"),
                           profile=profile).memory_by_category_bytes for name, profile in (("megatron", MEGATRON),
                                                                                          ("tessera", TESSERA))}
    assert peak["megatron"]["activations"] > 0 and peak["megatron"]["gradients"] == 4 * PARAMS
    assert peak["tessera"]["gradients"] == 0
    # Tessera's runtime: DDP's buckets and foreach AdamW's temporary at the step's end, fp32 weights under autocast
    assert state_bytes_per_param("dp=8,zero=0,mbs=1", profile=TESSERA) == pytest.approx(4 + 4 + 8 + 4 + 4, abs=0.01)
