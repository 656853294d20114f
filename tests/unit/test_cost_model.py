"""The data-parallel cost model on hand-made LayerStats, checked against arithmetic done by hand."""

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import GPU_MATMUL_EFFICIENCY, achievable_flops
from tessera.cost_models.types import LayerStats
from tessera.errors import ConfigError, NotModelledError
from tessera.topology import load_cluster

GiB = 2**30


def block(i: int, *, params: int = 10**9, flops: float = 1e13, saved: int = 2 * GiB) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="b", param_count=params, forward_flops=flops,
        backward_flops=2 * flops, saved_bytes_no_recompute=saved, saved_bytes_full_recompute=saved // 32,
        output_bytes=saved // 32,
    )


LAYERS = [block(i) for i in range(4)]
H100_NODE = load_cluster("dgx-h100:nodes=1")
TRAINING = TrainingConfig(global_batch=16, seq_len=4096)


def test_compute_time_is_flops_over_achievable_rate():
    e = estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=2))
    rate = achievable_flops(H100_NODE.device, "bf16")
    assert e.compute_time_s == pytest.approx(4 * 3e13 * 2 / rate)  # 2 sequences per rank, 1 micro-batch
    assert e.recompute_time_s == 0


def test_full_recompute_adds_one_forward_and_saves_memory():
    plain = estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=2))
    full = estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=2, recompute="full"))
    assert full.recompute_time_s == pytest.approx(plain.compute_time_s / 3)
    assert full.memory_by_category_bytes["activations"] < plain.memory_by_category_bytes["activations"] / 2


def test_fsdp_shards_the_model_state_ddp_replicates_it():
    layers = [block(i, params=2 * 10**9) for i in range(4)]
    ddp = estimate(layers, H100_NODE, TRAINING, Strategy(dp=8, zero=0, micro_batch=2))
    fsdp = estimate(layers, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=2))
    # 8e9 params: DDP holds 16 bytes/param (fp32 params, grads, two Adam moments; 128 GB, over 80 GiB),
    # FSDP an eighth of it.
    assert ddp.memory_by_category_bytes["optimizer"] == 8 * 10**9 * 8
    state = ("parameters", "gradients", "optimizer")
    assert sum(fsdp.memory_by_category_bytes[k] for k in state) == pytest.approx(
        sum(ddp.memory_by_category_bytes[k] for k in state) / 8, rel=1e-9
    )
    assert not ddp.fits and fsdp.fits
    assert set(fsdp.comm_time_by_kind_s) == {"fsdp_allgather", "fsdp_reducescatter"}
    assert set(ddp.comm_time_by_kind_s) == {"dp_allreduce"}


def test_micro_batches_repeat_compute_and_fsdp_gathers():
    one = estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=2))
    two = estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=1))
    assert two.compute_time_s == pytest.approx(one.compute_time_s)
    assert two.comm_time_by_kind_s["fsdp_allgather"] == pytest.approx(2 * one.comm_time_by_kind_s["fsdp_allgather"])
    assert two.memory_by_category_bytes["activations"] == one.memory_by_category_bytes["activations"] // 2


def test_mfu_and_throughput_are_consistent():
    e = estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=8, zero=3, micro_batch=2))
    assert e.tokens_per_s == pytest.approx(16 * 4096 / e.step_time_s)
    assert e.mfu == pytest.approx(e.model_flops_per_step / (e.step_time_s * 8 * 989e12))
    assert 0 < e.mfu < GPU_MATMUL_EFFICIENCY  # never above the compute efficiency the model assumes


def test_unmodelled_axes_and_wrong_world_are_refused():
    with pytest.raises(NotModelledError, match="tp=2"):
        estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=4, tp=2))
    with pytest.raises(ConfigError, match="set dp=8"):
        estimate(LAYERS, H100_NODE, TRAINING, Strategy(dp=4))
    with pytest.raises(ConfigError, match="not divisible"):
        estimate(LAYERS, H100_NODE, TrainingConfig(global_batch=12, seq_len=8), Strategy(dp=8))


def test_strategy_string_round_trip_and_errors():
    s = Strategy.parse("dp=4,zero=3,mbs=2,recompute=full")
    assert (s.dp, s.zero, s.micro_batch, s.recompute) == (4, 3, 2, "full")
    assert Strategy.parse(s.to_string()) == s
    with pytest.raises(ConfigError, match="bad strategy item 'tensor=2'"):
        Strategy.parse("tensor=2")
    with pytest.raises(ConfigError, match="zero"):
        Strategy.parse("zero=7")
