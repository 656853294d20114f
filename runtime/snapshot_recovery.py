"""Recovery from in-memory snapshots after an elastic restart (``runtime.snapshots`` writes them).

Every rank calls :func:`recover_from_snapshots` (``runtime.elastic.resume_if_possible`` does, before it looks at
the disk): each node's leader lists the committed snapshots of its store and the files of each it holds intact
(size and hash against the manifest); the ranks share these lists and pick the newest step for which every
file of the whole snapshot is held by *some* surviving node. If a disk checkpoint is newer, or no step is
complete (a node and its buddy were lost together, or every store is gone), it says why and returns ``None``:
the caller loads the newest intact disk checkpoint instead.

To load a step, each rank first works out which files it reads: every file's chunk list (its JSON header, read
by the first leader holding the file) is shared, and each rank takes the file of its RNG and scheduler states
(its own under the same world size, else rank 0's, as ``runtime.checkpoint`` does), then, for every saved chunk
that overlaps one of its shards under the new plan, one file holding it (``snapshot_format.files_to_read``), and
rank 0's plan and data position. Each node's leader assembles the files its node's ranks read in its store
(``store/recovery/step-N``): hard links to those it holds, and those it lacks sent point to point by a leader
holding them, checked against the manifest's hash. Before anything is written it checks that its store has
room for what it lacks; if a node has not, recovery says so and the newest intact disk
checkpoint is loaded instead. Every rank then reads its files (``runtime.snapshot_format``: JSON headers and raw
bytes, nothing that runs code), copies into its state the parts of the saved chunks its own shards cover
(resharding; ``load_shards`` checks that they cover every tensor), sets the optimizer state as a disk checkpoint
does (``set_state_dict``), and restores the RNG and learning-rate scheduler states, the step and the data position
(``torch.load`` with ``weights_only=True``). The folder is removed afterwards, and so are snapshots newer than the
step loaded (a past the run no longer continues from).

Cost: a node holds what its ranks read. Under the same plan that is each rank's own file (a node and its buddy
hold them: nothing crosses the network but what the lost node held); under a new plan, the old files its new
shards overlap. Every rank receives every file's chunk list, which grows with ranks times tensors (as DCP's
metadata does); a file travels only to the nodes that read it and lack it.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_state_dict

from tessera.errors import CheckpointError
from tessera.planner.plan import Plan
from tessera.runtime.checkpoint import STATE_OPTIONS, CheckpointInfo, state_module, training_tensors
from tessera.runtime.checkpoint_files import (
    DATA_FILE, MANIFEST, MARKER, PLAN_FILE, Manifest, complete_checkpoints, step_folder, step_of,
)
from tessera.runtime.file_records import matches, sha256_text
from tessera.runtime.lr_schedule import restore_scheduler
from tessera.runtime.rank_agreement import all_gather, barrier, broadcast, together
from tessera.runtime.saved_plans import check_same_model
from tessera.runtime.snapshot_format import (
    SHARD_SUFFIX, SavedKeys, Shard, files_to_read, held_boxes, load_shards, shard_file, state_boxes,
)
from tessera.runtime.snapshot_store import (
    RECOVERY_FOLDER, RECOVERY_PREFIX, committed_snapshots, discard_newer, free_bytes, held_files,
)
from tessera.runtime.tied_state import read_from_partners, restore_names

if TYPE_CHECKING:
    from tessera.runtime.parallel_model import ParallelModel
    from tessera.runtime.snapshots import Snapshotter

log = logging.getLogger(__name__)


class Holdings(dict):
    """One store's view: ``{step: (manifest JSON text, names held intact)}``."""


