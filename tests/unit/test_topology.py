import pytest

from tessera.errors import ClusterSpecError
from tessera.topology import load_cluster, preset_names
from tessera.topology.collectives import all_gather_time, all_reduce_time, participants_per_level, reduce_scatter_time


def test_dgx_h100_preset_has_nodes_of_eight():
    cluster = load_cluster("dgx-h100:nodes=8")
    assert cluster.num_devices == 64
    assert cluster.devices_per_node == 8
    assert cluster.device.peak_flops("bf16") == 989e12
    assert [level.name for level in cluster.levels] == ["nvlink", "infiniband"]


def test_cpu_preset_takes_ranks():
    cluster = load_cluster("cpu:ranks=4")
    assert cluster.num_devices == 4 and len(cluster.levels) == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dgx-zzz", "known presets: cpu, dgx-a100, dgx-h100"),
        ("dgx-h100:ranks=2", "takes 'nodes=N'"),
        ("dgx-h100:nodes=-1", "must be a positive integer"),
        ("missing.yaml", "does not exist"),
    ],
)
def test_bad_cluster_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ClusterSpecError, match=message):
        load_cluster(spec)


def test_cluster_file_names_the_bad_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "device: H100-SXM-80GB\ndevices_per_node: 8\nsize_key: nodes\nsize: 2\n"
        "levels:\n  - {name: nvlink, group_size: node, bandwidth_gb_per_s: fast, latency_us: 3}\n"
    )
    with pytest.raises(ClusterSpecError, match=r"levels\[0\].*bandwidth"):
        load_cluster(path)


def test_cluster_file_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "device: H100-SXM-80GB\ndevices_per_node: 8\nsize_key: nodes\nsize: 2\nlevels:\n"
        "  - {name: nvlink, group_size: node, bandwidth_gb_per_s: 450, latency_us: 3}\n"
        "  - {name: ib, group_size: world, bandwidth_gb_per_s: 50, latency_us: 10}\n"
    )
    assert load_cluster(path).num_devices == 16


def test_every_preset_loads():
    for name in preset_names():
        assert load_cluster(name).num_devices >= 1


def test_intra_node_group_uses_nvlink_only():
    cluster = load_cluster("dgx-h100:nodes=4")
    phases = participants_per_level(cluster, group_size=8)
    assert [(level.name, p) for level, p in phases] == [("nvlink", 8)]


def test_strided_group_has_one_member_per_node():
    # dp=4 with tp=8 inside each node: the dp group is one GPU per node, so all traffic is inter-node.
    cluster = load_cluster("dgx-h100:nodes=4")
    phases = participants_per_level(cluster, group_size=4, stride=8)
    assert [(level.name, p) for level, p in phases] == [("infiniband", 4)]


def test_ring_all_reduce_matches_alpha_beta_by_hand():
    cluster = load_cluster("dgx-h100:nodes=1")
    nvlink = cluster.levels[0]
    expected = 2 * (7 / 8 * 1e9 / (nvlink.bandwidth_bytes_per_s * nvlink.efficiency) + 7 * nvlink.latency_s)
    assert all_reduce_time(cluster, 1e9, group_size=8) == pytest.approx(expected)


def test_crossing_nodes_is_slower_and_all_reduce_is_two_halves():
    cluster = load_cluster("dgx-h100:nodes=4")
    inside = all_reduce_time(cluster, 1e9, group_size=8)
    across = all_reduce_time(cluster, 1e9, group_size=32)
    assert across > inside
    assert all_reduce_time(cluster, 1e9, group_size=32) == pytest.approx(
        reduce_scatter_time(cluster, 1e9, group_size=32) + all_gather_time(cluster, 1e9, group_size=32)
    )
    assert all_reduce_time(cluster, 1e9, group_size=1) == 0.0


def test_cpu_all_reduce_is_close_to_the_gloo_measurement():
    # PLATFORM-NOTES: 64 MiB fp32 all-reduce on 2 gloo ranks took 55 ms; the preset should land within 25%.
    predicted = all_reduce_time(load_cluster("cpu:ranks=2"), 64 * 2**20, group_size=2)
    assert predicted == pytest.approx(0.055, rel=0.25)
