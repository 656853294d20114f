"""Costs of ranks that share CPU cores: framework overhead per linear, idle pipeline ranks lending their cores,
1F1B with fewer micro-batches than stages, and the profiled device fields that carry them."""

import pytest
import yaml
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.communication import tp_comm_s
from tessera.cost_models.compute import framework_overhead_s, linear_overhead_s, stage_compute_s
from tessera.cost_models.estimate import step_time_lower_bound
from tessera.cost_models.layer_stats import LayerStats, LinearPair
from tessera.cost_models.partition import block_policies, stage_totals
from tessera.cost_models.pipeline import bubble_micro_batches, in_flight_micro_batches, pipeline_time_s
from tessera.runtime.pipeline import single_stage_schedule
from tessera.topology import load_cluster
from tessera.errors import ClusterSpecError
from tessera.topology.hardware import device_from_raw, device_to_raw

MiB = 2**20
PAIRS = (LinearPair(column=("attn.q", "attn.k", "attn.v"), row="attn.o", role="attention"),
         LinearPair(column=("mlp.gate", "mlp.up"), row="mlp.down", role="mlp"))  # 7 linears, a Llama block


def layer(fqn: str, kind: str, *, flops: float = 1e9, pairs: tuple = ()) -> LayerStats:
    return LayerStats(fqn=fqn, kind=kind, signature=kind, param_count=10**6, forward_flops=flops,
                      backward_flops=2 * flops, saved_bytes_no_recompute=4 * MiB, saved_bytes_full_recompute=MiB // 4,
                      output_bytes=MiB // 4, hidden_size=256, attention_heads=8 if kind == "block" else 0,
                      kv_heads=8 if kind == "block" else 0, tp_pairs=pairs)


# A head as costly as two blocks: the last pipeline stage is the slowest.
LAYERS = [layer(f"blocks.{i}", "block", pairs=PAIRS) for i in range(4)] + [layer("head", "head", flops=2e9)]
TRAINING = TrainingConfig(global_batch=16, seq_len=256, precision="fp32")


def cpu_cluster(tmp_path, *, solo_speedup: float = 1.0, overhead_ms: dict | None = None, tp_slowdown: dict | None = None):
    device = {"name": "local-cpu", "peak_tflops": {"fp32": 0.05}, "memory_gb": 6, "memory_bandwidth_gb_per_s": 4,
              "solo_speedup": solo_speedup, "linear_overhead_ms": overhead_ms or {},
              "tp_compute_slowdown": tp_slowdown or {}, "source": "test"}
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({
        "device": device, "devices_per_node": 4, "size_key": "ranks", "size": 4,
        "levels": [{"name": "gloo", "group_size": "node", "bandwidth_gb_per_s": 1, "latency_us": 500, "source": "test"}],
    }))
    return load_cluster(str(path))


def test_profiled_device_fields_round_trip():
    raw = {"name": "local-cpu", "peak_tflops": {"fp32": 0.05}, "memory_gb": 6, "memory_bandwidth_gb_per_s": 4,
           "solo_speedup": 2.0, "linear_overhead_ms": {1: 0.2, 2: 6.0}, "tp_compute_slowdown": {2: 1.3},
           "snapshot_fixed_ms": 3.3, "snapshot_gb_per_s": 0.9, "snapshot_swap_gb_per_s": 0.7, "source": "test"}
    spec = device_from_raw(raw, where="test")
    assert spec.solo_speedup == 2.0 and spec.linear_overhead_s == {1: pytest.approx(2e-4), 2: pytest.approx(6e-3)}
    assert spec.tp_compute_slowdown == {2: 1.3}
    assert spec.snapshot_fixed_s == pytest.approx(3.3e-3) and spec.snapshot_bytes_per_s == pytest.approx(0.9e9)
    assert spec.snapshot_swap_bytes_per_s == pytest.approx(0.7e9)
    assert device_from_raw(device_to_raw(spec), where="again") == spec
    with pytest.raises(ClusterSpecError, match=r"field 'tp_compute_slowdown'.*degree 'two'"):
        device_from_raw({**raw, "tp_compute_slowdown": {"two": 1.3}}, where="test")
    with pytest.raises(ClusterSpecError, match=r"field 'snapshot_gb_per_s'.*positive"):
        device_from_raw({**raw, "snapshot_gb_per_s": 0}, where="test")
    with pytest.raises(ClusterSpecError, match=r"snapshot_fixed_ms and snapshot_gb_per_s go together"):
        device_from_raw({key: value for key, value in raw.items() if key != "snapshot_gb_per_s"}, where="test")


