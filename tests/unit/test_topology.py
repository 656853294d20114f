from pathlib import Path

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
        ("dgx-zzz", "known presets: cpu, dgx-a100, dgx-b200, dgx-b300, dgx-h100"),  # new presets (issue #4)
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


# --- issue #4: catalog, presets, file format -------------------------------------------------------------

from tessera.topology.clusterfile import cluster_from_raw, cluster_to_raw  # noqa: E402
from tessera.topology.hardware import catalog  # noqa: E402

CATALOG_DEVICES = [
    "V100-SXM2-32GB", "A100-SXM-40GB", "A100-SXM-80GB", "H100-SXM-80GB", "H200-SXM-141GB", "B200-SXM-180GB",
    "H800-SXM-80GB", "MI250X-GCD", "MI300X-192GB", "TPU-v4", "TPU-v5e", "TPU-v5p", "Gaudi2-96GB", "Gaudi3-128GB",
]


@pytest.mark.parametrize("name", CATALOG_DEVICES)
def test_catalog_device_has_peaks_memory_bandwidth_and_a_source(name):
    spec = catalog()[name]
    assert spec.peak_flops("bf16") > 1e14 and spec.memory_bytes > 10 * 2**30
    assert spec.memory_bandwidth_bytes_per_s > 5e11 and spec.scale_up_bandwidth_bytes_per_s > 1e11
    assert len(spec.source) > 40


def test_catalog_values_match_the_datasheets():
    c = catalog()
    assert c["H100-SXM-80GB"].peak_flops("fp8") == 1979e12 and c["H100-SXM-80GB"].peak_flops("fp32") == 67e12
    assert c["MI300X-192GB"].peak_flops("bf16") == pytest.approx(1307.4e12)
    assert c["B200-SXM-180GB"].peak_flops("bf16") == 2250e12
    assert c["V100-SXM2-32GB"].peak_flops("bf16") == 125e12  # no bf16: falls back to fp16 tensor cores
    with pytest.raises(ClusterSpecError, match="no peak FLOP/s for dtype 'fp32'"):
        c["TPU-v5p"].peak_flops("fp32")  # no fp32 matrix unit


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72", "dgx-b300", "gb300-nvl72", "mi300x",
                                  "tpu-v5p", "gaudi3", "cpu"])
def test_every_required_preset_loads_at_several_sizes(name):
    key = "ranks" if name == "cpu" else "nodes"
    for size in (1, 2, 64):
        cluster = load_cluster(f"{name}:{key}={size}")
        assert cluster.levels[-1].group_size == cluster.num_devices
        assert all(level.group_size <= cluster.num_devices for level in cluster.levels)


def test_dgx_h100_has_a_rail_leaf_and_a_spine_when_large_enough():
    cluster = load_cluster("dgx-h100:nodes=64")
    assert [(lvl.name, lvl.group_size) for lvl in cluster.levels] == [("nvlink", 8), ("infiniband", 256), ("spine", 512)]
    assert [lvl.name for lvl in load_cluster("dgx-h100:nodes=1").levels] == ["nvlink"]


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


