"""Reliability cost: what checkpoints cost at a given interval and what failures cost for a given MTBF.

Pure arithmetic on numbers (and a device's profiled rates); no torch. The model is the classic first-order one of checkpoint/restart:

- a checkpoint every ``tau`` seconds of training costs ``delta`` seconds of blocked training each time;
- failures arrive at random with mean time between failures ``M`` (of the whole job: a job on ``n`` devices
  fails ``n`` times as often as one device, :func:`job_mtbf_s`);
- each failure costs the restart ``R`` (relaunch, re-plan, load) plus the work since the last committed
  checkpoint: on average half an interval, ``(tau + delta) / 2``, plus, with asynchronous saves, the time a
  checkpoint takes to commit after training resumed (the one being written is not yet usable).

Fraction of wall time lost (:func:`expected_waste_fraction`)::

    W(tau) = delta / (tau + delta) + (R + (tau + delta) / 2 + commit_lag) / M

Minimising ``delta / tau + tau / (2 M)`` gives Young's interval ``tau = sqrt(2 delta M)`` (J. W. Young, "A
first order approximation to the optimum checkpoint interval", Communications of the ACM 17(9):530-531,
1974). Daly's higher-order estimate, accurate when ``delta`` is not small against ``M``:
``tau = sqrt(2 delta M) * (1 + sqrt(delta / (2 M)) / 3 + (delta / (2 M)) / 9) - delta`` for ``delta < 2 M``,
else ``tau = M`` (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3):303-312, 2006, eq. 37). :func:`optimal_interval_s` uses Daly's.

What a checkpoint costs (:func:`checkpoint_cost`): Tessera's checkpoints hold fp32 parameters and AdamW's
two fp32 moments, 12 bytes per parameter (``runtime.checkpoint``), written in parallel by every device (DCP
writes each shard once), so the write takes ``bytes / (devices * per-device bandwidth)``, or longer when the
storage system's aggregate bandwidth is the limit. A synchronous save blocks training for the whole write;
an asynchronous one (``dcp.async_save``) only for the copy to host memory, and the write overlaps the next
steps, unless it takes longer than the interval, in which case the next save waits for the rest.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from tessera.topology.cluster import DeviceSpec
from tessera.topology.hardware import LOCAL_CPU

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
CHECKPOINT_BYTES_PER_PARAM = 12
"""fp32 parameter + AdamW's fp32 exp_avg and exp_avg_sq (what ``runtime.checkpoint`` saves per parameter)."""
LLAMA3_STORAGE_BYTES_PER_S_PER_GPU = 2e12 / 16384
"""Sustained checkpoint write bandwidth per GPU in Meta's Llama 3 training: the Tectonic file system's
2 TB/s sustained throughput shared by 16K H100 GPUs (Llama Team, "The Llama 3 Herd of Models",
arXiv 2407.21783, Sec. 3.3.1). A conservative default when the storage is unknown."""
LLAMA3_GPU_MTBF_S = 54 * 24 * 3600 * 16384 / 419
"""Mean time between unexpected job interruptions per GPU in Llama 3 405B pre-training: 419 in a 54-day period on
16,384 H100 GPUs (Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783, Sec. 3.3.4), about 50,700
GPU-hours; a job on ``n`` GPUs fails ``n`` times as often (:func:`job_mtbf_s`). The default where the MTBF is
unknown."""
PCIE5_X16_BYTES_PER_S = 63e9
"""Device-to-host copy bandwidth for the staging of an asynchronous save: PCIe 5.0 x16, 32 GT/s x 16 lanes with
128b/130b encoding, about 63 GB/s per direction (PCI-SIG, PCI Express Base Specification 5.0)."""


class CheckpointCost(BaseModel):
    """What one checkpoint costs."""

    model_config = FROZEN

    total_bytes: float = Field(ge=0)
    """Bytes of the whole checkpoint (every device's shards together)."""
    write_time_s: float = Field(ge=0)
    """Time to write it, all devices in parallel."""
    staging_time_s: float = Field(ge=0)
    """Time to copy a device's shard to host memory (what an asynchronous save blocks for)."""
    asynchronous: bool
    """Whether the save is asynchronous (``dcp.async_save``)."""


