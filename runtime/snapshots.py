"""In-memory snapshots: every ``k`` steps each rank's training state goes to host memory on its own node and on a
buddy node, so a failure costs the steps since the last snapshot, not a disk checkpoint interval.

**What a snapshot is.** What a disk checkpoint holds (``runtime.checkpoint``: this rank's shards of the model
and optimizer state, its RNG and learning-rate scheduler states, the step, the data position, the plan), as one file per rank in a
node-local store in host memory (``runtime.snapshot_store``; ``/dev/shm`` by default) instead of a shared file
system. The file (``runtime.snapshot_format``) is one flat buffer of the rank's chunks behind a JSON header
naming each chunk's tensor, global shape and offsets, so a snapshot reshards on load like a disk checkpoint
(``runtime.snapshot_recovery``); a chunk several ranks hold (replicas) is written by one of them. Rank 0 also
writes the plan and the data position.

**Redundancy.** Each rank sends its files to the rank with the same local index on its *buddy node*: node ``n``'s
buddy is ``(n + s) % nodes``, where ``s`` is the number of nodes under one switch when the cluster has a level
between node and fabric (the copy then crosses switches: one switch failing never takes both), else 1. A
shift is a permutation, so each node also holds exactly one other node's files. One node lost: every file
still exists on a survivor. A node and its buddy lost together: the snapshot is incomplete and recovery falls
back to the newest disk checkpoint, saying why. One node only: no buddy, snapshots survive process failures.

**Off the critical path.** At a snapshot step the training thread only copies the state into a staging buffer
(``snapshot_staging.StagedShards``: the rank's whole file -- header built once, chunks behind it -- allocated once,
pinned where there is a GPU, refilled by one ``_foreach_copy_``; the learning rate and the scheduler's state,
which change every step, rewrite only the header's tail) and records the data position; a background
thread then writes that buffer as the rank's file, hashes it from memory, agrees with the other ranks, sends it
to the buddy and commits, on a process group of its own, so its collectives never interleave with training's.
That thread runs at the lowest CPU priority (nice 19, ``background_nice``), and so do gloo's threads for its
group (created from it): where training keeps every core busy, it yields to training. At most one snapshot is in
flight: if the previous one is still being written at the next snapshot step, training waits for it (the
staging buffer is free again only then; skipping that step instead would need every rank to decide alike, which
costs a collective on the training thread). Where the ranks train on the host's own cores (CPU ranks), off the
critical path still means on training's cores: the reliability model prices such a snapshot at its whole work, as
``tessera profile`` measures it (``DeviceSpec.snapshot_bytes_per_s``), and the default ``every`` follows.

**One collective per snapshot** (``runtime.snapshot_table``). Where training saturates the host's cores (CPU
training), each collective of the snapshot thread is CPU taken from training (measured on 4 gloo ranks: ~0.4 ms of CPU per rank for a flag
all-reduce, ~3 ms for an object all-gather; ``benchmarks/snapshot_overhead.py``). So a snapshot runs exactly one
collective, besides the copy to the buddy: an all-reduce of a small integer table in which each rank fills its
own row -- whether it failed (writing this snapshot, or copying or committing the previous one), and its files'
sizes and hashes (XXH3-128, ``file_records.DIGESTS``; rank 0 also its clock, the manifest's time). The sum is
every row on every rank: every leader writes the same manifest, each rank knows what its buddy partner will send,
and a failure anywhere raises the same ``CheckpointError`` on every rank. Then each rank swaps files with its buddy
partners (one gloo send/recv pair) and each node's leader commits; a failure of that copy or commit is reported by
the next snapshot's all-reduce (or by ``close``), one snapshot later than it happened.

**Commit.** A node's leader commits a snapshot once every rank has written its own file (the all-reduce says so)
and it has copied its own share: it writes the whole snapshot's manifest (every rank's files: size and hash)
and the ``COMPLETE`` marker, and renames the folder. The other ranks of the node write the files they receive
through a handle on the folder opened before that rename, so they land in the committed folder whenever they
arrive. A committed folder's manifest is final but its files are each checked at recovery (size and hash,
``snapshot_store.held_files``): a file still missing or torn -- its writer killed in the copy -- is simply not
held there, and recovery takes the newest step every file of which some store holds intact. Snapshot ``N``'s
all-reduce also proves that every rank finished snapshot ``N - 1`` -- its own file and its copy -- without error,
so once ``N`` is committed ``N - 1`` is complete on every node; each store keeps the newest ``keep`` (at least 2)
committed snapshots, so a complete one always remains while the next is written (double buffering): a rank
killed mid-snapshot leaves an ignored partial folder (or an incomplete newest step) and the previous snapshot is
used.

**Host memory.** Per node: ``keep + 1`` copies (kept, plus the one in flight) of its own and its buddy's shards,
and each rank's staging buffer. Before the first snapshot is written the store's free space (tmpfs: host RAM) or
``host_memory_budget_bytes`` is checked against that, with a clear ``ConfigError`` otherwise.

**Clean finish.** ``ParallelModel.close()`` removes every snapshot and the store folder (if nothing else is in
it). A run that dies keeps its store: that is what its restart recovers from.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from tessera.errors import CheckpointError, ConfigError
from tessera.planner.plan import Plan
from tessera.runtime.background import in_worker, start_worker
from tessera.runtime.checkpoint import PendingSave, TrainingState, training_tensors
from tessera.runtime.checkpoint_files import step_folder
from tessera.runtime.snapshot_config import SnapshotConfig, best_interval, default_store, node_layout
from tessera.runtime.file_records import FileRecord
from tessera.runtime.rank_agreement import all_gather, attempt, together
from tessera.runtime.snapshot_format import shard_file
from tessera.runtime.snapshot_staging import StagedShards
from tessera.runtime.snapshot_store import (
    MappedFiles, commit_snapshot, free_bytes, open_store, open_store_file, partial_snapshot, remove_store, reuse_spare,
    store_bytes,
)
from tessera.runtime.snapshot_table import agree_on_table, share_sizes, side_files, snapshot_record, table_manifest

log = logging.getLogger(__name__)
T = TypeVar("T")
class Snapshotter:
    """A ``ParallelModel``'s snapshots: the staging buffer, the snapshot in flight and this node's store."""

    def __init__(self, config: SnapshotConfig, *, data_state: Callable[[], Any] | None = None,
                 plan: Plan | None = None) -> None:
        """``plan``: the run's, from which the default ``every`` is chosen (required when ``config.every`` is
        ``None``)."""
        if config.every is None and plan is None:
            raise ConfigError("snapshots need an interval: pass SnapshotConfig(every=k), or enable them on a "
                              "ParallelModel (its plan's step time chooses k)")
        self.store = Path(config.store) if config.store is not None else default_store()
        """This node's store folder."""
        self._data_state = data_state
        self._worker = start_worker(config.background_nice, name="tessera-snapshot")
        """The background thread's inbox (one thread for the run: starting one per snapshot costs the training
        thread a handshake)."""
        self.group = in_worker(self._worker, _new_group)
        """The process group snapshots (and their recovery) use, apart from training's; created on the background
        thread, so that gloo's threads for it inherit its lowest CPU priority."""
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.layout = node_layout(config, dist.get_world_size(self.group) if self.group is not None else 1)
        self.config = config if config.every is not None else config.model_copy(
            update={"every": self._agreed_interval(config, plan)})
        """The configuration, with ``every`` chosen where it was not given."""
        if self.rank == 0 and config.every is None:
            log.info("snapshots: every %d step(s), the reliability model's best interval for this plan",
                     self.config.every)
        self._lock = agree(lambda: open_store(self.store) if self.layout.is_leader(self.rank) else None,
                           self.group, what=f"opening snapshot store {self.store}")
        self._staged: StagedShards | None = None
        self._staged_key: tuple | None = None
        self._writers: dict = {}
        """Which rank writes each chunk, per chunk list (``snapshot_staging.StagedShards``)."""
        source = self.layout.partner(self.rank, offset=-self.layout.shift) if self.layout.shift else self.rank
        self._arriving_files = MappedFiles(mappings=(self.config.keep + 2) * (1 + len(side_files(source))))
        """The files the buddy partner's snapshots arrive in, mapped into memory (background thread only): its
        snapshot file and side files, in each of the ``keep + 1`` snapshots a store rotates through and the spare."""
        self._plan: tuple | None = None
        self._pending: PendingSave | None = None
        self._checked_memory = False
        self._last_take: tuple[int, int] = (-1, 0)
        """(step, take) of the last snapshot: a step snapshotted again gets a partial folder of its own."""
        self._carried: str | None = None
        """This rank's failure copying or committing the last snapshot: reported by the next agreement (the
        background thread's; read elsewhere only while no snapshot is in flight)."""
        self.background_cpu_s = 0.0
        """CPU seconds the background thread has spent writing, copying and committing snapshots (its own time,
        ``time.thread_time``; gloo's threads and the training thread's staging are not in it)."""
        self.taken = 0
        """Snapshots started."""
        self.training_thread_s = 0.0
        """Seconds the training thread spent in ``snapshot``: waiting for the one before, then staging."""
        if self.layout.shift == 0 and self.rank == 0:
            log.warning("snapshots: one node, no buddy to copy to; they survive a process failure, not the node's")

    def _agreed_interval(self, config: SnapshotConfig, plan: Plan) -> int:
        """Rank 0's ``best_interval`` on every rank: ranks on other hosts may read the plan's cluster file
        differently (or not at all), and every rank must snapshot at the same steps."""
        chosen = torch.tensor([best_interval(config, plan, self.layout) if self.rank == 0 else 0])
        if self.group is not None:
            dist.broadcast(chosen, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(chosen)

    def after_step(self, state: TrainingState) -> None:
        """Start a snapshot of ``state`` if its step is one (called by ``train_step`` on every rank)."""
        if state.step % self.config.every == 0:
            self.snapshot(state)

    def snapshot(self, state: TrainingState) -> PendingSave:
        """Stage ``state`` and write it in the background (after the previous snapshot is done)."""
        entered = time.perf_counter()
        self.wait()
        staged = self._staged_for(state)
        if not self._checked_memory:
            self._check_host_memory(staged.nbytes)
            self._checked_memory = True
        side = {"data": self._data_state() if self._data_state else None,
                "plan": self._plan_bytes(state) if self.rank == 0 else None}
        step, strategy = state.step, state.plan.strategy.to_string()
        # A step taken again (no training step between) is written to a partial folder of its own: a rank ahead
        # of its leader would otherwise join the previous take's partial, which the leader is about to commit as
        # this step's folder and then replace with this take's.
        take = self._last_take[1] + 1 if self._last_take[0] == step else 0
        self._last_take = (step, take)
        partial = partial_snapshot(self.store, step, take=take)
        future: Future = Future()

        def run() -> None:
            started = time.thread_time()
            try:
                self._write(staged, side, partial, step=step, strategy=strategy)
                future.set_result(None)
            except BaseException as error:  # surfaced by wait()
                future.set_exception(error)
            finally:
                self.background_cpu_s += time.thread_time() - started

        self._worker.put(run)
        self._pending = PendingSave(step_folder(self.store, step), future)
        self.taken += 1
        self.training_thread_s += time.perf_counter() - entered
        return self._pending

    def wait(self) -> Path | None:
        """Block until this rank's part of the snapshot in flight (if any) is done: its file written and copied
        to the buddy node, and on a node's leader the node's commit; the folder it has (or will have) here. A
        failure of another rank's copy or commit is raised on every rank by the next snapshot or by ``close``."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def close(self) -> None:
        """A clean finish: wait for the snapshot in flight, agree that every rank is done with it (raising on
        every rank its copy or commit failure, if any rank had one), then every node's leader removes its store;
        rank 0 logs what the snapshots cost it (measured: what the cost model's price can be checked against)."""
        try:
            self.wait()
            if self.rank == 0 and self.taken:
                log.info("snapshots: %d taken, every %d step(s); per snapshot %.1f ms on the training thread (waiting "
                         "for the one before, staging) and %.1f ms of the background thread's CPU", self.taken,
                         self.config.every, 1e3 * self.training_thread_s / self.taken,
                         1e3 * self.background_cpu_s / self.taken)
        finally:
            carried, self._carried = self._carried, None
            try:
                problems = [p for p in all_gather(carried, self.group) if p]  # also: no rank still writes
                if problems:
                    raise CheckpointError(problems[0])
            finally:
                self._arriving_files.close()
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

    def _plan_bytes(self, state: TrainingState) -> tuple[bytes, FileRecord]:
        """The plan's JSON and its record, made once per plan."""
        if self._plan is None or self._plan[0] is not state.plan:
            content = state.plan.to_json().encode()
            self._plan = (state.plan, (content, snapshot_record(content)))
        return self._plan[1]

    def _staged_for(self, state: TrainingState) -> StagedShards:
        """The staging buffer of ``state``, refilled: rebuilt only when its layout may have changed (DCP's
        ``get_state_dict`` costs far more than the copy, and between snapshots the same tensors are updated in
        place), i.e. when a parameter, buffer or optimizer-state tensor is another object or a param group
        another set of parameters or settings, or when the new settings or scheduler state do not fit its header
        (``StagedShards.refill``)."""
        key = _layout_key(state)
        groups = state.optimizer.param_groups
        scheduler = state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None  # checked when built
        if self._staged is not None and key == self._staged_key and self._staged.refill(groups, scheduler):
            return self._staged
        self._staged = StagedShards(training_tensors(state), self.group, assignments=self._writers,
                                    param_groups=groups, lr_scheduler=scheduler)
        self._staged_key = key
        if not self._staged.refill(groups, scheduler):  # cannot happen: the new header was made for these
            raise CheckpointError("a new snapshot staging buffer refused its own settings; report this as a bug")
        return self._staged

    def _check_host_memory(self, nbytes: int) -> None:
        """``ConfigError`` on every rank if a node's store cannot hold ``keep + 1`` copies of its own and its
        buddy's shards (a ``together`` of each leader's verdict)."""
        layout, per_rank = self.layout, all_gather(nbytes, self.group)
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

    def _write(self, staged: StagedShards, side: dict[str, Any], partial: Path, *, step: int, strategy: str) -> None:
        """Write this rank's files (rank 0: also the plan and data position), agree (the one all-reduce), copy
        them to the buddy partner and take the partner's, commit on a node's leader. The folder is held open
        from before the agreement, so that files arriving after the leader's rename still land in it."""
        files, problem = attempt(lambda: self._write_own(staged, side, partial), self.group,
                                 what=f"writing snapshot {partial}")
        folder, pieces, records = files if files is not None else (None, [], {})
        try:
            carried, self._carried = self._carried, None
            table = agree_on_table(records, problem or carried, rank=self.rank, world=self.layout.world,
                                   group=self.group)
            _, self._carried = attempt(lambda: self._exchange(pieces, table, folder), self.group,
                                       what=f"copying snapshot {partial} to the buddy node")
            if self.layout.is_leader(self.rank):
                manifest = table_manifest(table, step=step, world=self.layout.world, strategy=strategy)
                _, problem = attempt(lambda: commit_snapshot(partial, manifest, keep=self.config.keep), self.group,
                                     what=f"committing snapshot {partial}")
                self._carried = self._carried or problem
        finally:
            if folder is not None:
                os.close(folder)

    def _write_own(self, staged: StagedShards, side: dict[str, Any],
                   partial: Path) -> tuple[int, list[torch.Tensor], dict[str, FileRecord]]:
        """This rank's files, written into ``partial``: a handle on the folder, the files' contents (the pieces
        sent to the buddy: the staged file, then rank 0's plan and data position) and their records."""
        partial.mkdir(parents=True, exist_ok=True)
        folder = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
        try:
            reuse_spare(self.store, shard_file(self.rank), folder, shard_file(self.rank))
            if self.layout.shift:  # the file the buddy partner will send, overwritten once it has arrived
                source = self.layout.partner(self.rank, offset=-self.layout.shift)
                reuse_spare(self.store, shard_file(source), folder, _arriving(shard_file(source)))
            _write_file(folder, shard_file(self.rank), staged.file)
            pieces, records = [staged.file], {shard_file(self.rank): staged.record()}
            if self.rank == 0:
                data = io.BytesIO()
                torch.save(side["data"], data)
                for name, (content, record) in zip(side_files(0), (side["plan"], (data.getvalue(), None))):
                    _write_file(folder, name, content)
                    records[name] = record or snapshot_record(content)
                    pieces.append(torch.frombuffer(bytearray(content), dtype=torch.uint8))
        except BaseException:
            os.close(folder)
            raise
        return folder, pieces, records

    def _exchange(self, pieces: list[torch.Tensor], table: torch.Tensor, folder: int) -> None:
        """Send ``pieces`` (this rank's files) to the partner on the buddy node, and receive the files of the
        rank whose buddy this node is (their sizes: the table's) straight into their mapped pages. Not hashed on
        arrival: recovery checks every file against the manifest's hash before using it
        (``snapshot_store.held_files``)."""
        layout = self.layout
        if not layout.shift:
            return
        target, source = layout.partner(self.rank, offset=layout.shift), layout.partner(self.rank, offset=-layout.shift)
        names = [shard_file(source), *side_files(source)]
        sizes = share_sizes(table, source, world=layout.world)
        incoming, problem = [], None
        for name, size in zip(names, sizes):
            try:
                incoming.append(self._arriving_files.open(folder, _arriving(name), size))
            except OSError as error:  # still received (into a buffer, then dropped): the partner's send must end
                problem = problem or error
                incoming.append(torch.empty(size, dtype=torch.uint8))
        self._swap([p for p in pieces if p.numel()], [p for p in incoming if p.numel()], target, source)
        if problem is not None:
            raise problem
        for name in names:  # under a temporary name until whole: never a torn final name
            os.rename(_arriving(name), name, src_dir_fd=folder, dst_dir_fd=folder)

    def _swap(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor], target: int, source: int) -> None:
        ops = [dist.P2POp(dist.isend, piece, target, group=self.group) for piece in outgoing]
        ops += [dist.P2POp(dist.irecv, piece, source, group=self.group) for piece in incoming]
        for request in dist.batch_isend_irecv(ops) if ops else ():
            request.wait()


# ------------------------------------------------------------------------------------------------ helpers


def _layout_key(state: TrainingState) -> tuple:
    """What makes a cached ``training_tensors(state)`` stale: the identity of every parameter, buffer and
    optimizer-state value, and the names of every param group's settings (their values are the header's tail)."""
    optimizer = state.optimizer
    groups = tuple((tuple(map(id, group["params"])), tuple(k for k in group if k != "params"))
                   for group in optimizer.param_groups)
    states = tuple(id(value) for entry in optimizer.state.values() for value in entry.values())
    buffers = tuple(id(buffer) for module in state.modules for buffer in module.buffers())
    return groups, states, buffers


def _new_group() -> dist.ProcessGroup | None:
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def _write_file(folder: int, name: str, content: torch.Tensor | bytes) -> None:
    """Write ``content`` as file ``name`` of the open folder ``folder`` (``os.write`` of one view: no copy), over
    the bytes of a recycled file where there is one (``snapshot_store.reuse_spare``: not truncated first, so its
    pages are reused; cut to size after)."""
    view = memoryview(content.numpy() if isinstance(content, torch.Tensor) else content).cast("B")
    size = len(view)
    handle = open_store_file(folder, name, os.O_WRONLY)
    try:
        while view:
            view = view[os.write(handle, view):]
        if os.fstat(handle).st_size > size:
            os.ftruncate(handle, size)
    finally:
        os.close(handle)


def _arriving(name: str) -> str:
    """The temporary name of file ``name`` while it arrives from the buddy partner."""
    return f".{name}.arriving"


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
