"""The cluster data model: devices and the hierarchy of links that joins them.

A ``Cluster`` is ``num_devices`` ranks of one primary ``DeviceSpec`` joined by ``levels``, innermost first.
Each ``LinkLevel`` is a set of ``group_size`` consecutive ranks (an NVLink/NVSwitch node of 8, a rail-
optimised InfiniBand leaf of a few hundred GPUs, the spine spanning the world; a TPU torus axis; a GB200
NVL72 rack) and says what one device gets when it talks to another rank inside that set but outside the
level below: per-direction bandwidth, one-message latency, the fraction of the bandwidth collectives reach
(bus-bandwidth efficiency), and oversubscription of the switches above the level below. Ranks are numbered
so that each level's groups are consecutive, as ``torchrun`` numbers them (node-major).

Collective costs on this model are in ``tessera.topology.collectives``; presets and YAML files in
``tessera.topology.presets``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessera.errors import ClusterSpecError
from tessera.topology.validation import MAX_DEVICES, quoted

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
CHECKED = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
"""The cluster models' configuration: ``FROZEN`` that also refuses infinite and NaN numbers (bandwidths,
latencies, FLOP/s...), which no device has and which the cost model would divide by."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
"""Collective kinds the cost model and the profiler know, in the order reports list them."""

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"]
Algorithm = Literal["ring", "tree", "flat", "direct"]


def _check_values(values: dict, ok: Callable[[float], bool], *, need: str) -> dict:
    """``values`` when ``ok`` holds for every value, else a ``ValueError`` quoting the first that fails."""
    bad = {k: v for k, v in values.items() if not ok(v)}
    if bad:
        raise ValueError(f"values must be {need}, got {_first_item(bad)}")
    return values


def _first_item(bad: dict) -> str:
    """``{'fp32': 0.0}``, or ``{'fp32': 0.0} and 3 more``: the offending entries of a mapping, bounded."""
    key, value = next(iter(bad.items()))
    return f"{{{quoted(key)}: {quoted(value)}}}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")


def _valid_link(pair: tuple[float, float]) -> bool:
    """A measured ``(latency_s, bandwidth_bytes_per_s)`` pair a cost can be computed from."""
    latency, bandwidth = pair
    return latency >= 0 and bandwidth > 0


FP8_SCALINGS = ("delayed", "current", "rowwise", "block", "mx")
"""The FP8 scaling recipes Tessera prices (``cost_models.types.Fp8Scaling`` names the same), which a device's
``fp8_scalings`` chooses from."""