BASE = "device: H100-SXM-80GB\ndevices_per_node: 8\nsize_key: nodes\nsize: 2\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "levels:\n  - {name: nv, group_size: node, bandwidth_gb_per_s: 450, latency_us: 3, bandwith: 1}\n",
         r"levels\[0\]: unknown field\(s\) bandwith"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 450, latency_us: 3, oversubscription: 0.5}\n",
         r"levels\[0\]: field 'oversubscription'"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_efficiency: {all_reduce: 2}}\n",
         r"levels\[0\]: field 'collective_efficiency'"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_algorithm: {all_reduce: magic}}\n",
         r"levels\[0\]: field 'collective_algorithm.all_reduce'"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_measured: {all_reduce: {4: [3]}}}\n",
         r"levels\[0\]: field 'collective_measured.all_reduce'.4 must be \[latency_us, bandwidth_gb_per_s\]"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_measured_by_layout: {all_reduce: {2: {1: [3]}}}}\n",
         r"levels\[0\]: field 'collective_measured_by_layout.all_reduce'.2.1 must be \[latency_us, bandwidth_gb_per_s\]"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_measured_by_layout: {all_reduce: {2: [3, 4]}}}\n",
         r"levels\[0\]: field 'collective_measured_by_layout.all_reduce'.2 must map strides to"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_measured_by_layout: {all_reduce: {2: {0: [3, 4]}}}}\n",
         r"levels\[0\]: field 'collective_measured_by_layout.all_reduce'.2 key must be a positive integer"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3, collective_measured_by_layout: {all_reduce: {2: {1: [3, 0]}}}}\n",
         r"levels\[0\]: field 'collective_measured_by_layout.all_reduce'.2.1\[1\] must be a positive number from 1e-09 to 1e\+12"),
        (BASE + "levels:\n  - {name: nv, group_size: half, bandwidth_gb_per_s: 4, latency_us: 3}\n",
         r"levels\[0\]: field 'group_size'"),
        (BASE + "levels:\n  - {name: nv, group_size: node, bandwidth_gb_per_s: 4, latency_us: 3}\n",
         r"outermost level 'nv' spans 8 devices"),
        (BASE.replace("H100-SXM-80GB", "H1000") + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3}\n",
         r"field 'device': unknown device 'H1000'"),
        (BASE.replace("device: H100-SXM-80GB", "device: {name: x, peak_tflops: {bf16: fast}, memory_gb: 8, memory_bandwidth_tb_per_s: 1, source: s}")
         + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3}\n",
         r"field 'peak_tflops.bf16' must be a positive number from 1e-09 to 1e\+12 \(the file's units\), got 'fast'"),
        (BASE.replace("device: H100-SXM-80GB", "device: {name: x, peak_tflops: {bf16: 1}, memory_bandwidth_tb_per_s: 1, source: s}")
         + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3}\n",
         r"memory_gib, memory_gb"),
        ("sise: 2\n" + BASE + "levels: []\n", r"unknown field\(s\) sise"),
        (BASE + "levels:\n  - {name: nv, group_size: world, bandwidth_gb_per_s: 4, latency_us: 3}\nextra_devices:\n  - {device: A100-SXM-80GB}\n",
         r"extra_devices\[0\]: missing field\(s\) count"),
    ],
)
def test_malformed_cluster_file_names_the_field(tmp_path, text, message):
    with pytest.raises(ClusterSpecError, match=message):
        load_cluster(write(tmp_path, text))


def test_inline_device_oversubscription_and_extra_devices_round_trip(tmp_path):
    path = write(tmp_path, (
        "device: {name: my-gpu, peak_tflops: {bf16: 500, fp32: 50}, memory_gib: 64, memory_bandwidth_tb_per_s: 2,"
        " scale_up_gb_per_s: 300, source: vendor sheet}\n"
        "devices_per_node: 4\nsize_key: nodes\nsize: 16\nlevels:\n"
        "  - {name: nv, group_size: node, bandwidth_gb_per_s: 300, latency_us: 3}\n"
        "  - {name: leaf, group_size: 8 nodes, bandwidth_gb_per_s: 50, latency_us: 10}\n"
        "  - {name: agg, group_size: world, bandwidth_gb_per_s: 50, latency_us: 15, oversubscription: 7,"
        " collective_measured: {all_reduce: {2: [20, 40], 4: [25, 30.5]}}, collective_local_ns_per_byte: {all_reduce: 0.1},"
        " collective_measured_by_layout: {all_reduce: {2: {4: [21, 41], 16: [22, 39]}}},"
        " collective_algorithm: {broadcast: flat}}\n"
        "extra_devices:\n  - {device: A100-SXM-80GB, count: 16, note: older pod on the same spine}\n"
    ))
    cluster = load_cluster(path)
    assert cluster.device.name == "my-gpu" and cluster.device.memory_bytes == 64 * 2**30
    assert [lvl.group_size for lvl in cluster.levels] == [4, 32, 64] and cluster.levels[2].oversubscription == 7
    assert cluster.extra_devices[0].device.name == "A100-SXM-80GB" and cluster.extra_devices[0].num_devices == 16
    assert cluster.levels[2].collective_measured["all_reduce"][4] == pytest.approx((25e-6, 30.5e9))
    assert cluster.levels[2].collective_measured_by_layout["all_reduce"][2][16] == pytest.approx((22e-6, 39e9))
    again = cluster_from_raw(cluster_to_raw(cluster), name=cluster.name, size=cluster.num_devices)
    assert_close(again.model_dump(), cluster.model_dump())