def test_tensor_parallel_slowdown_scales_the_arithmetic_at_its_degree_only(tmp_path):
    plain, slowed = cpu_cluster(tmp_path), cpu_cluster(tmp_path, tp_slowdown={2: 1.5})
    for text, factor in (("dp=2,tp=2,mbs=1", 1.5), ("dp=1,tp=4,mbs=1", 1.5), ("dp=4,mbs=1", 1.0)):
        strategy = Strategy.parse(text)
        stage = stage_totals(LAYERS, 0, block_policies(LAYERS, strategy))
        before = stage_compute_s(stage, plain.device, TRAINING, strategy)
        after = stage_compute_s(stage, slowed.device, TRAINING, strategy)
        assert after == pytest.approx(tuple(factor * part for part in before)), text


def test_catalog_devices_have_no_sharing_and_no_overhead():
    device = load_cluster("dgx-h100:nodes=1").device
    assert device.solo_speedup == 1.0 and linear_overhead_s(device, 8) == 0.0
    assert "solo_speedup" not in device_to_raw(device) and "linear_overhead_ms" not in device_to_raw(device)


def test_overhead_is_linears_times_the_measured_cost_at_the_degree_or_below(tmp_path):
    device = cpu_cluster(tmp_path, overhead_ms={1: 0.5, 2: 4.0}).device
    assert linear_overhead_s(device, 1) == pytest.approx(5e-4)
    assert linear_overhead_s(device, 4) == pytest.approx(4e-3)  # not measured at 4: the largest below
    stage = stage_totals(LAYERS, 0, block_policies(LAYERS, Strategy.parse("dp=2,tp=2")))
    assert stage.linears == 4 * 7 + 1
    forward, backward = framework_overhead_s(stage, device, tp=2)
    assert forward + backward == pytest.approx(29 * 4e-3) and backward == pytest.approx(2 * forward)


def test_overhead_adds_to_compute_once_per_micro_batch(tmp_path):
    plain, measured = cpu_cluster(tmp_path), cpu_cluster(tmp_path, overhead_ms={1: 1.0})
    for mbs, micro_batches in ((1, 4), (4, 1)):
        strategy = Strategy.parse(f"dp=4,zero=0,mbs={mbs}")
        extra = estimate(LAYERS, measured, TRAINING, strategy).step_time_s - estimate(LAYERS, plain, TRAINING, strategy).step_time_s
        assert extra == pytest.approx(micro_batches * 29 * 1e-3)


def test_measured_tensor_parallel_overhead_replaces_the_all_reduce_latency(tmp_path):
    plain, measured = cpu_cluster(tmp_path), cpu_cluster(tmp_path, overhead_ms={2: 4.0})
    strategy = Strategy.parse("dp=2,tp=2,mbs=1")
    stage = stage_totals(LAYERS, 0, block_policies(LAYERS, strategy))
    latency = 2 * stage.tp_allreduce_count * 2 * 500e-6  # 2 passes; an all-reduce over 2 ranks: 2 steps of 500 us
    assert tp_comm_s(stage, plain, TRAINING, strategy) - tp_comm_s(stage, measured, TRAINING, strategy) == pytest.approx(latency)


def test_shared_cores_bound_a_pipeline_by_its_mean_stage(tmp_path):
    strategy = Strategy.parse("dp=1,pp=4,schedule=1f1b,mbs=1")
    times = [1.0, 1.0, 1.0, 2.0]
    assert pipeline_time_s(strategy, micro_batches=16, stage_times_s=times) == (16 + 3) * 2.0
    # Two ranks' worth of cores for four ranks: the work bound, 16 x mean 1.25, beats the chain at double speed.
    assert pipeline_time_s(strategy, micro_batches=16, stage_times_s=times, solo_speedup=2.0) == pytest.approx(20.0)
    assert pipeline_time_s(strategy, micro_batches=2, stage_times_s=times, solo_speedup=2.0) == pytest.approx(5 * 2.0 / 2)


