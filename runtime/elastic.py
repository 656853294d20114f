"""Elastic restarts: re-plan a run for the devices that remain and continue from its newest intact checkpoint.

Under torchrun's elastic mode (``torchrun --nnodes=MIN:MAX --max-restarts=N ...``) a failed rank or a lost
node stops every worker; torchrun re-runs the rendezvous with the agents still alive and starts the script
again with the new ``WORLD_SIZE``. A script written as::

    pm = tessera.auto_parallelize(model, "dgx-h100:nodes=4", global_batch=512, seq_len=4096, resume_from="ckpt")
    for step in range(pm.step, total_steps):
        pm.train_step(batches[step])
        if (step + 1) % 100 == 0:
            pm.save("ckpt", async_save=True)

therefore re-plans itself on every (re)start: with ``resume_from`` the cluster is fitted to the live world
(:func:`fit_cluster_to_world`: ``dgx-h100:nodes=4`` becomes ``dgx-h100:nodes=3`` when a node is gone), the
planner picks the best strategy for it, and :func:`resume_if_possible` loads the newest intact checkpoint
under that plan (``runtime.checkpoint`` reshards it). On the first start, with no checkpoint yet, it trains
from scratch, so one command serves the first launch and every restart.

Launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment (torch's own opt-out): by default
the workers of every rendezvous round share one store, hosted by the first round's rank-0 agent, and after a
restart the new ranks can read the gloo addresses the dead round left there and fail with "Connection
refused" (seen in ``tests/distributed/test_elastic.py``); with it each round's rank 0 hosts a fresh store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from tessera.runtime.checkpoint_files import PARTIAL_SUFFIX, has_checkpoint
from tessera.runtime.saved_plans import check_same_model
from tessera.topology import Cluster, load_cluster
from tessera.topology.presets import preset_names, preset_size_key

if TYPE_CHECKING:  # type names only: importing them pulls in DCP and pipelining, seconds that resume's CLI skips
    from tessera.runtime.checkpoint import CheckpointInfo
    from tessera.runtime.parallel_model import ParallelModel

log = logging.getLogger(__name__)


def live_world_size() -> int:
    """Ranks in the initialised process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fit_cluster_to_world(cluster: Cluster, world: int) -> Cluster:
    """``cluster`` resized to ``world`` devices of the same kind with the same link levels.

    A preset spec stays a preset spec (``cpu:ranks=4`` -> ``cpu:ranks=3``; ``dgx-h100:nodes=4`` ->
    ``dgx-h100:nodes=3`` when ``world`` is whole nodes), so the new plan still names a cluster that
    ``tessera launch`` can read; otherwise the cluster is copied with ``world`` devices.
    """
    if world == cluster.num_devices:
        return cluster
    spec = _resized_preset_spec(cluster, world)
    if spec is not None:
        return load_cluster(spec)
    levels = list(cluster.levels)
    if levels[-1].group_size < world:
        levels[-1] = levels[-1].model_copy(update={"group_size": world})
    return Cluster.model_validate(
        {**cluster.model_dump(), "name": f"{cluster.name} (resized to {world} devices)", "num_devices": world,
         "levels": levels}
    )


def _resized_preset_spec(cluster: Cluster, world: int) -> str | None:
    name, sep, _ = cluster.name.partition(":")
    if not sep or name not in preset_names():
        return None
    key = preset_size_key(name)
    per_unit = 1 if key == "ranks" else cluster.devices_per_node
    return f"{name}:{key}={world // per_unit}" if world % per_unit == 0 else None


def resume_if_possible(pm: ParallelModel, root: str | Path | None, *, verify: bool = True) -> CheckpointInfo | None:
    """Load the newest state into ``pm``: its newest complete in-memory snapshot when ``pm`` has snapshots
    (``runtime.snapshot_recovery``) and no disk checkpoint of ``root`` is newer, else the newest intact
    checkpoint of ``root``; ``None`` (train from scratch) if there is neither.

    Every rank takes rank 0's view of whether a checkpoint exists, so they all load or none does.
    """
    passed_over: list[str] = []
    if pm.snapshots is not None:
        from tessera.runtime.snapshot_recovery import recover_from_snapshots  # noqa: PLC0415 (DCP: seconds)

        info, passed_over = recover_from_snapshots(pm, pm.snapshots, disk_root=Path(root) if root else None)
        if info is not None:
            log.info("resumed from %s at step %d (saved under %s on %d ranks; now %s on %d)", info.path, info.step,
                     info.saved_strategy, info.saved_world_size, pm.plan.strategy.to_string(), pm.world_size)
            return info
    if root is None:
        return None
    info = _resume_from_disk(pm, root, verify=verify)
    if info is not None and passed_over:
        pm.resumed = info = info.model_copy(update={"skipped": (*passed_over, *info.skipped)})
    return info


def _resume_from_disk(pm: ParallelModel, root: str | Path, *, verify: bool) -> CheckpointInfo | None:
    exists = [has_checkpoint(root)]
    if dist.is_initialized():
        dist.broadcast_object_list(exists, src=0)
    if not exists[0]:
        partial = sorted(p.name for p in Path(root).glob(f".*{PARTIAL_SUFFIX}")) if Path(root).is_dir() else []
        if partial:  # a save was interrupted: say so, the run is not where the user may think it is
            log.warning("no complete checkpoint in %s (only %s, interrupted while being written): training from "
                        "scratch", root, ", ".join(partial))
        elif not Path(root).exists():  # a first run, or a mistyped folder: either way the user should see it
            log.warning("no checkpoint in %s (no such folder): training from scratch", root)
        else:
            log.info("no checkpoint in %s yet: training from scratch", root)
        return None
    check_same_model(pm.plan, root)
    info = pm.load(root, verify=verify)
    log.info("resumed from %s at step %d (saved under %s on %d ranks; now %s on %d)", info.path, info.step,
             info.saved_strategy, info.saved_world_size, pm.plan.strategy.to_string(), pm.world_size)
    return info