def test_a_profiled_file_without_per_layout_values_still_loads(tmp_path):
    import yaml
    raw = yaml.safe_load((Path(__file__).parents[2] / "benchmarks/results/cluster-x86_64-cpu-2026-12-01.yaml").read_text())
    for level in raw["levels"]:  # files written before per-layout fits existed lack the table
        level.pop("collective_measured_by_layout", None)
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(raw))
    level = load_cluster(str(tmp_path / "old.yaml")).levels[0]
    assert level.collective_measured["all_reduce"] and not level.collective_measured_by_layout


def assert_close(a, b):
    """Equal structure; numbers equal to the 6 significant digits files keep."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_close(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5)
    else:
        assert a == b


def test_a_cluster_file_whose_innermost_level_is_not_its_node_is_refused(tmp_path):
    """Tessera takes a node to be the innermost link level (``Cluster.devices_per_node``, what launch lines use):
    a file giving 8 devices a node but an innermost level of 3 or 16 would launch on the wrong node count."""
    for inner in (3, 16):
        path = tmp_path / f"c{inner}.yaml"
        path.write_text("device: H100-SXM-80GB\ndevices_per_node: 8\nsize_key: nodes\nsize: 2\nlevels:\n"
                        f"  - {{name: nvlink, group_size: {inner}, bandwidth_gb_per_s: 450, latency_us: 3}}\n"
                        "  - {name: ib, group_size: world, bandwidth_gb_per_s: 50, latency_us: 5}\n")
        with pytest.raises(ClusterSpecError, match=f"innermost level 'nvlink' groups {inner} devices but "
                                                   "devices_per_node is 8.*give it group_size: node"):
            load_cluster(str(path))


def test_gpus_per_node_does_not_apply_where_a_preset_fixes_its_node():
    with pytest.raises(ClusterSpecError, match="tpu-v5p's node is its innermost link level of 4 devices"):
        load_cluster("tpu-v5p:nodes=2,gpus_per_node=8")
    assert load_cluster("tpu-v5p:nodes=2,gpus_per_node=4").devices_per_node == 4


def test_a_cluster_name_that_is_no_path_is_an_unknown_preset():
    for name in ("", "x" * 5000):
        with pytest.raises(ClusterSpecError, match="unknown cluster preset"):
            load_cluster(name)


def test_an_nvl72_rack_is_one_node_on_hosts_of_four():
    """A GB200 NVL72 rack prices as one NVLink node of 72 but runs as 18 hosts of 4 (one torchrun each)."""
    from tessera.topology.clusterfile import cluster_from_raw, cluster_to_raw

    rack = load_cluster("gb200-nvl72:nodes=2")
    assert (rack.num_nodes, rack.devices_per_node, rack.num_hosts, rack.host_size) == (2, 72, 36, 4)
    assert load_cluster("dgx-h100:nodes=2").num_hosts == 2  # a host is a node unless a cluster says otherwise
    assert load_cluster("gb300-nvl72:nodes=1,gpus_per_node=16").num_hosts == 4
    assert load_cluster("gb200-nvl72:nodes=1,gpus_per_node=1").host_size == 1  # one GPU of a host
    raw = cluster_to_raw(rack)
    assert cluster_from_raw(raw, name="back", size=raw["size"]).num_hosts == 36
    with pytest.raises(ClusterSpecError, match="hosts hold 4 GPUs each; give gpus_per_node as a multiple of 4, got 6"):
        load_cluster("gb200-nvl72:nodes=1,gpus_per_node=6")
    with pytest.raises(ClusterSpecError, match="hosts of 5 devices \\(devices_per_host\\) do not tile its nodes of 72"):
        cluster_from_raw({**raw, "devices_per_host": 5}, name="x", size=raw["size"])
    with pytest.raises(ClusterSpecError, match="field 'devices_per_host' must be a positive integer"):
        cluster_from_raw({**raw, "devices_per_host": "four"}, name="x", size=raw["size"])
    partial = cluster_to_raw(load_cluster("dgx-h100:nodes=4"))  # an elastic restart's 20 ranks: 2.5 nodes
    assert cluster_from_raw(partial, name="20", size=20).num_hosts == 3