def test_shared_cores_make_pipelines_cheaper_and_the_bound_still_holds(tmp_path):
    dedicated, shared = cpu_cluster(tmp_path), cpu_cluster(tmp_path, solo_speedup=2.0)
    for text in ("dp=1,pp=4,schedule=1f1b,mbs=1", "dp=1,tp=2,pp=2,schedule=interleaved:2,mbs=2", "dp=2,pp=2,zero=1,mbs=2"):
        strategy = Strategy.parse(text)
        alone, sharing = estimate(LAYERS, dedicated, TRAINING, strategy), estimate(LAYERS, shared, TRAINING, strategy)
        assert step_time_lower_bound(LAYERS, shared, TRAINING, strategy) <= sharing.step_time_s * (1 + 1e-9)
        parts = sharing.compute_time_s + sharing.recompute_time_s + sharing.exposed_comm_time_s
        assert parts + sharing.bubble_time_s + sharing.optimizer_time_s == pytest.approx(sharing.step_time_s)
        if strategy.dp == 1:  # no data-parallel traffic to expose
            assert sharing.step_time_s < alone.step_time_s and sharing.bubble_time_s < 0


def test_shared_cores_hide_no_data_parallel_traffic(tmp_path):
    dedicated, shared = cpu_cluster(tmp_path), cpu_cluster(tmp_path, solo_speedup=2.0)
    strategy = Strategy.parse("dp=4,zero=1,mbs=1")
    alone, sharing = estimate(LAYERS, dedicated, TRAINING, strategy), estimate(LAYERS, shared, TRAINING, strategy)
    assert alone.exposed_comm_time_s < sum(alone.comm_time_by_kind_s.values())
    assert sharing.exposed_comm_time_s == pytest.approx(sum(sharing.comm_time_by_kind_s.values()))
    assert sharing.compute_time_s == alone.compute_time_s and sharing.bubble_time_s == 0


def test_measured_fsdp_slowdown_scales_every_zero_stage_and_only_zero(tmp_path):
    plain = cpu_cluster(tmp_path)
    path = tmp_path / "cpu.yaml"
    path.write_text(path.read_text().replace("solo_speedup: 1.0", "solo_speedup: 1.0\n  fsdp_comm_slowdown: 3.0"))
    slowed = load_cluster(str(path))
    assert slowed.device.fsdp_comm_slowdown == 3.0
    for zero in (1, 2, 3):
        strategy = Strategy.parse(f"dp=4,zero={zero},mbs=1")
        base, measured = (estimate(LAYERS, c, TRAINING, strategy).comm_time_by_kind_s for c in (plain, slowed))
        assert measured == {kind: pytest.approx(3 * seconds) for kind, seconds in base.items()}
    ddp = Strategy.parse("dp=4,zero=0,mbs=1")
    assert estimate(LAYERS, slowed, TRAINING, ddp).comm_time_by_kind_s == estimate(LAYERS, plain, TRAINING, ddp).comm_time_by_kind_s


def test_1f1b_with_fewer_micro_batches_than_stages_runs_and_is_charged_as_gpipe():
    strategy = Strategy.parse("dp=2,pp=2,schedule=1f1b,mbs=8")
    assert single_stage_schedule(strategy, micro_batches=1) is ScheduleGPipe
    assert single_stage_schedule(strategy, micro_batches=2) is Schedule1F1B
    assert in_flight_micro_batches(Strategy.parse("dp=1,pp=4,schedule=1f1b"), stage=3, micro_batches=2) == 2
    assert in_flight_micro_batches(Strategy.parse("dp=1,pp=4,schedule=1f1b"), stage=3, micro_batches=4) == 1
    assert bubble_micro_batches(strategy) == 1


def test_zero_bubble_is_planned_without_recomputation_even_when_the_schedule_is_pinned():
    from tessera.planner.space import strategies

    cluster = load_cluster("cpu:ranks=4")
    pinned = list(strategies(LAYERS, cluster, TRAINING, {"schedule": "zero-bubble", "pp": 2}))
    assert pinned and all(s.recompute == "none" for s in pinned)  # the runtime refuses the rest (runtime.apply)
    asked = list(strategies(LAYERS, cluster, TRAINING, {"schedule": "zero-bubble", "pp": 2, "recompute": "full"}))
    assert asked and all(s.recompute == "full" for s in asked)  # asked for by name: the runtime says why not
