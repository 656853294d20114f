"""A checkpoint on disk: its folder layout, its manifest, how it is committed atomically, and how a damaged one
is detected. The save/load flow that fills these folders is ``runtime.checkpoint``.

**Layout.** One folder per saved step under the root the caller chose::

    root/
      step-00000012/            committed (its name says so; the COMPLETE marker proves it)
        .metadata  __0_0.distcp  __1_0.distcp ...   DCP's files: tensor metadata, one data file per rank
        plan.json               the plan it was saved under
        data.pt                 the caller's data position (``data_state``)
        rng/rank-00000.pt ...   every rank's RNG states
        manifest.json           every file above: size and SHA-256
        COMPLETE                the SHA-256 of manifest.json
      .step-00000016.partial/   being written (or interrupted): never loaded

**Manifest.** :class:`Manifest` records the step, the world size and strategy that wrote the checkpoint, and a
:class:`FileRecord` (size, SHA-256) for every other file, keyed by relative POSIX path.

**Atomic commit** (:func:`commit_checkpoint`). Files go to ``root/.step-00000012.partial``. Once every rank's
files and DCP's ``.metadata`` exist, the ranks hash the files (each a share), rank 0 writes ``manifest.json``,
then the ``COMPLETE`` marker (the manifest's own hash), each fsynced before the next so the marker never reaches
the disk before what it vouches for, and renames the folder to ``root/step-00000012`` (and fsyncs the root, so
the rename survives a power loss). A crash at any point leaves either the previous checkpoints untouched plus an
ignored partial folder, or the new one complete.

**Detecting damage** (:func:`check_checkpoint`). A folder is loadable when it is not ``.partial``, has the
marker, its manifest parses and hashes to the marker's content, and every file the manifest lists exists with
its recorded size (always checked) and SHA-256 (with ``verify=True``; each rank hashes a share). Every problem is
reported by file. Given the root folder, :func:`select_checkpoint` takes the newest intact checkpoint and names
the newer ones it skipped and why.

Every function taking ``group`` runs on every rank of it (rank 0 lists and decides, all ranks share the
hashing) and returns the same answer everywhere; ``group=None`` means this process alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from tessera.errors import CheckpointError

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
PARTIAL_SUFFIX = ".partial"
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"
DATA_FILE = "data.pt"
RNG_FOLDER = "rng"
FORMAT_VERSION = 1
HASH_BLOCK_BYTES = 1 << 24
FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class FileRecord(BaseModel):
    """One file of a checkpoint as it was written."""

    model_config = FROZEN

    size_bytes: int
    """Length of the file."""
    sha256: str
    """SHA-256 of its content (hex)."""


class Manifest(BaseModel):
    """Written by rank 0 after every file exists and before the ``COMPLETE`` marker."""

    model_config = FROZEN

    format_version: int = FORMAT_VERSION
    """Version of this layout."""
    step: int
    """Optimizer steps taken when the checkpoint was saved."""
    world_size: int
    """Ranks that wrote it."""
    strategy: str
    """The plan's strategy string (the whole plan is in ``plan.json``)."""
    saved_unix_s: float
    """When it was committed."""
    files: dict[str, FileRecord]
    """Every other file in the folder (relative POSIX path), with its size and hash."""


# ------------------------------------------------------------------------------------------------ layout


def step_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once committed."""
    return root / f"{STEP_PREFIX}{step:08d}"


def partial_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is committed."""
    return root / f".{STEP_PREFIX}{step:08d}{PARTIAL_SUFFIX}"


# ------------------------------------------------------------------------------------------------ commit


def commit_checkpoint(
    partial: Path, *, final: Path, step: int, strategy: str, group: dist.ProcessGroup | None, keep_last: int | None
) -> None:
    """Hash the files (a share per rank), then rank 0 writes manifest and marker and renames the folder."""
    names = broadcast(_list_files(partial) if rank(group) == 0 else None, group)
    mine = {name: _file_record(partial / name) for name in names[rank(group)::world(group)]}
    files = {name: record for share in all_gather(mine, group) for name, record in share.items()}
    if rank(group) == 0:
        manifest = Manifest(step=step, world_size=world(group), strategy=strategy, saved_unix_s=time.time(),
                            files=dict(sorted(files.items())))
        text = manifest.model_dump_json(indent=2)
        write_durably(partial / MANIFEST, lambda path: path.write_text(text))
        write_durably(partial / MARKER, lambda path: path.write_text(_sha256_text(text)))
        os.replace(partial, final)
        _fsync_folder(final.parent)
        if keep_last is not None:
            _prune(final.parent, keep_last)
    barrier(group)  # nobody returns before the checkpoint is visible under its final name