def recover_from_snapshots(
    pm: ParallelModel, snapshots: Snapshotter, *, disk_root: Path | None
) -> tuple[CheckpointInfo | None, list[str]]:
    """Load the newest complete snapshot into ``pm`` unless a disk checkpoint is newer (call on every rank).

    Returns what was loaded (``None``: use the disk) and why newer snapshots were passed over."""
    group, rank, layout = snapshots.group, snapshots.rank, snapshots.layout
    mine = together(lambda: _holdings(snapshots.store) if layout.is_leader(rank) else None, group,
                    what=f"reading snapshot store {snapshots.store}")
    stores = {r: held for r, held in enumerate(all_gather(mine, group)) if held is not None}
    chosen, passed_over = _newest_complete(stores)
    disk_step = broadcast(_newest_disk_step(disk_root) if rank == 0 else None, group)
    if chosen is None or (disk_step is not None and disk_step > chosen[0].step):
        why = "; ".join(passed_over) or f"no snapshot in any surviving store ({len(stores)} node(s) asked)"
        if chosen is not None:
            why = f"disk checkpoint step {disk_step} is newer than snapshot step {chosen[0].step}"
        if rank == 0 and disk_step is None:  # a first start, or nothing usable anywhere
            where = f" in {disk_root}" if disk_root is not None else ""
            (log.warning if passed_over else log.info)(
                "snapshots: %s; no disk checkpoint%s either: training starts from scratch", why, where)
        elif rank == 0:
            log.warning("snapshots: %s; loading the newest intact disk checkpoint of %s instead", why, disk_root)
        together(lambda: discard_newer(snapshots.store, -1) if layout.is_leader(rank) else None, group,
                 what="discarding unusable snapshots")
        return None, passed_over or [why]
    manifest, text, holders = chosen
    # this rank's state under the new plan, once: what it needs and what the load fills (the optimizer's state is
    # initialised by it, then overwritten)
    tensors = together(lambda: training_tensors(pm), group, what="listing this rank's shards")
    chunks = _saved_chunks(snapshots, manifest, holders)
    renamed = read_from_partners(tensors, SavedKeys(chunks), ties=pm.tied_names)  # a tied weight saved under one name
    needed = _needed_files(tensors, snapshots, manifest, chunks)
    short = _room_problems(snapshots, manifest, text, stores, needed)
    if short:
        if rank == 0:
            log.warning("snapshots: %s; loading the newest intact disk checkpoint of %s instead", short[0], disk_root)
        together(lambda: discard_newer(snapshots.store, -1) if layout.is_leader(rank) else None, group,
                 what="discarding unusable snapshots")
        return None, [*passed_over, short[0]]
    folder = _assemble(snapshots, manifest, text, holders, stores, needed)

    info = together(lambda: _load(pm, folder, manifest, group, needed[rank], tensors, renamed), group,
                    what=f"loading snapshot {folder}")
    barrier(group)  # every rank of the node has read the folder before its leader removes it
    together(lambda: _after_load(snapshots.store, manifest.step) if layout.is_leader(rank) else None, group,
             what="removing the assembled snapshot")
    info = info.model_copy(update={"path": f"snapshot step-{manifest.step:08d} in {snapshots.store}",
                                   "skipped": tuple(passed_over)})
    pm.resumed = info
    return info, passed_over


