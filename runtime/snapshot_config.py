"""What in-memory snapshots are asked to do and where (``runtime.snapshots`` does it): ``SnapshotConfig``, which
node each rank is on and which node keeps its copy (``NodeLayout``), the default interval the reliability model
chooses for a plan (``cost_models.reliability``, priced at the plan's cluster's rates) and the default store."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tessera.cost_models.reliability import (
    LLAMA3_GPU_MTBF_S, SnapshotWork, host_snapshot_rate, job_mtbf_s, snapshot_plan,
)
from tessera.errors import ClusterSpecError, ConfigError
from tessera.planner.plan import Plan
from tessera.topology import load_cluster
from tessera.topology.hardware import LOCAL_CPU

log = logging.getLogger(__name__)

SNAPSHOT_ROOT = Path("/dev/shm")


class SnapshotConfig(BaseModel):
    """How often to snapshot and where this node's store lives."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    every: int | None = Field(default=None, ge=1)
    """Snapshot every ``every`` optimizer steps (``k``); default: the reliability model's best ``k`` for the plan
    (its predicted step time and state size, this job's MTBF: ``cost_models.reliability.snapshot_plan``, what
    ``tessera plan --mtbf-hours`` prints)."""
    mtbf_hours: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """The job's mean time between failures, for the default ``every``; default: Llama 3's rate per GPU (419
    unexpected interruptions in 54 days on 16,384 GPUs, ``reliability.LLAMA3_GPU_MTBF_S``) for this many ranks."""
    store: Path | None = None
    """This node's store folder; default ``/dev/shm/tessera-snapshots-<uid>/<torchrun run id>``."""
    ranks_per_node: int | None = Field(default=None, ge=1)
    """Ranks on each node; default torchrun's ``LOCAL_WORLD_SIZE`` (every rank on one node without it)."""
    nodes_per_switch: int | None = Field(default=None, ge=1)
    """Nodes under one switch: the buddy is that many nodes away (default 1: the next node)."""
    keep: int = Field(default=2, ge=2)
    """Committed snapshots each store keeps (at least 2: the newest is known complete on every node only once the
    next snapshot's agreement says so, so the one before it must stay)."""
    background_nice: int = Field(default=19, ge=0, le=19)
    """The snapshot thread's nice value (Linux; 19: the lowest priority, it yields to training; 0: training's
    own, where other jobs on the host would otherwise starve it and training waits for it at the next snapshot)."""
    host_memory_budget_bytes: int | None = Field(default=None, gt=0)
    """Host memory the store may use per node; default the free space of its file system (tmpfs: RAM)."""


class NodeLayout(BaseModel):
    """Which node each rank is on and which node keeps its copy."""

    model_config = ConfigDict(frozen=True)

    world: int
    ranks_per_node: int
    shift: int
    """Buddy of node ``n``: node ``(n + shift) % nodes`` (0: a single node, no buddy)."""

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` manages its node's store (the node's first rank)."""
        return rank % self.ranks_per_node == 0

    def partner(self, rank: int, *, offset: int) -> int:
        """The rank with the same local index ``offset`` nodes further on."""
        node = (self.node(rank) + offset) % self.nodes
        return node * self.ranks_per_node + rank % self.ranks_per_node


def node_layout(config: SnapshotConfig, world: int) -> NodeLayout:
    """Ranks per node (config, else torchrun's ``LOCAL_WORLD_SIZE``) and the buddy shift; ``ConfigError`` if
    the world is not whole nodes."""
    per_node = config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise ConfigError(f"{world} ranks are not whole nodes of {per_node} ranks (ranks_per_node); snapshots pair "
                          "nodes of equal size: pass ranks_per_node dividing the world size")
    nodes = world // per_node
    switch = config.nodes_per_switch or 1
    shift = 0 if nodes == 1 else (switch if switch < nodes else 1)
    return NodeLayout(world=world, ranks_per_node=per_node, shift=shift)


def best_interval(config: SnapshotConfig, plan: Plan, layout: NodeLayout) -> int:
    """The reliability model's best ``k`` for ``plan`` on this many ranks (``cost_models.reliability``)."""
    mtbf_s = config.mtbf_hours * 3600 if config.mtbf_hours else job_mtbf_s(LLAMA3_GPU_MTBF_S, layout.world)
    _, chosen = snapshot_plan(plan.param_count, num_devices=layout.world, devices_per_node=layout.ranks_per_node,
                              step_time_s=plan.estimate.step_time_s, mtbf_s=mtbf_s, host_rate=_host_rate(plan))
    return chosen.every_steps


def _host_rate(plan: Plan) -> SnapshotWork | None:
    """What a snapshot's work costs training where the plan trains on CPU ranks (its cluster's profiled rate,
    ``reliability.host_snapshot_rate``); ``None`` on accelerators. A cluster file no longer readable here is
    priced at the CPU preset's rate, and said."""
    if plan.device_name != LOCAL_CPU:
        return None
    try:
        device = load_cluster(plan.cluster).device
    except (ClusterSpecError, OSError) as exc:
        log.warning("snapshot interval: cluster %s unreadable (%s); pricing snapshots at the cpu preset's "
                    "unprofiled rate", plan.cluster, exc)
        device = load_cluster("cpu").device
    return host_snapshot_rate(device)


def default_store() -> Path:
    """``/dev/shm/tessera-snapshots-<uid>/<run id>``, the run id being torchrun's (stable across restarts)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        raise ConfigError("snapshots need a store folder that outlives the processes: run under torchrun (its "
                          "--rdzv-id names the store) or pass SnapshotConfig(store=...)")
    return default_store_parent() / run_id


def default_store_parent() -> Path:
    """The folder of this user's default stores, one per run (``default_store``)."""
    return SNAPSHOT_ROOT / f"tessera-snapshots-{os.getuid()}"