def _prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest ``keep_last``."""
    for folder in complete_checkpoints(root)[keep_last:]:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ finding and checking


def select_checkpoint(path: Path, *, verify: bool, group: dist.ProcessGroup | None) -> tuple[Path, list[str]]:
    """The folder to load and the newer ones skipped; raises ``CheckpointError`` when none can be loaded.

    A ``step-*`` folder must itself be intact. A root folder yields its newest intact checkpoint.
    """
    if _is_checkpoint_folder(path):
        problem = check_checkpoint(path, verify=verify, group=group)
        if problem:
            raise CheckpointError(f"{problem}; {_previous_hint(path)}")
        return path, []
    candidates = broadcast(complete_checkpoints(path) if rank(group) == 0 else None, group)
    if not candidates:
        raise CheckpointError(_nothing_found(path))
    skipped = []
    for folder in candidates:
        problem = check_checkpoint(folder, verify=verify, group=group)
        if problem is None:
            if skipped and rank(group) == 0:
                log.warning("loading %s; skipped newer checkpoint(s): %s", folder, "; ".join(skipped))
            return folder, skipped
        skipped.append(problem)
    raise CheckpointError(f"no intact checkpoint in {path}: " + "; ".join(skipped))


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders under ``root`` (marker present; not yet verified), newest first."""
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / MARKER).exists()]
    return sorted(folders, key=lambda p: p.name, reverse=True)


def has_checkpoint(root: str | Path) -> bool:
    """Whether ``root`` is a committed checkpoint or holds one (so resuming from it can start)."""
    root = Path(root)
    return (root / MARKER).exists() or bool(complete_checkpoints(root))


def check_checkpoint(folder: Path, *, verify: bool, group: dist.ProcessGroup | None) -> str | None:
    """Why ``folder`` cannot be loaded (the same answer on every rank), or ``None`` when it is intact."""
    problem = broadcast(_manifest_problem(folder) if rank(group) == 0 else None, group)
    if problem:
        return problem
    manifest = read_manifest(folder)
    names = sorted(manifest.files)
    mine = [_file_problem(folder, name, manifest.files[name], verify=verify)
            for name in names[rank(group)::world(group)]]
    problems = [p for share in all_gather(mine, group) for p in share if p]
    return f"checkpoint {folder} is corrupt: {'; '.join(sorted(problems))}" if problems else None


def read_manifest(folder: Path) -> Manifest:
    """The manifest of a committed checkpoint."""
    return Manifest.model_validate_json((folder / MANIFEST).read_text())


def _manifest_problem(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"checkpoint {folder} does not exist"
    if folder.name.endswith(PARTIAL_SUFFIX) or not (folder / MARKER).exists():
        return (f"checkpoint {folder} is incomplete (no {MARKER} marker): it was interrupted while being "
                "written and is never loaded")
    try:
        text = (folder / MANIFEST).read_text()
        Manifest.model_validate_json(text)
    except (OSError, ValueError) as error:
        return f"checkpoint {folder} is corrupt: its {MANIFEST} is unreadable ({type(error).__name__})"
    if (folder / MARKER).read_text().strip() != _sha256_text(text):
        return f"checkpoint {folder} is corrupt: {MANIFEST} does not match the hash in its {MARKER} marker"
    return None


def _file_problem(folder: Path, name: str, record: FileRecord, *, verify: bool) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"file {name} is missing"
    size = path.stat().st_size
    if size != record.size_bytes:
        return f"file {name} has {size} bytes but {record.size_bytes} were written (truncated or overwritten)"
    if verify and _file_record(path).sha256 != record.sha256:
        return f"file {name} does not match the SHA-256 recorded when it was written (its bytes changed on disk)"
    return None


def _previous_hint(folder: Path) -> str:
    """Where to go instead of a broken ``folder``: the newest committed checkpoint before it."""
    older = [p for p in complete_checkpoints(folder.parent) if p.name < folder.name.lstrip(".")]
    if not older:
        return f"there is no complete checkpoint before it in {folder.parent}; start from scratch"
    return (f"the last complete checkpoint before it is {older[0]}: load that, or pass the folder {folder.parent} "
            "to load the newest intact one")


def _nothing_found(root: Path) -> str:
    if not root.exists():
        return f"checkpoint folder {root} does not exist; pass the folder given to ParallelModel.save"
    partial = sorted(p.name for p in root.iterdir() if p.name.endswith(PARTIAL_SUFFIX))
    found = f" (only {', '.join(partial)}: interrupted while being written)" if partial else ""
    return f"no complete checkpoint in {root}{found}; resume from an older copy or start from scratch"


def _is_checkpoint_folder(path: Path) -> bool:
    name = path.name.lstrip(".")
    return name.startswith(STEP_PREFIX) or (path / MANIFEST).exists() or (path / MARKER).exists()


# ------------------------------------------------------------------------------------------------ files


def write_durably(path: Path, write: Callable[[Path], Any]) -> None:
    """Write ``path`` with ``write(path)`` and fsync it, so a marker written later never precedes its data."""
    write(path)
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def _list_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _file_record(path: Path) -> FileRecord:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return FileRecord(size_bytes=path.stat().st_size, sha256=digest.hexdigest())


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _fsync_folder(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (POSIX: fsync the directory)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


# ------------------------------------------------------------------------------------------------ collectives
# ``group`` None means this process alone (no process group): every helper is then the identity.


def rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``."""
    return dist.get_rank(group) if group is not None else 0


def world(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``."""
    return dist.get_world_size(group) if group is not None else 1


def broadcast(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``value`` on every rank."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather(value: Any, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``value``, in rank order."""
    if group is None:
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every rank of ``group``."""
    if group is not None:
        dist.barrier(group=group)
