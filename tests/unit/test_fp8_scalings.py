"""Which FP8 scalings a device runs (``DeviceSpec.fp8_scalings``, from the catalog or a cluster file), and the
planner refusing one it does not run in one line (MXFP8 needs Blackwell)."""

from __future__ import annotations

from typing import get_args

import pytest

from tessera.cost_models.types import Fp8Scaling
from tessera.errors import ClusterSpecError, ConfigError
from tessera.topology import load_cluster
from tessera.topology.cluster import FP8_SCALINGS
from tessera.topology.hardware import device_from_raw, device_to_raw


def test_the_catalog_says_which_parts_run_mxfp8():
    assert FP8_SCALINGS == get_args(Fp8Scaling)  # the topology layer names what the cost model prices
    hopper, blackwell = (load_cluster(name).device for name in ("dgx-h100:nodes=1", "dgx-b200:nodes=1"))
    assert "mx" not in hopper.fp8_scalings and "block" in hopper.fp8_scalings
    assert set(blackwell.fp8_scalings) == set(FP8_SCALINGS)
    assert load_cluster("dgx-a100:nodes=1").device.fp8_scalings is None  # no FP8 units: the precision is refused
    for gpu in ("H800-SXM-80GB", "H100-NVL-94GB", "H100-SXM-96GB-500W", "H200-SXM-141GB"):  # all Hopper
        assert load_cluster(f"dgx-h100:nodes=1,gpu={gpu}").device.fp8_scalings == hopper.fp8_scalings
    assert load_cluster("gb200-nvl72:nodes=1").device.fp8_scalings == blackwell.fp8_scalings
    assert "mx" not in load_cluster("mi300x:nodes=1").device.fp8_scalings  # CDNA 3: no microscaling formats


def test_a_cluster_files_fp8_scalings_are_checked_and_written_back():
    raw = {**device_to_raw(load_cluster("dgx-h100:nodes=1").device)}
    assert raw["fp8_scalings"] == ["delayed", "current", "rowwise", "block"]
    assert device_from_raw(raw, where="file").fp8_scalings == ("delayed", "current", "rowwise", "block")
    with pytest.raises(ClusterSpecError, match="'nvfp4' is not a scaling; known: delayed, current"):
        device_from_raw({**raw, "fp8_scalings": ["current", "nvfp4"]}, where="file")
    with pytest.raises(ClusterSpecError, match="must be a list of scalings"):
        device_from_raw({**raw, "fp8_scalings": "current"}, where="file")


def test_planning_a_scaling_the_device_does_not_run_is_one_line():
    from tessera.api import evaluate

    with pytest.raises(ConfigError) as error:
        evaluate("gpt-tiny", "dgx-h100:nodes=1", global_batch=8, seq_len=32, strategy="dp=8", precision="fp8",
                 fp8_scaling="mx")
    assert "H100-SXM-80GB runs delayed, current, rowwise, block (MXFP8 needs Blackwell" in str(error.value)
    assert "\n" not in str(error.value)
