"""The reliability cost model (cost_models/reliability.py): checkpoint cost, Young/Daly interval, time lost."""

import math

import pytest

from tessera.cost_models.reliability import (
    CHECKPOINT_BYTES_PER_PARAM, blocking_time_s, checkpoint_cost, expected_waste_fraction, job_mtbf_s,
    optimal_interval_s, reliability_estimate, young_interval_s, SNAPSHOT_COPY_PASSES, SNAPSHOT_KEEP, SWAP_COPY_PASSES,
    SnapshotWork, _duration, host_snapshot_rate, snapshot_cost, snapshot_estimate,
)

HOUR = 3600.0


def test_young_interval_is_the_square_root_of_twice_cost_times_mtbf():
    # Young (1974): a 60 s checkpoint and a 24 h MTBF give sqrt(2 * 60 * 86400) = 3220 s.
    assert young_interval_s(60, 24 * HOUR) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert young_interval_s(60, 24 * HOUR) == pytest.approx(3219.9, abs=0.1)


def test_daly_interval_adds_higher_order_terms_and_caps_at_the_mtbf():
    delta, mtbf = 60.0, 24 * HOUR
    ratio = delta / (2 * mtbf)
    expected = math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta  # Daly eq. 37
    assert optimal_interval_s(delta, mtbf) == pytest.approx(expected)
    assert optimal_interval_s(delta, mtbf) < young_interval_s(delta, mtbf)  # -delta outweighs the small terms
    assert optimal_interval_s(5 * HOUR, 2 * HOUR) == 2 * HOUR  # delta >= 2M: checkpoint once per MTBF
    with pytest.raises(ValueError, match="checkpoint every step"):
        optimal_interval_s(0.0, HOUR)


def test_the_optimal_interval_minimises_the_expected_waste():
    delta, restart, mtbf = 120.0, 600.0, 6 * HOUR

    def waste(tau: float) -> float:
        return sum(expected_waste_fraction(tau, blocking_s=delta, restart_s=restart, mtbf_s=mtbf))

    best = optimal_interval_s(delta, mtbf)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert waste(best) < waste(best * factor)


def test_waste_terms_follow_the_first_order_model():
    checkpoint, failures = expected_waste_fraction(900, blocking_s=100, restart_s=300, mtbf_s=10_000)
    assert checkpoint == pytest.approx(100 / 1000)
    assert failures == pytest.approx((300 + 1000 / 2) / 10_000)


def test_checkpoint_cost_is_twelve_bytes_per_parameter_written_by_every_device():
    # 70B parameters: 840 GB; 1024 devices writing 1 GB/s each take 0.82 s, a 500 GB/s file system 1.68 s.
    cost = checkpoint_cost(70_000_000_000, num_devices=1024, write_bytes_per_s_per_device=1e9)
    assert cost.total_bytes == 70e9 * CHECKPOINT_BYTES_PER_PARAM
    assert cost.write_time_s == pytest.approx(840e9 / 1024e9)
    capped = checkpoint_cost(70_000_000_000, num_devices=1024, write_bytes_per_s_per_device=1e9,
                             aggregate_write_bytes_per_s=500e9)
    assert capped.write_time_s == pytest.approx(840e9 / 500e9)


def test_async_saves_block_only_for_staging_unless_the_interval_cannot_hide_the_write():
    cost = checkpoint_cost(1_000_000_000, num_devices=8, write_bytes_per_s_per_device=0.1e9, asynchronous=True,
                           staging_bytes_per_s=10e9)  # 12 GB: write 15 s, staging 0.15 s
    assert blocking_time_s(cost, interval_s=60) == pytest.approx(cost.staging_time_s)
    assert blocking_time_s(cost, interval_s=10) == pytest.approx(cost.write_time_s - 10)
    sync = cost.model_copy(update={"asynchronous": False})
    assert blocking_time_s(sync, interval_s=60) == cost.write_time_s


def test_async_checkpointing_loses_less_time_than_sync_at_the_same_mtbf():
    common = dict(num_devices=1024, write_bytes_per_s_per_device=0.12e9)
    sync = reliability_estimate(checkpoint_cost(70_000_000_000, **common), mtbf_s=3 * HOUR)
    asynchronous = reliability_estimate(checkpoint_cost(70_000_000_000, asynchronous=True, **common), mtbf_s=3 * HOUR)
    assert asynchronous.waste_fraction < sync.waste_fraction
    assert sync.interval_s == sync.optimal_interval_s  # default interval: the optimum
    assert asynchronous.interval_s >= asynchronous.checkpoint.write_time_s  # writes never queue at the optimum


def test_job_mtbf_from_llama3_failure_rate():
    # Llama 3 (arXiv 2407.21783, Sec. 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. a
    # job MTBF of ~3.1 h and a per-GPU MTBF of ~50,700 h.
    per_gpu = 54 * 24 * HOUR * 16384 / 419
    assert job_mtbf_s(per_gpu, 16384) / HOUR == pytest.approx(54 * 24 / 419)


def test_summary_names_the_interval_in_minutes_and_steps():
    estimate = reliability_estimate(checkpoint_cost(8_000_000_000, num_devices=64, write_bytes_per_s_per_device=1e9),
                                    mtbf_s=12 * HOUR, interval_s=1800, restart_s=300)
    text = estimate.summary(step_time_s=2.0)
    assert "every 30.0 min (900 steps)" in text and "Young/Daly optimum" in text and "MTBF 12.0 h" in text
    assert estimate.restart_s == 300 and 0 < estimate.waste_fraction < 1


# ------------------------------------------------------------------------------------------------ snapshots


