"""The cluster data model: devices and the hierarchy of links that joins them."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.errors import ClusterSpecError

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class DeviceSpec(BaseModel):
    """One accelerator (or CPU socket share) as the cost model sees it."""

    model_config = FROZEN

    name: str
    """Catalog name, e.g. ``H100-SXM-80GB``."""
    peak_flops_by_dtype: dict[str, float]
    """Peak dense FLOP/s per compute dtype (keys ``fp32``, ``bf16``, ``fp16``, ``fp8``)."""
    memory_bytes: int = Field(gt=0)
    """Usable device memory capacity in bytes."""
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    """Peak memory bandwidth in bytes/s."""
    source: str
    """Where every number above comes from (datasheet, paper table, or a measurement command)."""

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; fp16 falls back to bf16 and vice versa."""
        for key in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)):
            if key in self.peak_flops_by_dtype:
                return self.peak_flops_by_dtype[key]
        raise ClusterSpecError(
            f"device {self.name} has no peak FLOP/s for dtype {dtype!r} "
            f"(known: {sorted(self.peak_flops_by_dtype)}); choose another precision"
        )


class LinkLevel(BaseModel):
    """One level of the link hierarchy, innermost first (e.g. NVLink domain, then InfiniBand)."""

    model_config = FROZEN

    name: str
    """Human name, e.g. ``nvlink`` or ``infiniband``."""
    group_size: int = Field(gt=0)
    """Devices reachable at this level or below (8 for an NVLink node; the world for the top)."""
    bandwidth_bytes_per_s: float = Field(gt=0)
    """Per-device, per-direction bandwidth at this level in bytes/s."""
    latency_s: float = Field(ge=0)
    """One-message latency at this level in seconds (the alpha of alpha-beta)."""
    efficiency: float = Field(default=1.0, gt=0, le=1)
    """Fraction of ``bandwidth_bytes_per_s`` collectives reach in practice (bus-bandwidth efficiency)."""
    source: str
    """Where the bandwidth and latency come from."""


class Cluster(BaseModel):
    """A homogeneous set of devices joined by a hierarchy of link levels."""

    model_config = FROZEN

    name: str
    """Spec this cluster was built from, e.g. ``dgx-h100:nodes=8``."""
    device: DeviceSpec
    """The device every rank runs on."""
    num_devices: int = Field(gt=0)
    """Total devices (world size)."""
    levels: tuple[LinkLevel, ...]
    """Link levels innermost first; the last one must span the whole cluster."""

    @model_validator(mode="after")
    def _levels_nest(self) -> "Cluster":
        if not self.levels:
            raise ClusterSpecError(f"cluster {self.name}: 'levels' is empty; give at least one link level")
        sizes = [level.group_size for level in self.levels]
        if sizes != sorted(sizes):
            raise ClusterSpecError(f"cluster {self.name}: 'levels' group_size must grow outward, got {sizes}")
        if sizes[-1] < self.num_devices:
            raise ClusterSpecError(
                f"cluster {self.name}: outermost level '{self.levels[-1].name}' spans {sizes[-1]} devices "
                f"but the cluster has {self.num_devices}; raise its group_size"
            )
        return self

    @property
    def devices_per_node(self) -> int:
        """Devices inside the innermost link level (a node, for GPU clusters)."""
        return min(self.levels[0].group_size, self.num_devices)

    def level_spanned(self, group_size: int, *, stride: int = 1) -> LinkLevel:
        """The outermost level a group of ``group_size`` ranks, ``stride`` apart, must cross."""
        span = (group_size - 1) * stride + 1
        for level in self.levels:
            if span <= level.group_size:
                return level
        raise ClusterSpecError(
            f"a group spanning {span} devices does not fit cluster {self.name} of {self.num_devices}"
        )

    def check_world(self, world_size: int) -> None:
        """Raise unless a run of ``world_size`` ranks matches this cluster."""
        if world_size != self.num_devices:
            raise ClusterSpecError(
                f"cluster {self.name} has {self.num_devices} devices but the run has {world_size} ranks; "
                f"use a cluster spec with {world_size} devices (e.g. ':ranks={world_size}')"
            )

    @property
    def num_nodes(self) -> int:
        """Number of innermost-level groups (nodes)."""
        return math.ceil(self.num_devices / self.devices_per_node)
