"""``profile_world`` inside a live gloo job and ``tessera profile`` from the command line: both write a
cluster file that ``load_cluster`` reads back as the measured CPU with fitted link parameters."""

import time

import pytest
import torch.distributed as dist

from tessera.cli import main
from tessera.topology import load_cluster
from tessera.topology.collectives import all_reduce_time
from tessera.topology.profiler import ProfileSweep, load_profile, profile_world
from tessera.runtime.launch import spawn

pytestmark = pytest.mark.distributed


def _profile_quick(out: str) -> tuple[int, float, float]:
    result = profile_world(sweep=ProfileSweep.quick(), out=out, progress=False)
    return dist.get_rank(), result.elapsed_s, result.cluster.levels[0].bandwidth_bytes_per_s


def test_profile_world_on_two_gloo_ranks_round_trips_through_load_cluster(tmp_path):
    out = tmp_path / "cluster.yaml"
    results = spawn(_profile_quick, nprocs=2, args=(str(out),), timeout_s=120)
    assert [rank for rank, _, _ in results] == [0, 1]
    assert results[0][1] < 30  # the reduced sweep, inside the ranks (process start-up excluded)
    assert results[0][2] == results[1][2]  # every rank fitted the same numbers

    cluster = load_cluster(out)
    assert cluster.num_devices == 2 and cluster.device.name == "local-cpu"
    assert "measured by tessera profile" in cluster.device.source
    assert 1e8 < cluster.device.peak_flops("fp32") < 1e13  # a CPU core's matmul rate, measured
    assert 1e6 < cluster.device.peak_flops("fp8") < 1e13  # torch's CPU _scaled_mm (a reference loop in torch 2.13)
    # a snapshot's work on these cores: a copy, a file, a hash and a swap cost more per byte than a copy alone
    assert 1e6 < cluster.device.snapshot_bytes_per_s < cluster.device.memory_bandwidth_bytes_per_s
    assert 1e6 < cluster.device.snapshot_swap_bytes_per_s
    assert 0 <= cluster.device.snapshot_fixed_s < 1
    level = cluster.levels[0]
    assert level.group_size == 2 and set(level.collective_latency_s) >= {"all_reduce", "all_gather", "p2p"}
    assert all_reduce_time(cluster, 2**20, group_size=2) > 0

    profile = load_profile(out)  # the raw measurements come back too
    assert profile.cluster == cluster and profile.host["backend"] == "gloo" and profile.host["world_size"] == 2
    assert {m.collective for m in profile.measurements} == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"
    }
    quick = ProfileSweep.quick()
    assert all(len(m.trials_s) in (quick.trials, quick.long_op_trials) for m in profile.measurements)


def test_cli_profile_spawns_ranks_and_writes_a_loadable_file(tmp_path, capsys):
    out = tmp_path / "cpu.yaml"
    started = time.monotonic()
    assert main(["profile", "--nproc", "2", "--quick", "--out", str(out)]) == 0
    assert time.monotonic() - started < 60  # includes starting two Python processes that import torch
    assert "cluster file written to" in capsys.readouterr().out
    assert load_cluster(str(out)).num_devices == 2


def test_cli_profile_refuses_an_unloadable_file_name(tmp_path, capsys):
    assert main(["profile", "--nproc", "2", "--out", str(tmp_path / "cluster.txt")]) == 2
    assert "must end in .yaml" in capsys.readouterr().err


def _probe_with_room_on_rank_0_only() -> tuple[float | None, ...]:
    from collections import namedtuple

    from tessera.topology import measure_device

    if dist.get_rank() == 1:
        measure_device.shutil.disk_usage = lambda path: namedtuple("Usage", "total used free")(1, 1, 0)
    return measure_device.snapshot_work(sweep=ProfileSweep.quick())


def test_the_snapshot_probe_is_skipped_on_every_rank_when_one_has_no_room_for_its_files():
    assert spawn(_probe_with_room_on_rank_0_only, nprocs=2, timeout_s=60) == [(None, None, None)] * 2