class ReliabilityEstimate(BaseModel):
    """Checkpoint overhead and expected time lost to failures at one checkpoint interval."""

    model_config = FROZEN

    mtbf_s: float = Field(gt=0)
    """Mean time between failures of the whole job."""
    checkpoint: CheckpointCost
    """Cost of one checkpoint."""
    restart_s: float = Field(ge=0)
    """Time from a failure to training again (relaunch, re-plan, load), rework excluded."""
    interval_s: float = Field(gt=0)
    """Training time between checkpoints."""
    optimal_interval_s: float = Field(gt=0)
    """Daly's optimal interval for this checkpoint cost and MTBF."""
    blocking_s: float = Field(ge=0)
    """Training time each checkpoint blocks."""
    checkpoint_fraction: float = Field(ge=0)
    """Share of wall time spent blocked in checkpoints."""
    failure_fraction: float = Field(ge=0)
    """Share of wall time lost to failures (restart plus rework since the last committed checkpoint)."""

    @property
    def waste_fraction(self) -> float:
        """Share of wall time that makes no progress (at most 1)."""
        return min(1.0, self.checkpoint_fraction + self.failure_fraction)

    def summary(self, *, step_time_s: float | None = None) -> str:
        """Plain-text lines for the CLI (intervals also in steps when ``step_time_s`` is given)."""
        c = self.checkpoint
        kind = "async" if c.asynchronous else "sync"

        def steps(seconds: float) -> str:
            return f" ({seconds / step_time_s:,.0f} steps)" if step_time_s else ""

        return "\n".join([
            f"checkpoint {c.total_bytes / 1e9:,.1f} GB, write {c.write_time_s:,.1f} s, blocks training "
            f"{self.blocking_s:,.1f} s ({kind})",
            f"interval   every {self.interval_s / 60:,.1f} min{steps(self.interval_s)}; Young/Daly optimum "
            f"{self.optimal_interval_s / 60:,.1f} min{steps(self.optimal_interval_s)} "
            f"at MTBF {self.mtbf_s / 3600:,.1f} h",
            f"lost time  {self.waste_fraction:.1%} of wall time: checkpoints {self.checkpoint_fraction:.1%}, "
            f"failures {self.failure_fraction:.1%} (restart {self.restart_s / 60:,.1f} min + rework)",
        ])


def job_mtbf_s(device_mtbf_s: float, num_devices: int) -> float:
    """MTBF of a job that stops when any of ``num_devices`` independent devices fails."""
    return device_mtbf_s / num_devices


