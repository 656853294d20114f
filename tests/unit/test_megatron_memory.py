"""Megatron-Core's model state per parameter as its documentation tabulates it (Megatron-LM ``core_v0.14.0``,
``docs/source/api-guide/dist_optimizer.md``: bf16 parameters with fp32 gradients hold 18 bytes a parameter without
the distributed optimizer and 6 + 12/d with it): its contiguous gradient buffer, its bf16 weights beside the fp32
masters and its fused Adam (``profiles.contiguous_grad_buffer``, ``fused_optimizer``), not DDP's buckets and
``foreach`` AdamW's temporaries of Tessera's runtime."""

from __future__ import annotations

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.profiles import MEGATRON, TESSERA
from tessera.topology import load_cluster

PARAMS = 4 * 10**9


def state_bytes_per_param(strategy: str, profile=MEGATRON) -> float:
    """Model state (all but activations and the reserve) at the step's peak, per parameter, for a model whose
    activations are negligible."""
    blocks = [LayerStats(fqn=f"blocks.{i}", kind="block", signature="b", param_count=PARAMS // 4, forward_flops=1e12,
                         backward_flops=2e12, saved_bytes_no_recompute=1, saved_bytes_full_recompute=1, output_bytes=1,
                         hidden_size=4096, attention_heads=32, kv_heads=8) for i in range(4)]
    memory = estimate(blocks, load_cluster("dgx-b200:nodes=1"), TrainingConfig(global_batch=64, seq_len=4096),
                      Strategy.parse(strategy), profile=profile).memory_by_category_bytes
    return sum(memory[k] for k in ("parameters", "gradients", "optimizer", "buffers")) / PARAMS


def test_megatron_model_state_is_its_documented_bytes_per_parameter():
    assert state_bytes_per_param("dp=8,zero=0,mbs=1") == pytest.approx(18, abs=0.01)
    assert state_bytes_per_param("dp=8,zero=1,mbs=1") == pytest.approx(6 + 12 / 8, abs=0.01)
    # Tessera's runtime: DDP's buckets and foreach AdamW's temporary at the step's end, fp32 weights under autocast
    assert state_bytes_per_param("dp=8,zero=0,mbs=1", profile=TESSERA) == pytest.approx(4 + 4 + 8 + 4 + 4, abs=0.01)