def _disk(mtbf_s: float = 3 * HOUR):
    cost = checkpoint_cost(70_000_000_000, num_devices=1024, write_bytes_per_s_per_device=0.12e9)
    return reliability_estimate(cost, mtbf_s=mtbf_s, restart_s=cost.write_time_s + 300)


def test_snapshot_cost_holds_own_and_buddy_shards_keep_plus_one_times_and_a_staging_copy():
    cost = snapshot_cost(1_000_000_000, num_devices=16, devices_per_node=8, staging_bytes_per_s=10e9,
                         network_bytes_per_s_per_node=50e9)
    node = 12e9 / 16 * 8  # 6 GB of the 12 GB of fp32 parameters and AdamW moments
    assert cost.node_bytes == pytest.approx(node)
    assert cost.host_bytes_per_node == pytest.approx((SNAPSHOT_KEEP + 1) * 2 * node + node)
    assert cost.staging_time_s == pytest.approx(12e9 / 16 / 10e9) and cost.replicate_time_s == pytest.approx(node / 50e9)
    alone = snapshot_cost(1_000_000_000, num_devices=8, devices_per_node=8)
    assert not alone.has_buddy and alone.replicate_time_s == 0


def test_snapshots_lose_less_per_failure_than_disk_alone_and_k_minimises_the_waste():
    disk = _disk()
    snapshot = snapshot_cost(70_000_000_000, num_devices=1024, devices_per_node=8)
    best = snapshot_estimate(snapshot, disk, step_time_s=5.0, num_nodes=128, relaunch_s=300)
    assert best.lost_per_failure_s < best.disk_only_lost_per_failure_s
    assert best.waste_fraction < disk.waste_fraction
    for k in (1, 2 * best.every_steps + 5, 200):
        other = snapshot_estimate(snapshot, disk, step_time_s=5.0, num_nodes=128, relaunch_s=300, every_steps=k)
        assert other.waste_fraction >= best.waste_fraction and other.every_steps == k
    assert best.disk_second_line.interval_s > disk.interval_s  # disk only for failures that also take the buddy
    assert 0 < best.buddy_loss_probability < 1e-3
    text = best.summary()
    assert f"every {best.every_steps} step(s)" in text and "host RAM per node" in text and "second line" in text


def test_correlated_failures_and_a_single_node_send_failures_back_to_disk():
    disk = _disk()
    snapshot = snapshot_cost(70_000_000_000, num_devices=1024, devices_per_node=8)
    correlated = snapshot_estimate(snapshot, disk, step_time_s=5.0, num_nodes=128, correlated_fraction=0.5)
    assert correlated.buddy_loss_probability == pytest.approx(0.5, abs=1e-3)
    alone = snapshot_estimate(snapshot_cost(8_000_000_000, num_devices=8, devices_per_node=8), disk,
                              step_time_s=1.0, num_nodes=1)
    assert alone.buddy_loss_probability == 1 and "no buddy" in alone.summary()
    with pytest.raises(ValueError, match="correlated_fraction"):
        snapshot_estimate(snapshot, disk, step_time_s=5.0, num_nodes=128, correlated_fraction=1.5)


def test_on_cpu_ranks_training_pays_the_whole_snapshot_work_and_k_grows_with_it():
    from tessera.topology import load_cluster

    cpu = load_cluster("cpu").device
    profiled = cpu.model_copy(update={"snapshot_fixed_s": 0.003, "snapshot_bytes_per_s": 1e9,
                                      "snapshot_swap_bytes_per_s": 0.5e9})
    assert host_snapshot_rate(profiled) == SnapshotWork(0.003, 1e9, 0.5e9)
    bound = cpu.memory_bandwidth_bytes_per_s
    assert host_snapshot_rate(cpu) == SnapshotWork(0.0, bound / SNAPSHOT_COPY_PASSES, bound / SWAP_COPY_PASSES)
    assert host_snapshot_rate(load_cluster("dgx-h100:nodes=2").device) is None  # a GPU's host cores are free
    rate, per_rank = host_snapshot_rate(profiled), 12 * 5e6 / 4
    cost = snapshot_cost(5_000_000, num_devices=4, devices_per_node=2, host_rate=rate)
    assert cost.host_work_s == pytest.approx(0.003 + per_rank / 1e9 + per_rank / 0.5e9)
    assert cost.training_pays_s(0.1) == cost.host_work_s and cost.staging_time_s == 0  # no device-to-host copy
    one_node = snapshot_cost(5_000_000, num_devices=4, devices_per_node=4, host_rate=rate)
    assert one_node.host_work_s == pytest.approx(0.003 + per_rank / 1e9)  # no buddy: no swap
    gpu = snapshot_cost(5_000_000, num_devices=4, devices_per_node=2)
    assert gpu.host_work_s == 0 and gpu.training_pays_s() == gpu.staging_time_s > 0
    disk = reliability_estimate(checkpoint_cost(5_000_000, num_devices=4, write_bytes_per_s_per_device=1e9),
                                mtbf_s=2 * HOUR)
    on_cpu = snapshot_estimate(cost, disk, step_time_s=0.6, num_nodes=2)
    on_gpu = snapshot_estimate(gpu, disk, step_time_s=0.6, num_nodes=2)
    assert on_cpu.blocking_s == pytest.approx(cost.host_work_s) and on_cpu.every_steps > on_gpu.every_steps
    assert "training runs on the host's cores" in on_cpu.summary() and "copy to host" in on_gpu.summary()
    assert _duration(3600) == "60.0 min" and _duration(3 * 3600) == "3.0 h"  # the second line: "every 0.0 h" said nothing
    with pytest.raises(ValueError, match="must be positive"):
        snapshot_cost(5_000_000, num_devices=4, devices_per_node=2, host_rate=SnapshotWork(0.0, 0.0, None))