class DeviceSpec(BaseModel):
    """One accelerator (or CPU socket share) as the cost model sees it."""

    model_config = CHECKED

    name: str
    """Catalog name, e.g. ``H100-SXM-80GB``; ``local-cpu`` for this machine's CPU."""
    peak_flops_by_dtype: dict[str, float]
    """Peak dense FLOP/s per compute dtype (keys ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``); for
    ``local-cpu`` the matmul rate ``tessera profile`` measured (or a nominal figure)."""
    memory_bytes: int = Field(gt=0)
    """Usable device memory capacity in bytes."""
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    """Peak memory bandwidth in bytes/s."""
    scale_up_bandwidth_bytes_per_s: float | None = Field(default=None, gt=0)
    """Per-direction bandwidth of the device's scale-up links (NVLink, Infinity Fabric, ICI, on-chip RoCE)
    in bytes/s, summed over its links; ``None`` where not catalogued."""
    host_bandwidth_bytes_per_s: float | None = Field(default=None, gt=0)
    """Per-direction bandwidth between the device and its host's memory (PCIe, NVLink-C2C) in bytes/s: what
    activation offload copies through; ``None`` where not catalogued."""
    solo_speedup: float = Field(default=1.0, ge=1.0)
    """How many times faster one rank computes alone than when every rank of its host computes at once: ranks
    that share CPU cores (about ranks / cores), measured by ``tessera profile``; 1.0 where each rank has a
    device of its own. ``peak_flops_by_dtype`` and the bandwidth are the all-ranks figures."""
    linear_overhead_s: dict[int, float] = Field(default_factory=dict)
    """Host seconds the framework spends per linear layer of a transformer block per micro-batch (forward and
    backward, the block's other ops counted pro rata), by tensor-parallel degree: ``1`` plain tensors, ``t`` a
    block split over ``t`` ranks with DTensor and sequence parallelism, its collectives at negligible size
    included. Measured by ``tessera profile`` on CPU ranks, where it adds to the compute on the same cores;
    empty where not measured (an accelerator's host runs ahead of it and hides the overhead)."""
    fsdp_comm_slowdown: float | None = Field(default=None, ge=1.0)
    """How many times longer FSDP2's parameter all-gathers and gradient reduce-scatters take than the bare
    collectives of the same bytes (its flat-buffer copies, hooks and DTensor bookkeeping), measured by
    ``tessera profile`` on CPU ranks; ``None`` where not measured (the cost model's calibration applies)."""
    tp_compute_slowdown: dict[int, float] = Field(default_factory=dict)
    """How many times longer a transformer block's arithmetic takes split over ``t`` tensor-parallel ranks than
    ``1/t`` of the whole block's, by degree ``t``: on CPU ranks that share cores a rank waits for its partners
    at every collective (measured by ``tessera profile``); empty where not measured (1: a device per rank)."""
    snapshot_fixed_s: float | None = Field(default=None, ge=0)
    """Seconds of an in-memory snapshot's work per rank that do not grow with its size (a collective, file
    operations), every rank snapshotting at once, measured by ``tessera profile`` on CPU ranks; ``None`` where
    not measured (a device per rank: the host's cores are free for it)."""
    snapshot_bytes_per_s: float | None = Field(default=None, gt=0)
    """Bytes of a rank's state per second a snapshot's own work gets through (staging copy, file write in host
    memory, hash), measured with ``snapshot_fixed_s``: on CPU ranks it runs on the cores that train, so training
    pays for it (``cost_models.reliability``)."""
    snapshot_swap_bytes_per_s: float | None = Field(default=None, gt=0)
    """Bytes per second of the swap with a buddy rank on top of that work (sent and received into a store file),
    every rank at once; ``None`` where not measured (one rank)."""
    fp8_scalings: tuple[str, ...] | None = None
    """The FP8 scaling recipes the part's tensor cores run (``TrainingConfig.fp8_scaling``: MXFP8 needs Blackwell);
    ``None`` where the catalog or cluster file does not say (none is refused)."""
    source: str
    """Where every number above comes from (datasheet, paper table, or a measurement command)."""

    @model_validator(mode="after")
    def _snapshot_rates_together(self) -> DeviceSpec:
        measured = (self.snapshot_fixed_s is not None, self.snapshot_bytes_per_s is not None)
        if measured[0] != measured[1] or (self.snapshot_swap_bytes_per_s is not None and not all(measured)):
            raise ValueError("snapshot_fixed_ms and snapshot_gb_per_s go together (snapshot_swap_gb_per_s only with "
                             "them): give both or none, or profile again with tessera profile")
        return self

    @field_validator("peak_flops_by_dtype", "tp_compute_slowdown")
    @classmethod
    def _rates_positive(cls, values: dict) -> dict:
        return _check_values(values, lambda v: v > 0, need="positive")

    @field_validator("linear_overhead_s")
    @classmethod
    def _overheads_not_negative(cls, values: dict[int, float]) -> dict[int, float]:
        return _check_values(values, lambda v: v >= 0, need=">= 0")

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
    """One level of the link hierarchy, innermost first (e.g. NVLink domain, then InfiniBand leaf, spine)."""

    model_config = CHECKED

    name: str
    """Human name, e.g. ``nvlink`` or ``infiniband``."""
    group_size: int = Field(gt=0)
    """Devices reachable at this level or below (8 for an NVLink node; the world for the top)."""
    bandwidth_bytes_per_s: float = Field(gt=0)
    """Per-device, per-direction bandwidth at this level in bytes/s."""
    latency_s: float = Field(ge=0)
    """One-message latency at this level in seconds (the alpha of alpha-beta), per algorithm step."""
    efficiency: float = Field(default=1.0, gt=0, le=1)
    """Fraction of ``bandwidth_bytes_per_s`` collectives reach in practice (bus-bandwidth efficiency)."""
    oversubscription: float = Field(default=1.0, ge=1.0)
    """Ratio of downlink to uplink capacity of the switches that join this level's sub-groups (1.0 is a
    non-blocking fat tree; Llama 3's aggregation layer is 7.0). Divides the bandwidth of every group that
    crosses this level (the worst case: every sub-group sends out at once)."""
    collective_efficiency: dict[Collective, float] = Field(default_factory=dict)
    """Per-collective bus-bandwidth efficiency overriding ``efficiency`` (values in (0, 1]); ``tessera
    profile`` fits one per collective because libraries reach different fractions of a link per collective."""
    collective_latency_s: dict[Collective, float] = Field(default_factory=dict)
    """Per-collective per-step latency overriding ``latency_s``, in seconds (fitted by ``tessera profile``)."""
    collective_local_s_per_byte: dict[Collective, float] = Field(default_factory=dict)
    """Per-collective cost on each device itself per byte of its buffer, in seconds per byte: copying into
    the output, reducing; it does not shrink with the number of participants (the gamma of the
    alpha-beta-gamma model, Thakur et al. 2005). 0 where absent: on GPUs it hides in ``efficiency``; on
    CPU ranks sharing cores ``tessera profile`` fits it."""
    collective_measured: dict[Collective, dict[int, tuple[float, float]]] = Field(default_factory=dict)
    """``(latency_s, bandwidth_bytes_per_s)`` fitted by ``tessera profile`` for exactly ``p`` participants at
    this level, per collective and ``p``, with the collective's algorithm coefficients. Used instead of the
    level-wide values for that ``p`` (as NCCL's tuning tables beat a formula): measured ``p``-scaling wins
    where the formula's does not hold, e.g. on CPU ranks sharing cores a ring step among 4 ranks costs more
    than one among 2. ``efficiency``, ``oversubscription`` and the local cost do not apply to these."""
    collective_measured_by_layout: dict[Collective, dict[int, dict[int, tuple[float, float]]]] = Field(default_factory=dict)
    """``(latency_s, bandwidth_bytes_per_s)`` fitted by ``tessera profile`` for one group layout, per collective,
    ``p`` and ``stride``: ``p`` participants ``stride`` ranks apart, the group crossing only this level (for
    point-to-point: a pair ``stride`` apart). Used instead of ``collective_measured`` for exactly that layout.
    Where ranks share CPU cores, which ranks pair up matters (groups {0,1},{2,3} and {0,2},{1,3} contend
    differently), and a mesh axis asks for exactly the layouts the profiler measured."""
    collective_algorithm: dict[Collective, Algorithm] = Field(default_factory=dict)
    """The algorithm the communication library uses for a collective at this level, where known (fitted by
    ``tessera profile``: gloo broadcasts ``flat`` from the root). Absent: the faster of ring and tree, as
    NCCL's tuner picks. See ``tessera.topology.collectives`` for each algorithm's formula."""
    source: str
    """Where the bandwidth and latency come from."""

    @field_validator("collective_efficiency")
    @classmethod
    def _efficiencies_in_range(cls, values: dict[str, float]) -> dict[str, float]:
        return _check_values(values, lambda v: 0 < v <= 1, need="in (0, 1]")

    @field_validator("collective_measured")
    @classmethod
    def _measured_positive(cls, values: dict[str, dict[int, tuple[float, float]]]) -> dict:
        bad = {k: table for k, table in values.items() if any(p < 2 or not _valid_link(pair) for p, pair in table.items())}
        if bad:
            raise ValueError(f"entries need p >= 2, latency >= 0 and bandwidth > 0, got {_first_item(bad)}")
        return values

    @field_validator("collective_measured_by_layout")
    @classmethod
    def _layouts_positive(cls, values: dict[str, dict[int, dict[int, tuple[float, float]]]]) -> dict:
        bad = {
            k: table for k, table in values.items()
            if any(p < 2 or s < 1 or not _valid_link(pair) for p, row in table.items() for s, pair in row.items())
        }
        if bad:
            raise ValueError(f"entries need p >= 2, stride >= 1, latency >= 0 and bandwidth > 0, got {_first_item(bad)}")
        return values

    @field_validator("collective_latency_s", "collective_local_s_per_byte")
    @classmethod
    def _latencies_not_negative(cls, values: dict[str, float]) -> dict[str, float]:
        return _check_values(values, lambda v: v >= 0, need=">= 0")

    def link(self, collective: Collective) -> tuple[float, float]:
        """``(latency_s, bandwidth_bytes_per_s)`` one device reaches in ``collective`` across this level.

        Bandwidth is ``bandwidth_bytes_per_s * efficiency / oversubscription``, with the per-collective
        efficiency and latency where the level has them.
        """
        efficiency = self.collective_efficiency.get(collective, self.efficiency)
        latency = self.collective_latency_s.get(collective, self.latency_s)
        return latency, self.bandwidth_bytes_per_s * efficiency / self.oversubscription

    def measured_link(self, collective: Collective, p: int, *, stride: int | None = None) -> tuple[float, float] | None:
        """``(latency_s, bandwidth_bytes_per_s)`` profiled for ``p`` participants: for the layout ``(p, stride)``
        where measured (``stride`` given), else for ``p`` with any stride; ``None`` where neither was."""
        by_layout = self.collective_measured_by_layout.get(collective, {}).get(p, {})
        if stride is not None and stride in by_layout:
            return by_layout[stride]
        return self.collective_measured.get(collective, {}).get(p)


