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
:class:`~tessera.runtime.file_records.FileRecord` (size, SHA-256: what every disk checkpoint records) for every
other file, keyed by relative POSIX path.

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

**Tessera's own folders only.** Only folders named exactly ``step-NNNNNNNN`` whose manifest is intact are managed:
ordered by their step number, pruned by ``keep_last``, skipped on load. A folder of the user's that merely starts
with ``step-`` is never touched. A corrupt checkpoint that a load from the root falls back past is renamed
``step-NNNNNNNN.corrupt-<UTC time>`` (kept for inspection, never deleted), so the run can save that step again.

**One writer per root** (:class:`RootLock`). Rank 0 holds an exclusive ``flock`` on ``root/.tessera-save.lock``
from the start of a save until its commit; a second save into the same root (another job, another
``ParallelModel``) fails at once with a ``CheckpointError`` instead of writing into the same partial folder.
The operating system releases the lock when its process dies, so a crash never leaves the root locked.

**Failures.** A step that fails on any rank (a full disk, a permission, DCP's ``CheckpointException``) raises the
same ``CheckpointError`` on every rank (``rank_agreement.together``), and the partial folder is removed.

Every function taking ``group`` runs on every rank of it (rank 0 lists and decides, all ranks share the
hashing) and returns the same answer everywhere; ``group=None`` means this process alone.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, Field, StrictInt, ValidationError, field_validator

from tessera.errors import CheckpointError
from tessera.topology.validation import MAX_DEVICES
from tessera.runtime.file_records import FROZEN, FileRecord, file_record, matches, sha256_text
from tessera.runtime.rank_agreement import all_gather, broadcast, rank, together, world

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
PARTIAL_SUFFIX = ".partial"
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"
DATA_FILE = "data.pt"
RNG_FOLDER = "rng"
LOCK_FILE = ".tessera-save.lock"
CORRUPT_SUFFIX = ".corrupt-"
FORMAT_VERSION = 1
STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d{{8,}})$")
"""A committed checkpoint's folder name: ``step-`` and the step, zero-padded to at least 8 digits."""


class Manifest(BaseModel):
    """Written by rank 0 after every file exists and before the ``COMPLETE`` marker."""

    model_config = FROZEN

    format_version: StrictInt = FORMAT_VERSION
    """Version of this layout."""
    step: StrictInt = Field(ge=0)
    """Optimizer steps taken when the checkpoint was saved."""
    world_size: StrictInt = Field(ge=1, le=MAX_DEVICES)
    """Ranks that wrote it."""
    strategy: str
    """The plan's strategy string (the whole plan is in ``plan.json``); not parsed here: a later Tessera's fields
    must not make a good checkpoint look corrupt (and set it aside) to an earlier one."""
    saved_unix_s: float
    """When it was committed."""
    files: dict[str, FileRecord]
    """Every other file in the folder (relative POSIX path), with its size and hash."""

    @field_validator("files")
    @classmethod
    def _files_inside_the_folder(cls, files: dict[str, FileRecord]) -> dict[str, FileRecord]:
        outside = [name for name in files if not is_inside(name)]
        if outside:
            raise ValueError(f"file names outside the checkpoint folder: {', '.join(repr(n[:80]) for n in outside[:3])}")
        return files


# ------------------------------------------------------------------------------------------------ layout


def is_inside(name: str) -> bool:
    """Whether a relative path from a checkpoint's own files stays inside its folder."""
    path = PurePosixPath(name)
    return bool(name) and "\\" not in name and not path.is_absolute() and ".." not in path.parts


def step_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once committed."""
    return root / f"{STEP_PREFIX}{step:08d}"


def partial_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is committed."""
    return root / f".{STEP_PREFIX}{step:08d}{PARTIAL_SUFFIX}"


def step_of(folder: Path) -> int | None:
    """The step a committed checkpoint's folder name says, or ``None`` for any other name."""
    match = STEP_NAME.match(folder.name)
    return int(match[1]) if match else None


