"""In-memory snapshots: every ``k`` steps each rank's training state goes to host memory on its own node and on a
buddy node, so a failure costs the steps since the last snapshot, not a disk checkpoint interval.

**What a snapshot is.** Exactly what a disk checkpoint holds (``runtime.checkpoint``: model and optimizer shards
in DCP's format, every rank's RNG, the step, the data position, the plan), written with DCP into a node-local
store in host memory (``runtime.snapshot_store``; ``/dev/shm`` by default) instead of a shared file system. Each
rank writes its own DCP files into its node's store; rank 0's ``.metadata`` lists every rank's chunks. Because
the format is DCP's, a snapshot reshards on load exactly as a disk checkpoint does (``runtime.snapshot_recovery``).

**Redundancy.** Each rank sends its files to the rank with the same local index on its *buddy node*: node ``n``'s
buddy is ``(n + s) % nodes``, where ``s`` is the number of nodes under one switch when the cluster has a level
between node and fabric (the copy then crosses switches: one switch failing never takes both), else 1. A
shift is a permutation, so each node also holds exactly one other node's files. One node lost: every file
still exists on a survivor. A node and its buddy lost together: the snapshot is incomplete and recovery falls
back to the newest disk checkpoint, saying why. One node only: no buddy, snapshots survive process failures.

**Off the critical path.** At a snapshot step the training thread only copies the state into a staging buffer
(allocated once, reused: ``copy_`` of every tensor) and records RNG and data position; a background thread
then writes the DCP files, hashes them, exchanges them with the buddy (gloo send/recv) and commits, on a
process group of its own, so its collectives never interleave with training's. At most one snapshot is in
flight: if the previous one is still being written at the next snapshot step, training waits for it.

**Commit.** A snapshot exists only once every rank has written and replicated its files: the ranks then agree
(one all-gather) and each node's leader writes the whole snapshot's manifest (every file's size and SHA-256,
over all ranks) and the ``COMPLETE`` marker, and renames its folder. Each store keeps the newest ``keep`` (2)
committed snapshots, so the previous one stays intact while the next is written (double buffering): a rank
killed mid-snapshot leaves an ignored partial folder and the previous snapshot is used.

**Host memory.** Per node: ``keep + 1`` copies (kept, plus the one in flight) of its own and its buddy's shards,
and each rank's staging buffer. Before the first snapshot is written the store's free space (tmpfs: host RAM) or
``host_memory_budget_bytes`` is checked against that, with a clear ``ConfigError`` otherwise.

**Clean finish.** ``ParallelModel.close()`` removes every snapshot and the store folder (if nothing else is in
it). A run that dies keeps its store: that is what its restart recovers from.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.tensor import DTensor

from tessera.errors import CheckpointError, ConfigError
from tessera.runtime.checkpoint import PendingSave, TrainingState, rng_state, training_tensors
from tessera.runtime.checkpoint_files import (
    DATA_FILE, PLAN_FILE, RNG_FOLDER, FileRecord, Manifest, all_gather, attempt, file_record, step_folder,
    together,
)
from tessera.runtime.snapshot_store import (
    commit_snapshot, free_bytes, open_store, partial_snapshot, remove_store, store_bytes,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
SNAPSHOT_ROOT = Path("/dev/shm")


class SnapshotConfig(BaseModel):
    """How often to snapshot and where this node's store lives."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    every: int = Field(default=1, ge=1)
    """Snapshot every ``every`` optimizer steps (``k``; ``tessera plan --mtbf-hours`` prints the best one)."""
    store: Path | None = None
    """This node's store folder; default ``/dev/shm/tessera-snapshots-<uid>/<torchrun run id>``."""
    ranks_per_node: int | None = Field(default=None, ge=1)
    """Ranks on each node; default torchrun's ``LOCAL_WORLD_SIZE`` (every rank on one node without it)."""
    nodes_per_switch: int | None = Field(default=None, ge=1)
    """Nodes under one switch: the buddy is that many nodes away (default 1: the next node)."""
    keep: int = Field(default=2, ge=1)
    """Committed snapshots each store keeps (2: the previous one stays while the next is written)."""
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