class DeviceGroup(BaseModel):
    """Devices of a second kind in a heterogeneous cluster (recorded; not planned on yet)."""

    model_config = CHECKED

    device: DeviceSpec
    """The device kind of this group."""
    num_devices: int = Field(gt=0, le=MAX_DEVICES)
    """How many devices of this kind."""
    note: str = ""
    """How the group attaches to the cluster (e.g. 'a second pod of A100 nodes on the same spine')."""


class Cluster(BaseModel):
    """A set of devices of one primary kind joined by a hierarchy of link levels.

    Heterogeneous clusters (say 64 H100 and 32 A100 on one fabric) are representable: ``device`` and
    ``num_devices`` describe the primary kind, the one every planned rank runs on, and ``extra_devices``
    lists the other kinds. The planner and cost model use the primary kind only; the extra groups are kept
    so a cluster file round-trips and a later planner can place work on them.
    """

    model_config = CHECKED

    name: str
    """Spec this cluster was built from, e.g. ``dgx-h100:nodes=8``."""
    device: DeviceSpec
    """The device every planned rank runs on (the primary kind)."""
    num_devices: int = Field(gt=0, le=MAX_DEVICES)
    """Total devices of the primary kind (world size), at most ``MAX_DEVICES``."""
    levels: tuple[LinkLevel, ...]
    """Link levels innermost first; the last one must span the whole cluster."""
    extra_devices: tuple[DeviceGroup, ...] = ()
    """Devices of other kinds on the same fabric; not part of ``num_devices`` or the planned world."""
    devices_per_host: int | None = Field(default=None, gt=0, le=MAX_DEVICES)
    """Devices one host (one OS, one ``torchrun``) drives, where that is fewer than a node: a GB200 NVL72 rack is
    one NVLink node of 72 GPUs on 18 hosts of 4. ``None``: a host is a node."""

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
        if self.devices_per_host is not None and self.devices_per_node % self.host_size:
            raise ClusterSpecError(
                f"cluster {self.name}: hosts of {self.devices_per_host} devices (devices_per_host) do not tile its "
                f"nodes of {self.devices_per_node}; give devices_per_host dividing devices_per_node"
            )
        return self

    @property
    def devices_per_node(self) -> int:
        """Devices inside the innermost link level (a node, for GPU clusters)."""
        return min(self.levels[0].group_size, self.num_devices)

    def level_spanned(self, group_size: int, *, stride: int = 1) -> LinkLevel:
        """The outermost level a group of ``group_size`` ranks, ``stride`` apart, must cross. The mesh's groups
        tile blocks of ``group_size * stride`` ranks, so they stay inside a level's groups only where those are a
        whole number of blocks: groups of 2 on nodes of 3 (ranks 2 and 3) straddle two nodes."""
        span, block = (group_size - 1) * stride + 1, group_size * stride
        for level in self.levels:
            size = min(level.group_size, self.num_devices)
            if span <= size and (group_size == 1 or size % block == 0 or level is self.levels[-1]):
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

    @property
    def host_size(self) -> int:
        """Devices per host: what one ``torchrun`` starts, what one machine's failure takes down, what shares one
        host's memory for snapshots. A cluster of fewer devices than a host (one GB200) is that one host."""
        return min(self.devices_per_host or self.devices_per_node, self.devices_per_node)  # a node within one host

    @property
    def num_hosts(self) -> int:
        """Number of hosts (``torchrun --nnodes``)."""
        return math.ceil(self.num_devices / self.host_size)