def check_keep_last(keep_last: int | None) -> None:
    """``keep_last`` must keep at least the checkpoint just written."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} would delete the checkpoint just written; pass an integer "
                              ">= 1 (how many recent checkpoints to keep) or None to keep them all")


class RootLock:
    """Rank 0's exclusive ``flock`` on ``root/.tessera-save.lock`` while one save writes into ``root``."""

    def __init__(self, handle: int | None) -> None:
        self._handle = handle

    @classmethod
    def acquire(cls, root: Path, group: dist.ProcessGroup | None) -> RootLock:
        """Take the lock on rank 0 (creating ``root``); every rank raises alike if another save holds it."""
        handle, problem = None, None
        if rank(group) == 0:
            try:
                handle = lock_folder(root)
            except (OSError, CheckpointError) as error:
                problem = (str(error) if isinstance(error, CheckpointError) else
                           f"cannot save into {root}: it is a file, not a checkpoint folder; save into a folder"
                           if root.is_file() else f"cannot create {root}: {error}")
        problem = broadcast(problem, group)
        if problem:
            raise CheckpointError(problem)
        return cls(handle)

    def release(self) -> None:
        """Let the next save in (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            os.close(handle)


def lock_folder(root: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``root/.tessera-save.lock`` (creating ``root``): its handle, holding
    this process's id; ``CheckpointError`` naming the holder when another process has it."""
    root.mkdir(parents=True, exist_ok=True)
    handle = _open_lock_file(root / LOCK_FILE)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(handle, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(handle)
        raise CheckpointError(
            f"another save is writing into {root} (process {holder} holds {root / LOCK_FILE}); one writer per "
            "checkpoint root: give each run its own folder, or wait for that save to finish"
        ) from None
    os.ftruncate(handle, 0)
    os.pwrite(handle, str(os.getpid()).encode(), 0)
    return handle


def _open_lock_file(path: Path) -> int:
    """``path`` opened for the lock, never through a link: a checkpoint folder someone sent could hold the lock's
    name as a symbolic or hard link to a file of yours, which writing the holder's process id would overwrite."""
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise CheckpointError(f"{path} is a symbolic link, not Tessera's lock file; remove the link (Tessera writes "
                              "its process id there) and save again") from None
    info = os.fstat(handle)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(handle)
        raise CheckpointError(f"{path} is not a plain file of its own (a hard link, or not a file), not Tessera's "
                              "lock file; remove it (Tessera writes its process id there) and save again")
    return handle


def discard_partial(partial: Path, group: dist.ProcessGroup | None) -> None:
    """Rank 0 removes a failed save's partial folder (never a committed one: the name says ``.partial``)."""
    if rank(group) == 0 and partial.name.endswith(PARTIAL_SUFFIX):
        shutil.rmtree(partial, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ commit


def commit_checkpoint(
    partial: Path, *, final: Path, step: int, strategy: str, group: dist.ProcessGroup | None, keep_last: int | None
) -> None:
    """Hash the files (a share per rank), then rank 0 writes manifest and marker and renames the folder.

    A failure on any rank raises the same ``CheckpointError`` on every rank (nobody waits for a rank that failed).
    """
    check_keep_last(keep_last)
    names = broadcast(list_files(partial) if rank(group) == 0 else None, group)
    mine = together(lambda: {name: file_record(partial / name) for name in names[rank(group)::world(group)]},
                    group, what=f"hashing the files of {partial}")
    files = {name: record for share in all_gather(mine, group) for name, record in share.items()}
    together(lambda: _write_manifest_and_rename(partial, final, files, step=step, strategy=strategy,
                                                world_size=world(group), keep_last=keep_last) if rank(group) == 0
             else None, group, what=f"committing {final}")  # nobody returns before the checkpoint is visible


def _write_manifest_and_rename(
    partial: Path, final: Path, files: dict[str, FileRecord], *, step: int, strategy: str, world_size: int,
    keep_last: int | None,
) -> None:
    manifest = Manifest(step=step, world_size=world_size, strategy=strategy, saved_unix_s=time.time(),
                        files=dict(sorted(files.items())))
    text = manifest.model_dump_json(indent=2, exclude_none=True)
    write_durably(partial / MANIFEST, lambda path: path.write_text(text))
    write_durably(partial / MARKER, lambda path: path.write_text(sha256_text(text)))
    os.rename(partial, final)  # never over an existing folder: _prepare_partial refused that step already
    _fsync_folder(final.parent)
    if keep_last is not None:
        _prune(final.parent, keep_last)


def _prune(root: Path, keep_last: int) -> None:
    """Delete Tessera's intact checkpoints older than the newest ``keep_last`` (nothing else under ``root``)."""
    for folder in complete_checkpoints(root)[keep_last:]:
        if manifest_problem(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ finding and checking


def select_checkpoint(
    path: Path, *, verify: bool, group: dist.ProcessGroup | None, set_aside: bool = False
) -> tuple[Path, list[str]]:
    """The folder to load and the newer ones skipped; raises ``CheckpointError`` when none can be loaded.

    A ``step-*`` folder must itself be intact. A root folder yields its newest intact checkpoint; with
    ``set_aside`` (a training run falling back) the corrupt newer ones are renamed ``step-N.corrupt-<time>``.
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
        if set_aside:
            problem += f"; moved aside to {broadcast(_set_aside(folder) if rank(group) == 0 else None, group)}"
        skipped.append(problem)
    raise CheckpointError(f"no intact checkpoint in {path}: " + "; ".join(skipped))


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders under ``root`` (``step-NNNNNNNN`` with a marker; not yet verified), newest
    (highest step) first."""
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir() and (p / MARKER).exists()]
    return sorted(folders, key=step_of, reverse=True)


def _set_aside(folder: Path) -> str:
    """Rename a corrupt checkpoint out of the managed names (kept, never deleted); the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = folder.with_name(f"{folder.name}{CORRUPT_SUFFIX}{stamp}")
    try:
        os.rename(folder, target)
    except OSError as error:
        log.warning("could not move corrupt checkpoint %s aside: %s", folder, error)
        return f"(not moved: {error.strerror})"
    return str(target)


def check_resume_root(root: str | Path) -> None:
    """Refuse a ``resume_from`` that can never hold a checkpoint: an existing file (a resumed run would otherwise
    start from scratch, the user's intent lost). A folder that does not exist yet is a fresh run's."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"resume_from={str(root)!r} is a file, not a checkpoint folder; pass the folder given "
                              "to ParallelModel.save (a new one to start from scratch)")


def has_checkpoint(root: str | Path) -> bool:
    """Whether ``root`` is a committed checkpoint or holds one (so resuming from it can start)."""
    root = Path(root)
    return (root / MARKER).exists() or bool(complete_checkpoints(root))


def check_checkpoint(folder: Path, *, verify: bool, group: dist.ProcessGroup | None) -> str | None:
    """Why ``folder`` cannot be loaded (the same answer on every rank), or ``None`` when it is intact."""
    problem = broadcast(manifest_problem(folder) if rank(group) == 0 else None, group)
    if problem:
        return problem
    manifest = read_manifest(folder)
    names = sorted(manifest.files)
    mine = [_file_problem(folder, name, manifest.files[name], verify=verify)
            for name in names[rank(group)::world(group)]]
    if rank(group) == 0:
        mine.append(_unlisted_problem(folder, manifest))
    problems = [p for share in all_gather(mine, group) for p in share if p]
    return f"checkpoint {folder} is corrupt: {'; '.join(sorted(problems))}" if problems else None


def read_manifest(folder: Path) -> Manifest:
    """The manifest of a committed checkpoint."""
    return Manifest.model_validate_json((folder / MANIFEST).read_text())


def manifest_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a committed checkpoint with an intact manifest (this process's view), or ``None``."""
    if not folder.is_dir():
        return f"checkpoint {folder} does not exist"
    if folder.name.endswith(PARTIAL_SUFFIX) or not (folder / MARKER).exists():
        return (f"checkpoint {folder} is incomplete (no {MARKER} marker): it was interrupted while being "
                "written and is never loaded")
    try:
        text = (folder / MANIFEST).read_text()
        manifest = Manifest.model_validate_json(text)
        marker = (folder / MARKER).read_text().strip()
    except (OSError, ValueError) as error:
        return f"checkpoint {folder} is corrupt: its {MANIFEST} is unreadable ({_first_line(error)})"
    if marker != sha256_text(text):
        return f"checkpoint {folder} is corrupt: {MANIFEST} does not match the hash in its {MARKER} marker"
    named = step_of(Path(folder.name.lstrip(".")))
    if named is not None and named != manifest.step:
        return f"checkpoint {folder} is corrupt: its {MANIFEST} says step {manifest.step}, its folder name step {named}"
    return None


def _first_line(error: BaseException) -> str:
    """``ValidationError: step: Input should be greater than or equal to 0`` for a refused manifest."""
    if isinstance(error, ValidationError):
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        return f"{where}: {problem['msg'][:200]}"
    return type(error).__name__


def _unlisted_problem(folder: Path, manifest: Manifest) -> str | None:
    """A file a load reads that ``folder``'s manifest leaves out (a crafted manifest could leave out ``plan.json``
    as a link to /dev/zero, or ``.metadata`` as a FIFO), or a link or special file anywhere in it; None otherwise.
    Other strays (a ``.DS_Store``, an NFS temp file) are not the checkpoint's and do not make it corrupt."""
    listed = {*manifest.files, MANIFEST, MARKER}
    for top, subfolders, files in os.walk(folder):  # links to folders are listed, not followed
        for entry in (*subfolders, *files):
            path = Path(top) / entry
            name = path.relative_to(folder).as_posix()
            if name in listed:
                continue
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                return f"{name} is a link or special file its {MANIFEST} does not list (a checkpoint holds plain files)"
            if path.is_file() and _read_by_a_load(name):
                return f"{name} is not in its {MANIFEST} (a checkpoint lists every file it wrote)"
    return None


def _read_by_a_load(name: str) -> bool:
    """Whether a load reads a file of this name: the DCP metadata and data files, the plan, the data position, the
    RNG states."""
    return name in (".metadata", PLAN_FILE, DATA_FILE) or name.startswith(f"{RNG_FOLDER}/") or name.endswith(".distcp")


def _file_problem(folder: Path, name: str, record: FileRecord, *, verify: bool) -> str | None:
    path = folder / name
    if not is_inside(name):
        return f"file {name!r} is named outside the checkpoint folder"
    if any((folder / parent).is_symlink() for parent in PurePosixPath(name).parents if parent.name):
        return f"a folder on the way to file {name} is a symbolic link (a checkpoint holds only plain files)"
    if path.is_symlink():
        return f"file {name} is a symbolic link (a checkpoint holds only plain files)"
    if not path.is_file():
        return f"file {name} is missing" if not path.exists() else f"{name} is not a plain file"
    if record.sha256 is None:
        return f"file {name} has no SHA-256 in {MANIFEST} (a disk checkpoint records one for every file)"
    size = path.stat().st_size
    if size != record.size_bytes:
        return f"file {name} has {size} bytes but {record.size_bytes} were written (truncated or overwritten)"
    if verify and not matches(path, record):
        return (f"file {name} does not match the {record.hash_name} recorded when it was written (its bytes changed "
                "on disk)")
    return None


def _previous_hint(folder: Path) -> str:
    """Where to go instead of a broken ``folder``: the newest committed checkpoint before it."""
    step = step_of(Path(folder.name.lstrip(".").removesuffix(PARTIAL_SUFFIX)))
    older = [p for p in complete_checkpoints(folder.parent) if step is None or step_of(p) < step]
    if not older:
        return f"there is no complete checkpoint before it in {folder.parent}; start from scratch"
    return (f"the last complete checkpoint before it is {older[0]}: load that, or pass the folder {folder.parent} "
            "to load the newest intact one")


def _nothing_found(root: Path) -> str:
    if not root.exists():
        return f"checkpoint folder {root} does not exist; pass the folder given to ParallelModel.save"
    if not root.is_dir():
        return f"{root} is a file, not a checkpoint folder; pass the folder given to ParallelModel.save"
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


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder``, as sorted relative POSIX paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _fsync_folder(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (POSIX: fsync the directory)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
