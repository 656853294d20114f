"""Device variants of a preset from its spec (``gpu=``, ``gpus_per_node=``), without a cluster file."""

import pytest

from tessera.errors import ClusterSpecError
from tessera.topology import load_cluster


@pytest.mark.parametrize(("spec", "gpu", "devices", "per_node", "memory_gb"), [
    ("dgx-a100:nodes=4,gpu=A100-SXM-40GB", "A100-SXM-40GB", 32, 8, 39.5 * 2**30 / 1e9),  # as PyTorch reports it
    ("dgx-a100:nodes=4,gpu=A100-SXM-40GB,gpus_per_node=4", "A100-SXM-40GB", 16, 4, 39.5 * 2**30 / 1e9),
    ("dgx-h100:nodes=2,gpu=H100-NVL-94GB", "H100-NVL-94GB", 16, 8, 93.0 * 2**30 / 1e9),
    ("dgx-h100:gpu=H200-SXM-141GB,nodes=3", "H200-SXM-141GB", 24, 8, 139.8 * 2**30 / 1e9),
    ("dgx-a100:nodes=2,gpu=V100-SXM2-16GB", "V100-SXM2-16GB", 16, 8, 16),
    ("dgx-h100:nodes=1,gpu=B200-SXM-180GB", "B200-SXM-180GB", 8, 8, 178.35 * 2**30 / 1e9),
    ("dgx-b300:nodes=2", "B300-SXM-288GB", 16, 8, 267.69 * 2**30 / 1e9),
    ("gb300-nvl72:nodes=1,gpus_per_node=64", "B300-GB300-NVL72", 64, 64, 276.5 * 2**30 / 1e9),
    ("dgx-h100:nodes=2", "H100-SXM-80GB", 16, 8, 79.21 * 2**30 / 1e9),
])
def test_a_preset_takes_any_catalog_gpu_and_node_size(spec, gpu, devices, per_node, memory_gb):
    cluster = load_cluster(spec)
    assert (cluster.device.name, cluster.num_devices, cluster.devices_per_node) == (gpu, devices, per_node)
    assert cluster.device.memory_bytes / 1e9 == pytest.approx(memory_gb)
    assert cluster.levels[0].group_size == per_node  # the NVLink level follows the node


def test_the_preset_keeps_its_fabric():
    plain, variant = load_cluster("dgx-a100:nodes=4"), load_cluster("dgx-a100:nodes=4,gpu=A100-SXM-40GB")
    assert [level.model_dump() for level in plain.levels] == [level.model_dump() for level in variant.levels]


@pytest.mark.parametrize(("spec", "message"), [
    ("dgx-a100:nodes=4,gpu=A100-40", r"unknown device 'A100-40'; known devices: A100-SXM-40GB, A100-SXM-80GB"),
    ("dgx-a100:nodes=2,colour=green", r"takes 'nodes=N' and optionally 'gpu=NAME' .* got 'colour=green'"),
    ("dgx-a100:nodes=2,nodes=3", "nodes is given twice"),
    ("dgx-a100:nodes=2,gpus_per_node=0", "'gpus_per_node' in cluster preset dgx-a100 must be a positive integer"),
    ("dgx-a100:nodes=2,gpu", r"got 'gpu'"),
])
def test_bad_variants_get_one_clear_line(spec, message):
    with pytest.raises(ClusterSpecError, match=message) as info:
        load_cluster(spec)
    assert "\n" not in str(info.value)