def default_store() -> Path:
    """``/dev/shm/tessera-snapshots-<uid>/<run id>``, the run id being torchrun's (stable across restarts)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        raise ConfigError("snapshots need a store folder that outlives the processes: run under torchrun (its "
                          "--rdzv-id names the store) or pass SnapshotConfig(store=...)")
    return SNAPSHOT_ROOT / f"tessera-snapshots-{os.getuid()}" / run_id


class Snapshotter:
    """A ``ParallelModel``'s snapshots: the staging buffer, the snapshot in flight and this node's store."""

    def __init__(self, config: SnapshotConfig, *, data_state: Callable[[], Any] | None = None) -> None:
        self.config = config
        self.store = Path(config.store) if config.store is not None else default_store()
        """This node's store folder."""
        self._data_state = data_state
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        """The process group snapshots (and their recovery) use, apart from training's."""
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.layout = node_layout(config, dist.get_world_size(self.group) if self.group is not None else 1)
        self._lock = agree(lambda: open_store(self.store) if self.layout.is_leader(self.rank) else None,
                           self.group, what=f"opening snapshot store {self.store}")
        self._staged: dict[str, Any] | None = None
        self._live: dict[str, Any] | None = None
        self._live_key: tuple | None = None
        self._plan: tuple | None = None
        self._pending: PendingSave | None = None
        self._checked_memory = False
        if self.layout.shift == 0 and self.rank == 0:
            log.warning("snapshots: one node, no buddy to copy to; they survive a process failure, not the node's")

    def after_step(self, state: TrainingState) -> None:
        """Start a snapshot of ``state`` if its step is one (called by ``train_step`` on every rank)."""
        if state.step % self.config.every == 0:
            self.snapshot(state)

    def snapshot(self, state: TrainingState) -> PendingSave:
        """Stage ``state`` and write it in the background (after the previous snapshot is committed)."""
        self.wait()
        tensors = self._stage(self._live_tensors(state))
        if not self._checked_memory:
            self._check_host_memory(tensors)
            self._checked_memory = True
        side = {"rng": rng_state(), "data": self._data_state() if self._data_state else None,
                "plan": self._plan_json(state) if self.rank == 0 else None}
        step, strategy = state.step, state.plan.strategy.to_string()
        partial = partial_snapshot(self.store, step)
        future: Future = Future()

        def run() -> None:
            try:
                self._write(tensors, side, partial, step=step, strategy=strategy)
                future.set_result(None)
            except BaseException as error:  # surfaced by wait()
                future.set_exception(error)

        threading.Thread(target=run, name="tessera-snapshot", daemon=True).start()
        self._pending = PendingSave(step_folder(self.store, step), future)
        return self._pending

    def wait(self) -> Path | None:
        """Block until the snapshot in flight (if any) is committed on every node; its folder here."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def close(self) -> None:
        """A clean finish: wait for the snapshot in flight, then every node's leader removes its store."""
        try:
            self.wait()
        finally:
            together(lambda: self._remove_store() if self.layout.is_leader(self.rank) else None, self.group,
                     what=f"removing snapshot store {self.store}")
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    def _remove_store(self) -> None:
        remove_store(self.store)
        if self.config.store is None:  # the default store's per-user parent, once no run of this user needs it
            try:
                self.store.parent.rmdir()
            except OSError:
                pass

    # ---------------------------------------------------------------------------------------- training thread

    def _plan_json(self, state: TrainingState) -> str:
        if self._plan is None or self._plan[0] is not state.plan:
            self._plan = (state.plan, state.plan.to_json())
        return self._plan[1]

    def _live_tensors(self, state: TrainingState) -> dict[str, Any]:
        """``training_tensors(state)``, rebuilt only when its layout may have changed: DCP's ``get_state_dict``
        costs far more than the copy, and between snapshots the same tensors are updated in place. Rebuilt when
        a parameter, buffer or optimizer-state tensor is another object or a param-group setting (lr...) changed."""
        key = _layout_key(state)
        if self._live is None or key != self._live_key:
            self._live, self._live_key = training_tensors(state), key
        return self._live

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``tensors`` that training cannot change: the staging buffer, refilled in place."""
        staged = self._staged
        if staged is None or not _same_layout(staged, tensors):
            staged = self._staged = _clone(tensors)
            return staged
        _copy_into(staged, tensors)
        return staged

    def _check_host_memory(self, tensors: dict[str, Any]) -> None:
        """``ConfigError`` on every rank if a node's store cannot hold ``keep + 1`` copies of its own and its
        buddy's shards (a ``together`` of each leader's verdict)."""
        layout, per_rank = self.layout, all_gather(_tensor_bytes(tensors), self.group)
        node = layout.node(self.rank)
        own = sum(b for r, b in enumerate(per_rank) if layout.node(r) == node)
        sender = (node - layout.shift) % layout.nodes
        buddy = sum(b for r, b in enumerate(per_rank) if layout.node(r) == sender) if layout.shift else 0
        need = (self.config.keep + 1) * (own + buddy)

        def check() -> None:
            if not layout.is_leader(self.rank):
                return
            budget = self.config.host_memory_budget_bytes
            have = budget if budget is not None else free_bytes(self.store) + store_bytes(self.store)
            if need > have:
                raise ConfigError(
                    f"snapshots need {need / 1e9:,.2f} GB of host memory on node {node} ({self.config.keep + 1} "
                    f"copies of its own {own / 1e9:,.2f} GB and its buddy's {buddy / 1e9:,.2f} GB of shards) but "
                    f"{'the budget is' if budget else f'store {self.store} has'} {have / 1e9:,.2f} GB; snapshot less "
                    "often does not help: raise the budget (or /dev/shm's size), shard the state over more ranks, "
                    "or train without snapshots")

        agree(check, self.group, what=f"checking the free space of snapshot store {self.store}")

    # ---------------------------------------------------------------------------------------- background thread

    def _write(self, tensors: dict[str, Any], side: dict[str, Any], partial: Path, *, step: int, strategy: str) -> None:
        """Write, hash and replicate this rank's files, then commit the snapshot on every node."""
        group = self.group

        def write_and_hash() -> dict[str, FileRecord]:
            (partial / RNG_FOLDER).mkdir(parents=True, exist_ok=True)
            names = [f"{RNG_FOLDER}/rank-{self.rank:05d}.pt"]
            torch.save(side["rng"], partial / names[0])
            if self.rank == 0:
                (partial / PLAN_FILE).write_text(side["plan"])
                torch.save(side["data"], partial / DATA_FILE)
                names += [PLAN_FILE, DATA_FILE, ".metadata"]
            writer = FileSystemWriter(partial, sync_files=False)  # host memory: nothing to flush
            with warnings.catch_warnings():  # without a process group DCP warns it assumes one process: as asked
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.save(tensors, checkpoint_id=partial, storage_writer=writer, planner=SnapshotSavePlanner(),
                         process_group=group, no_dist=group is None)
            names += sorted(p.name for p in partial.glob(f"__{self.rank}_*.distcp"))
            return {name: file_record(partial / name) for name in names}

        shares = gathered(write_and_hash, group, what=f"writing snapshot {partial}")  # one collective: files, errors
        mine = shares[self.rank]
        files = {name: record for share in shares for name, record in share.items()}
        if self.layout.shift:
            together(lambda: self._replicate(mine, files, partial), group, what=f"copying snapshot {partial} to buddies")
        manifest = Manifest(step=step, world_size=self.layout.world, strategy=strategy, saved_unix_s=time.time(),
                            files=dict(sorted(files.items())))
        together(lambda: commit_snapshot(partial, manifest, keep=self.config.keep)
                 if self.layout.is_leader(self.rank) else None, group, what=f"committing snapshot {partial}")

    def _replicate(self, mine: dict[str, FileRecord], files: dict[str, FileRecord], partial: Path) -> None:
        """Send this rank's files to its partner on the buddy node; receive and check the files of the rank whose
        buddy this node is."""
        layout = self.layout
        source = layout.partner(self.rank, offset=-layout.shift)
        theirs = _files_of(source, files)
        outgoing = _pack(partial, sorted(mine))
        incoming = torch.empty(sum(files[name].size_bytes for name in theirs), dtype=torch.uint8)
        ops = [dist.P2POp(dist.isend, outgoing, layout.partner(self.rank, offset=layout.shift), group=self.group),
               dist.P2POp(dist.irecv, incoming, source, group=self.group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        _unpack(incoming, theirs, files, partial)


# ------------------------------------------------------------------------------------------------ helpers


def _layout_key(state: TrainingState) -> tuple:
    """What makes a cached ``training_tensors(state)`` stale: the identity of every parameter, buffer and
    optimizer-state tensor, and every param-group setting."""
    optimizer = state.optimizer
    groups = tuple((tuple(map(id, group["params"])), repr(sorted((k, v) for k, v in group.items() if k != "params")))
                   for group in optimizer.param_groups)
    states = tuple(id(value) for entry in optimizer.state.values() for value in entry.values())
    buffers = tuple(id(buffer) for module in state.modules for buffer in module.buffers())
    return groups, states, buffers


def _clone(tensors: Any) -> Any:
    if isinstance(tensors, dict):
        return {key: _clone(value) for key, value in tensors.items()}
    if isinstance(tensors, torch.Tensor):
        return tensors.detach().clone()
    return tensors


def _copy_into(staged: dict[str, Any], tensors: dict[str, Any]) -> None:
    with torch.no_grad():
        for key, value in tensors.items():
            if isinstance(value, dict):
                _copy_into(staged[key], value)
            elif isinstance(value, torch.Tensor):
                _local(staged[key]).copy_(_local(value))
            else:
                staged[key] = value  # a float or int of the optimizer's param groups (lr, betas...)


def _same_layout(staged: dict[str, Any], tensors: dict[str, Any]) -> bool:
    if staged.keys() != tensors.keys():
        return False
    for key, value in tensors.items():
        old = staged[key]
        if isinstance(value, dict):
            if not isinstance(old, dict) or not _same_layout(old, value):
                return False
        elif isinstance(value, torch.Tensor):
            if not isinstance(old, torch.Tensor) or type(old) is not type(value) or \
                    _local(old).shape != _local(value).shape or old.dtype != value.dtype:
                return False
    return True


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensor_bytes(tensors: Any) -> int:
    if isinstance(tensors, dict):
        return sum(_tensor_bytes(value) for value in tensors.values())
    if isinstance(tensors, torch.Tensor):
        local = _local(tensors)
        return local.numel() * local.element_size()
    return 0


def _files_of(rank: int, files: dict[str, FileRecord]) -> list[str]:
    """The snapshot files ``rank`` writes: its DCP data files and RNG; rank 0 also metadata, plan, data."""
    shared = (".metadata", PLAN_FILE, DATA_FILE)
    return sorted(name for name in files if name.startswith(f"__{rank}_") or name == f"{RNG_FOLDER}/rank-{rank:05d}.pt"
                  or (rank == 0 and name in shared))


def _pack(folder: Path, names: list[str]) -> torch.Tensor:
    data = b"".join((folder / name).read_bytes() for name in names)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _unpack(buffer: torch.Tensor, names: list[str], files: dict[str, FileRecord], folder: Path) -> None:
    """Write the received ``names`` into ``folder``; raise if one does not hash as its writer recorded."""
    data, offset = buffer.numpy().tobytes(), 0
    for name in names:
        size = files[name].size_bytes
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[offset:offset + size])
        offset += size
        if file_record(path) != files[name]:
            raise OSError(f"snapshot file {name} arrived from the buddy node damaged (SHA-256 differs)")


class SnapshotSavePlanner(DefaultSavePlanner):
    """DCP's save planner with plan caching: every snapshot of a run has the same layout, so after the first one
    the ranks skip sending their plans to the coordinator. A class of its own because DCP keys its cache by the
    planner's class name (disk checkpoints keep theirs)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def gathered(action: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> list[T]:
    """Every rank's ``action()`` in rank order, in one collective; if it failed anywhere, the same
    ``CheckpointError`` on every rank."""
    shares = all_gather(attempt(action, group, what=what), group)
    problems = [problem for _, problem in shares if problem]
    if problems:
        raise CheckpointError(problems[0])
    return [value for value, _ in shares]


def agree(action: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> T:
    """``together(action)`` that raises a ``ConfigError`` from any rank as a ``ConfigError`` on every rank."""

    def guarded() -> tuple[T | None, str | None]:
        try:
            return action(), None
        except ConfigError as error:
            return None, str(error)

    value, problem = together(guarded, group, what=what)
    problems = [p for p in all_gather(problem, group) if p]
    if problems:
        raise ConfigError(problems[0])
    return value