def checkpoint_cost(
    param_count: int, *, num_devices: int, write_bytes_per_s_per_device: float,
    aggregate_write_bytes_per_s: float | None = None, asynchronous: bool = False,
    staging_bytes_per_s: float = PCIE5_X16_BYTES_PER_S,
) -> CheckpointCost:
    """Bytes and time of one checkpoint of a ``param_count``-parameter model trained with AdamW."""
    total = param_count * CHECKPOINT_BYTES_PER_PARAM
    bandwidth = num_devices * write_bytes_per_s_per_device
    if aggregate_write_bytes_per_s is not None:
        bandwidth = min(bandwidth, aggregate_write_bytes_per_s)
    return CheckpointCost(total_bytes=total, write_time_s=total / bandwidth,
                          staging_time_s=total / num_devices / staging_bytes_per_s, asynchronous=asynchronous)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 * checkpoint cost * MTBF)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def optimal_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006, eq. 37): Young's interval with higher-order terms; ``MTBF`` when ``delta >= 2 MTBF``."""
    if checkpoint_s <= 0:
        raise ValueError("a checkpoint that costs nothing has no optimal interval: checkpoint every step")
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return young_interval_s(checkpoint_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


def blocking_time_s(cost: CheckpointCost, interval_s: float) -> float:
    """Training time one checkpoint blocks: the whole write (sync), else the staging copy plus any part of the
    write that the interval cannot hide (the next save waits for the previous one)."""
    if not cost.asynchronous:
        return cost.write_time_s
    return max(cost.staging_time_s, cost.write_time_s - interval_s)


def expected_waste_fraction(interval_s: float, *, blocking_s: float, restart_s: float, mtbf_s: float,
                            commit_lag_s: float = 0.0) -> tuple[float, float]:
    """(checkpoint share, failure share) of wall time: ``W(tau)`` of the module docstring, split in two."""
    period = interval_s + blocking_s
    return blocking_s / period, (restart_s + period / 2 + commit_lag_s) / mtbf_s


def reliability_estimate(
    cost: CheckpointCost, *, mtbf_s: float, interval_s: float | None = None, restart_s: float | None = None
) -> ReliabilityEstimate:
    """The estimate at ``interval_s`` (default: the optimal one). ``restart_s`` defaults to reading the
    checkpoint back (as long as writing it): add your scheduler's relaunch time to it."""
    blocking_at_optimum = cost.staging_time_s if cost.asynchronous else cost.write_time_s
    optimum = optimal_interval_s(max(blocking_at_optimum, 1e-9), mtbf_s)
    if cost.asynchronous:
        optimum = max(optimum, cost.write_time_s)  # shorter intervals queue the writes
    interval = optimum if interval_s is None else interval_s
    restart = cost.write_time_s if restart_s is None else restart_s
    blocking = blocking_time_s(cost, interval)
    lag = max(0.0, cost.write_time_s - cost.staging_time_s) if cost.asynchronous else 0.0
    checkpoint_share, failure_share = expected_waste_fraction(interval, blocking_s=blocking, restart_s=restart,
                                                              mtbf_s=mtbf_s, commit_lag_s=lag)
    return ReliabilityEstimate(
        mtbf_s=mtbf_s, checkpoint=cost, restart_s=restart, interval_s=interval, optimal_interval_s=optimum,
        blocking_s=blocking, checkpoint_fraction=checkpoint_share, failure_fraction=failure_share,
    )


# ------------------------------------------------------------------------------------------------ in-memory snapshots
# ``runtime.snapshots``: every ``k`` steps each device's shard is copied to host memory (blocking: the staging copy)
# and sent to a buddy node (overlapped with training). A failure of one node then costs the relaunch, fetching
# its shards back from the buddy, and on average half a snapshot period of rework; only a failure that also takes
# the buddy (probability ``p``) falls back to the disk checkpoint, so the disk interval is Daly's for an MTBF of
# ``M / p``. ``k`` minimises the snapshot share plus the failure share, as Young's interval does for disk.
# Bytes: every chunk of the state is written once, by one of the ranks holding it (``runtime.snapshot_format``
# de-duplicates replicas; replicas of at most 1 KiB, optimizer steps and the like, by every holder: negligible),
# so each device stages and sends ``12 * params / devices`` bytes whatever the plan.
# Where the devices are the host's own cores (CPU ranks, ``local-cpu``), nothing of a snapshot overlaps for free:
# its file write, hash and buddy swap run on the cores training uses, so training pays the whole work
# (:func:`host_snapshot_rate`). ``benchmarks/snapshot_overhead.py`` sets this price beside the measured overhead: on
# 4 ranks on 2 cores it was 0.7-1.3 of what training lost for 16 MB snapshots, about half for 0.8 MB ones in 20 ms
# steps (the probe leaves out the runtime's own Python per snapshot), where the chosen ``k`` errs small.

INFINIBAND_NDR_BYTES_PER_S = 400e9 / 8
"""One InfiniBand NDR port: 400 Gb/s (InfiniBand Trade Association roadmap); a node's snapshot to its buddy
crosses at least one such link."""
SNAPSHOT_KEEP = 2
"""Committed snapshots each store keeps (``runtime.snapshots.SnapshotConfig.keep``)."""
SNAPSHOT_COPY_PASSES = 5
"""Bytes read plus written per byte of state in a snapshot's own work: the staging copy (2), the file write (2) and
the hash (1); over the memory bandwidth, an unprofiled CPU rank's rate for it. A bound the real work does not
reach: file pages cost more than a plain copy."""
SWAP_COPY_PASSES = 4
"""The same for the swap with a buddy: sending (2) and receiving (2)."""


class SnapshotWork(NamedTuple):
    """What a snapshot's work costs a rank where training runs on the host's cores, every rank at once."""

    fixed_s: float
    """Per snapshot, whatever its size (a collective, file operations)."""
    bytes_per_s: float
    """Its own work per byte of state: staging copy, store-file write, hash."""
    swap_bytes_per_s: float | None
    """The swap with the buddy per byte (``None``: not charged; :func:`host_snapshot_rate` gives an unmeasured one
    from the memory bandwidth)."""


def host_snapshot_rate(device: DeviceSpec) -> SnapshotWork | None:
    """What a snapshot's work costs per rank where ``device`` is the host's CPU (training pays for it:
    :func:`snapshot_cost`'s ``host_rate``): as ``tessera profile`` measured it, else the copy passes at the memory
    bandwidth; ``None`` for an accelerator, whose host's cores are free."""
    if device.name != LOCAL_CPU:
        return None
    bound = device.memory_bandwidth_bytes_per_s
    if device.snapshot_bytes_per_s is None:
        return SnapshotWork(0.0, bound / SNAPSHOT_COPY_PASSES, bound / SWAP_COPY_PASSES)
    return SnapshotWork(device.snapshot_fixed_s, device.snapshot_bytes_per_s,  # given together (DeviceSpec)
                        device.snapshot_swap_bytes_per_s or bound / SWAP_COPY_PASSES)


class SnapshotCost(BaseModel):
    """What one in-memory snapshot costs and holds."""

    model_config = FROZEN

    node_bytes: float = Field(ge=0)
    """One snapshot of one node's shards (its devices' share of parameters and AdamW state)."""
    host_bytes_per_node: float = Field(ge=0)
    """Host memory a node needs: ``keep + 1`` copies of its own and its buddy's shards, plus the staging copy."""
    staging_time_s: float = Field(ge=0)
    """Copy of a device's shard to host memory: what training waits for."""
    replicate_time_s: float = Field(ge=0)
    """Sending the node's shards to its buddy (overlapped with the next steps); 0 without a buddy."""
    recovery_time_s: float = Field(ge=0)
    """Fetching a lost node's shards back from its buddy and copying them to the devices."""
    has_buddy: bool
    """Whether there is another node to copy to (one node: snapshots survive process failures only)."""
    host_work_s: float = Field(default=0.0, ge=0)
    """Where training runs on the host's cores (CPU ranks): a rank's whole snapshot work (staging, file write,
    hash, buddy swap, agreement), every rank at once, all of it training's time; 0 where a device trains."""

    def training_pays_s(self, period_s: float = math.inf) -> float:
        """What one snapshot every ``period_s`` of training costs it: on CPU ranks the whole work (the swap's
        included); else the staging copy, plus any replication the period cannot hide."""
        if self.host_work_s:
            return self.host_work_s
        return self.staging_time_s + max(0.0, self.replicate_time_s - period_s)


def snapshot_cost(
    param_count: int, *, num_devices: int, devices_per_node: int, staging_bytes_per_s: float = PCIE5_X16_BYTES_PER_S,
    network_bytes_per_s_per_node: float = INFINIBAND_NDR_BYTES_PER_S, keep: int = SNAPSHOT_KEEP,
    host_rate: SnapshotWork | None = None,
) -> SnapshotCost:
    """Bytes, memory and times of one snapshot of a ``param_count``-parameter model trained with AdamW;
    ``host_rate``: what the work costs per rank where training runs on the host's cores (:func:`host_snapshot_rate`;
    the swap only where there is a buddy)."""
    per_device = param_count * CHECKPOINT_BYTES_PER_PARAM / num_devices
    node = per_device * min(devices_per_node, num_devices)
    has_buddy = num_devices > devices_per_node
    replicate = node / network_bytes_per_s_per_node if has_buddy else 0.0
    staging = per_device / staging_bytes_per_s
    host_work = 0.0
    if host_rate is not None:
        if host_rate.bytes_per_s <= 0 or (host_rate.swap_bytes_per_s or 1) <= 0 or host_rate.fixed_s < 0:
            raise ValueError(f"snapshot work rates must be positive and its fixed cost at least 0: {host_rate}")
        swap = per_device / host_rate.swap_bytes_per_s if has_buddy and host_rate.swap_bytes_per_s else 0.0
        host_work = host_rate.fixed_s + per_device / host_rate.bytes_per_s + swap
        staging = 0.0  # no device-to-host copy: the state is in host memory, and its copy is in host_work
    return SnapshotCost(
        node_bytes=node, host_bytes_per_node=(keep + 1) * node * (2 if has_buddy else 1) + node,
        staging_time_s=staging, replicate_time_s=replicate, recovery_time_s=replicate + staging, has_buddy=has_buddy,
        host_work_s=host_work,
    )


class SnapshotEstimate(BaseModel):
    """Time lost to failures with in-memory snapshots (every ``every_steps``) and disk as the second line, against
    disk checkpoints alone."""

    model_config = FROZEN

    every_steps: int = Field(ge=1)
    """Snapshot interval ``k`` in steps (chosen to minimise the waste unless given)."""
    step_time_s: float = Field(gt=0)
    """Training step time."""
    snapshot: SnapshotCost
    """Cost of one snapshot."""
    blocking_s: float = Field(ge=0)
    """Training time each snapshot blocks: the staging copy, plus any replication the interval cannot hide."""
    buddy_loss_probability: float = Field(ge=0, le=1)
    """Chance that a failure also loses the buddy's copy (or there is no buddy): then the disk checkpoint is used."""
    lost_per_failure_s: float = Field(ge=0)
    """Expected time one failure costs with snapshots (restart + rework; the disk's share weighted by its chance)."""
    disk_only: ReliabilityEstimate
    """Disk checkpoints alone (the interval asked for, or Daly's)."""
    disk_second_line: ReliabilityEstimate
    """Disk checkpoints beside snapshots: Daly's interval for the failures snapshots cannot recover."""
    waste_fraction: float = Field(ge=0, le=1)
    """Share of wall time that makes no progress with snapshots (snapshots, disk saves, failures)."""

    @property
    def disk_only_lost_per_failure_s(self) -> float:
        """Expected time one failure costs with disk checkpoints alone."""
        return self.disk_only.failure_fraction * self.disk_only.mtbf_s

    def summary(self) -> str:
        """Plain-text lines for ``tessera plan --mtbf-hours`` (after the disk-only lines)."""
        s, gb = self.snapshot, 1e9
        buddy = (f"copied to a buddy node in {s.replicate_time_s:,.2f} s (overlapped)" if s.has_buddy
                 else "one node: no buddy, survive process failures only")
        what = "its whole work: training runs on the host's cores" if s.host_work_s else "copy to host"
        return "\n".join([
            f"snapshots  every {self.every_steps} step(s) in host memory: {s.node_bytes / gb:,.1f} GB per node, "
            f"{s.host_bytes_per_node / gb:,.1f} GB of host RAM per node; blocks training {self.blocking_s:,.3f} s "
            f"each ({what}), {buddy}",
            f"disk       second line every {_duration(self.disk_second_line.interval_s)} (for failures that also "
            f"lose the buddy's copy: {self.buddy_loss_probability:.2%} of them)",
            f"per failure {self.lost_per_failure_s / 60:,.1f} min lost with snapshots vs "
            f"{self.disk_only_lost_per_failure_s / 60:,.1f} min with disk checkpoints alone",
            f"lost time  {self.waste_fraction:.1%} of wall time with snapshots vs {self.disk_only.waste_fraction:.1%} "
            "with disk checkpoints alone",
        ])


def _duration(seconds: float) -> str:
    """Minutes below two hours, else hours (a second line every 0.0 h says nothing)."""
    return f"{seconds / 60:,.1f} min" if seconds < 2 * 3600 else f"{seconds / 3600:,.1f} h"


def snapshot_estimate(
    snapshot: SnapshotCost, disk_only: ReliabilityEstimate, *, step_time_s: float, num_nodes: int,
    relaunch_s: float = 0.0, every_steps: int | None = None, correlated_fraction: float = 0.0,
) -> SnapshotEstimate:
    """Snapshots every ``every_steps`` (default: the best ``k``) beside disk checkpoints costing as in ``disk_only``.

    ``relaunch_s``: scheduler relaunch and re-plan time, paid by every failure. ``correlated_fraction``: share of
    failures that take a node and its buddy at once (a shared switch or power feed, a job-wide kill; default 0:
    independent node failures, for which the buddy must fail within the window before the restarted run's first
    snapshot is replicated)."""
    if not 0 <= correlated_fraction <= 1:
        raise ValueError(f"correlated_fraction={correlated_fraction} must be between 0 and 1")
    mtbf = disk_only.mtbf_s
    candidates = [every_steps] if every_steps is not None else _snapshot_candidates(snapshot, step_time_s, mtbf)
    options = [_snapshot_option(snapshot, disk_only, k, step_time_s=step_time_s, num_nodes=num_nodes,
                                relaunch_s=relaunch_s, correlated=correlated_fraction) for k in candidates]
    return min(options, key=lambda option: option.waste_fraction)


def _snapshot_candidates(snapshot: SnapshotCost, step_time_s: float, mtbf_s: float) -> list[int]:
    """Around Young's ``k`` for what training pays, and the smallest ``k`` whose interval hides the replication."""
    young = young_interval_s(max(snapshot.training_pays_s(), 1e-12), mtbf_s) / step_time_s
    hides = math.ceil(snapshot.replicate_time_s / step_time_s)
    return sorted({1, max(1, math.floor(young)), max(1, math.ceil(young)), max(1, hides)})


def _snapshot_option(snapshot: SnapshotCost, disk_only: ReliabilityEstimate, k: int, *, step_time_s: float,
                     num_nodes: int, relaunch_s: float, correlated: float) -> SnapshotEstimate:
    mtbf, period = disk_only.mtbf_s, k * step_time_s
    blocking = snapshot.training_pays_s(period)
    rework = (period + blocking) / 2 + snapshot.replicate_time_s  # the snapshot in flight is not yet usable
    from_snapshot = relaunch_s + snapshot.recovery_time_s + rework
    if snapshot.has_buddy:  # the buddy (one of num_nodes, each failing at 1 / (M * num_nodes)) within the window
        independent = 1 - math.exp(-(from_snapshot + period) / (mtbf * num_nodes))
        p = correlated + (1 - correlated) * independent
    else:
        p = 1.0
    second = reliability_estimate(disk_only.checkpoint, mtbf_s=mtbf / p if p > 0 else mtbf * 1e12,
                                  restart_s=disk_only.restart_s)
    from_disk = second.failure_fraction * second.mtbf_s
    lost = (1 - p) * from_snapshot + p * from_disk
    waste = blocking / (period + blocking) + second.checkpoint_fraction + lost / mtbf
    return SnapshotEstimate(
        every_steps=k, step_time_s=step_time_s, snapshot=snapshot, blocking_s=blocking, buddy_loss_probability=p,
        lost_per_failure_s=lost, disk_only=disk_only, disk_second_line=second, waste_fraction=min(1.0, waste),
    )


def snapshot_plan(
    param_count: int, *, num_devices: int, devices_per_node: int, step_time_s: float, mtbf_s: float,
    write_bytes_per_s_per_device: float = LLAMA3_STORAGE_BYTES_PER_S_PER_GPU, asynchronous: bool = False,
    disk_interval_s: float | None = None, relaunch_s: float = 0.0, every_steps: int | None = None,
    host_rate: SnapshotWork | None = None,
) -> tuple[ReliabilityEstimate, SnapshotEstimate]:
    """Disk checkpoints alone (every ``disk_interval_s``, default Daly's) and in-memory snapshots every
    ``every_steps`` (default: the best ``k``) beside them, for a job of ``num_devices`` with this step time and
    MTBF: what ``tessera plan --mtbf-hours`` prints, and ``SnapshotConfig``'s default ``every``. ``host_rate``:
    where training runs on the host's cores (:func:`host_snapshot_rate`)."""
    cost = checkpoint_cost(param_count, num_devices=num_devices, write_bytes_per_s_per_device=write_bytes_per_s_per_device,
                           asynchronous=asynchronous)
    disk_only = reliability_estimate(cost, mtbf_s=mtbf_s, interval_s=disk_interval_s,
                                     restart_s=cost.write_time_s + relaunch_s)
    snapshot = snapshot_cost(param_count, num_devices=num_devices, devices_per_node=devices_per_node, host_rate=host_rate)
    nodes = max(1, num_devices // devices_per_node)
    return disk_only, snapshot_estimate(snapshot, disk_only, step_time_s=step_time_s, num_nodes=nodes,
                                        relaunch_s=relaunch_s, every_steps=every_steps)