def _load(pm: ParallelModel, folder: Path, manifest: Manifest, group: dist.ProcessGroup | None,
          needed: set[str], tensors: dict, renamed: dict) -> CheckpointInfo:
    """Restore ``pm`` from the files it ``needed`` of the assembled snapshot ``folder`` (each already checked against
    the manifest; ``load_shards`` checks that they cover every tensor); ``renamed``: the tied copies ``tensors``
    lists under their partner's name (``runtime.tied_state``)."""
    check_same_model(pm.plan, folder, saved=Plan.from_json(folder / PLAN_FILE))
    shards = {name: Shard(folder / name) for name in sorted(needed) if name.endswith(SHARD_SUFFIX)}
    load_shards(tensors, list(shards.values()))
    restore_names(tensors, renamed)
    set_state_dict(state_module(pm.modules), pm.optimizer, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optim"], options=STATE_OPTIONS)
    own = shards[_state_source(manifest, group)]
    _restore_rng(own)
    restore_scheduler(pm.lr_scheduler, own.lr_scheduler(), source=f"snapshot file {own.path}",
                      groups=len(pm.optimizer.param_groups))
    pm.step = manifest.step
    return CheckpointInfo(path=str(folder), step=manifest.step, saved_world_size=manifest.world_size,
                          saved_strategy=manifest.strategy,
                          data_state=torch.load(folder / DATA_FILE, weights_only=True))


def _state_source(manifest: Manifest, group: dist.ProcessGroup | None) -> str:
    """The file whose RNG and scheduler states this rank takes: its own under the same world size, else rank 0's."""
    same_world = manifest.world_size == (dist.get_world_size(group) if group is not None else 1)
    return shard_file(dist.get_rank(group) if same_world and group is not None else 0)


def _saved_chunks(snapshots: Snapshotter, manifest: Manifest, holders: dict[str, int]) -> dict[str, list]:
    """Per shard file of the snapshot, its state chunks by key and box (every file's header, read by the first
    leader holding it and shared)."""
    group, rank = snapshots.group, snapshots.rank
    folder = step_folder(snapshots.store, manifest.step)

    def read_headers() -> dict[str, list]:
        return {name: state_boxes(Shard(folder / name)) for name, holder in sorted(holders.items())
                if holder == rank and name.endswith(SHARD_SUFFIX)}

    headers = together(read_headers, group, what=f"reading snapshot {folder}")
    return {name: boxes for part in all_gather(headers, group) for name, boxes in part.items()}


def _needed_files(tensors: dict, snapshots: Snapshotter, manifest: Manifest,
                  chunks: dict[str, list]) -> dict[int, set[str]]:
    """Per rank, the files of the snapshot it reads: the file of its RNG and scheduler states, then for every saved
    chunk (``chunks``: per file) that overlaps one of its shards under the new plan one file holding it, and rank
    0's plan and data position."""
    group = snapshots.group
    folder = step_folder(snapshots.store, manifest.step)

    def choose() -> set[str]:
        mine = files_to_read(held_boxes(tensors), chunks, first=_state_source(manifest, group))
        return mine | {name for name in manifest.files if not name.endswith(SHARD_SUFFIX)}

    mine = together(choose, group, what=f"choosing the files of snapshot {folder} to read")  # a failure: on all
    return dict(enumerate(all_gather(sorted(mine), group)))


def _restore_rng(shard: Shard) -> None:
    tensors, python = shard.rng()
    try:
        torch.set_rng_state(tensors["rng.cpu"].clone())
        random.setstate(python)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"snapshot file {shard.path} holds no usable RNG state ({error})") from None
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k].clone() for k in cuda])


def _holdings(store: Path) -> Holdings:
    holdings = Holdings()
    for folder in committed_snapshots(store):
        found = held_files(folder)
        if found is not None:
            holdings[step_of(folder)] = ((folder / MANIFEST).read_text(), sorted(found[1]))
    return holdings


def _newest_complete(stores: dict[int, Holdings]) -> tuple[tuple | None, list[str]]:
    """``(manifest, its text, {file: first leader rank holding it})`` of the newest step every file of which some
    store holds, and a reason for each newer step that is incomplete."""
    passed_over = []
    for step in sorted({step for held in stores.values() for step in held}, reverse=True):
        versions: dict[str, dict[int, list[str]]] = {}
        for leader, held in sorted(stores.items()):
            if step in held:
                text, names = held[step]
                versions.setdefault(text, {})[leader] = names
        for text, by_leader in versions.items():
            manifest = Manifest.model_validate_json(text)
            holders = {}
            for leader, names in by_leader.items():
                for name in names:
                    holders.setdefault(name, leader)
            missing = sorted(set(manifest.files) - set(holders))
            if not missing:
                return (manifest, text, holders), passed_over
            passed_over.append(
                f"snapshot step {step} lacks {len(missing)} of its {len(manifest.files)} files on every surviving "
                f"node ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): the node that wrote them and "
                "its buddy are both gone")
    return None, passed_over


def _room_problems(snapshots: Snapshotter, manifest: Manifest, text: str, stores: dict[int, Holdings],
                   needed: dict[int, set[str]]) -> list[str]:
    """Every node's lack of room for the files its ranks need and its store lacks (received from other nodes),
    agreed on every rank: checked before anything is written, so that a full store means the disk checkpoint, not a
    restart that fails again at every try."""
    group, rank, layout, store = snapshots.group, snapshots.rank, snapshots.layout, snapshots.store
    problem = None
    if layout.is_leader(rank):
        lacking = sum(manifest.files[name].size_bytes for name in _node_needs(layout, rank, needed)
                      - _own_files(stores, rank, manifest.step, text))
        free = free_bytes(store)
        if lacking > free:
            problem = (f"assembling snapshot step {manifest.step} needs {lacking / 1e9:,.2f} GB more in node "
                       f"{layout.node(rank)}'s store {store} (the files its ranks read that it lacks), which has "
                       f"{free / 1e9:,.2f} GB free; give the store more room (/dev/shm: mount -o remount,size=...): "
                       "until then the disk checkpoints are the line of defence")
    return [p for p in all_gather(problem, group) if p]


def _newest_disk_step(root: Path | None) -> int | None:
    folders = complete_checkpoints(Path(root)) if root is not None else []
    return step_of(folders[0]) if folders else None


def _assemble(snapshots: Snapshotter, manifest: Manifest, text: str, holders: dict[str, int],
              stores: dict[int, Holdings], needed: dict[int, set[str]]) -> Path:
    """Every leader's ``store/recovery/step-N``: the files its node's ranks need, linked where it holds them intact,
    received from a node that does otherwise."""
    group, rank, store, step, layout = snapshots.group, snapshots.rank, snapshots.store, manifest.step, snapshots.layout
    leader = rank if layout.is_leader(rank) else None
    partial = store / f"{RECOVERY_PREFIX}{step:08d}.partial"
    final = step_folder(store / RECOVERY_FOLDER, step)
    wants = {r: _node_needs(layout, r, needed) for r in stores}
    own = _own_files(stores, leader, step, text) & wants[leader] if leader is not None else set()
    together(lambda: _link_own(store, partial, step, own) if leader is not None else None, group,
             what=f"assembling snapshot step {step} in {store}")
    transfers = [(name, holders[name], r) for name in sorted(manifest.files) for r in sorted(stores)
                 if name in wants[r] and name not in _own_files(stores, r, step, text)]
    together(lambda: _transfer(transfers, manifest, own=step_folder(store, step), write_to=partial, rank=rank,
                               group=group), group, what=f"receiving the files of snapshot step {step} nodes lack")

    def commit() -> None:
        if leader is None:
            return
        (partial / MANIFEST).write_text(text)
        (partial / MARKER).write_text(sha256_text(text))
        final.parent.mkdir(exist_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)

    together(commit, group, what=f"assembling snapshot step {step} in {store}")
    return final


def _own_files(stores: dict[int, Holdings], leader: int, step: int, text: str) -> set[str]:
    """The files of snapshot ``step`` (manifest ``text``) that ``leader``'s store holds intact; none where its
    step-N is another version of the step."""
    held = stores.get(leader, Holdings()).get(step)
    return set(held[1]) if held is not None and held[0] == text else set()


def _node_needs(layout, leader: int, needed: dict[int, set[str]]) -> set[str]:
    """What the ranks of ``leader``'s node read."""
    return set().union(*(names for r, names in needed.items() if layout.node(r) == layout.node(leader)))


def _link_own(store: Path, partial: Path, step: int, names: set[str]) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    source = step_folder(store, step)
    for name in names:
        target = partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / name, target)
        except OSError:
            shutil.copyfile(source / name, target)


def _transfer(transfers: list[tuple[str, int, int]], manifest: Manifest, *, own: Path, write_to: Path, rank: int,
              group: dist.ProcessGroup | None) -> None:
    """Each ``(file, from leader, to leader)`` of ``transfers``, read from the sender's ``own`` step folder and
    written by the receiver into ``write_to``, checked against the manifest. Every rank takes them in the same order
    and each waits only for its two ranks, so the earliest unfinished one always has both ready: no deadlock. A
    damaged arrival is raised after the last transfer, so that no rank leaves its peers waiting."""
    problem = None
    for name, source, target in transfers:
        if rank not in (source, target):
            continue
        record = manifest.files[name]
        if rank == source:
            if record.size_bytes and group is not None:
                data = torch.frombuffer(bytearray((own / name).read_bytes()), dtype=torch.uint8)
                dist.send(data, dst=dist.get_global_rank(group, target), group=group)
            continue
        buffer = torch.empty(record.size_bytes, dtype=torch.uint8)
        if record.size_bytes and group is not None:
            dist.recv(buffer, src=dist.get_global_rank(group, source), group=group)
        path = write_to / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buffer.numpy().tobytes())
        if not matches(path, record):
            problem = problem or f"snapshot file {name} arrived damaged from rank {source} ({record.hash_name} differs)"
    if problem:
        raise CheckpointError(problem)


def _after_load(store: Path, step: int) -> None:
    shutil.rmtree(store / RECOVERY_FOLDER, ignore_errors=True)
    discard_newer(store, step)
