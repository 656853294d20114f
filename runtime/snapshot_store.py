"""One node's snapshot store: the folder in host memory where in-memory snapshots live (``runtime.snapshots``).

**Layout** (the disk checkpoint's commit discipline, ``runtime.checkpoint_files``)::

    store/                        e.g. /dev/shm/tessera-snapshots-<uid>/<run id>, or a folder given for tests
      .tessera-snapshots          marks the folder as a Tessera snapshot store (written when it is created)
      .tessera-save.lock          the node leader's flock while the run uses the store
      step-00000007/              a committed snapshot: the files this node holds (its own ranks' and its
        manifest.json  COMPLETE   buddy node's), and the manifest of the WHOLE snapshot (every rank's files)
        rank-00002.snap  rank-00003.snap  rank-00000.snap  rank-00001.snap  plan.json  data.pt
      .step-00000008.partial/     being written: never read (.step-00000008.take-1.partial: the same step again)
      .recovery-step-00000007.partial/, recovery/step-00000007/   a snapshot being assembled for a load
      .spare/                     the snapshot last pruned: its files are overwritten by the next snapshot

A store folder is *committed* when its ``COMPLETE`` marker is the SHA-256 of its ``manifest.json``. Unlike a
disk checkpoint, it holds only some of the files its manifest lists: a file counts as held when it is present
with the recorded size and XXH3-128 hash (:func:`held_files`); a missing or damaged one (its copy still arriving, or
torn when its writer was killed) is simply not held here.

**Only Tessera's own files.** A store is used only if it is new, empty, or carries the marker; inside it, only
names Tessera writes (``step-N``, ``.step-N.partial``, the recovery folders, the marker and lock) are ever
pruned or removed. :func:`remove_store` (a clean finish) deletes those and the folder itself if nothing else is
left in it.

**Files are recycled, not recreated.** On tmpfs a new file's pages are allocated and zeroed as it is written and
freed when it is deleted: for a 0.72 MB file, writing a new one and deleting an old one costs 0.42 ms of CPU,
overwriting an existing one 0.06 ms (measured on this project's 2-core machine). So the snapshot a commit prunes
is renamed ``.spare`` instead of deleted, and the next snapshot's writers move their files out of it
(:func:`reuse_spare`, an atomic rename) and overwrite them in place. The host memory is the same as deleting it
and writing anew (the spare is the in-flight snapshot's memory); a file moved into a snapshot folder holds either
the old bytes -- which its hash no longer matches -- or the new ones.

Snapshots live in memory (tmpfs): they survive the training process, not a reboot, so nothing is fsynced.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from pathlib import Path

import torch

from tessera.errors import CheckpointError, ConfigError
from tessera.files import read_bounded
from tessera.runtime.checkpoint_files import (
    LOCK_FILE, MANIFEST, MARKER, PARTIAL_SUFFIX, STEP_PREFIX, Manifest, complete_checkpoints, lock_folder,
    manifest_problem, read_manifest, step_folder, step_of,
)
from tessera.runtime.file_records import matches, sha256_text
from tessera.runtime.snapshot_config import default_store_parent

STORE_MARKER = ".tessera-snapshots"
RECOVERY_FOLDER = "recovery"
RECOVERY_PREFIX = f".recovery-{STEP_PREFIX}"
SPARE_FOLDER = ".spare"


def open_store(store: Path) -> int:
    """Claim ``store`` for this run (the node leader, once): create or check it, lock it, remove what an
    interrupted snapshot or recovery of this run left. The lock's handle (released when the process ends)."""
    if store.exists() and not store.is_dir():
        raise ConfigError(f"snapshot store {store} is a file; pass a folder (snapshot_store=...)")
    if store.is_dir() and any(store.iterdir()) and not (store / STORE_MARKER).exists():
        raise ConfigError(f"snapshot store {store} holds files Tessera did not write (no {STORE_MARKER} marker); "
                          "give every run its own, new store folder")
    default = store.parent == default_store_parent()
    if default:
        _claim_private_folder(store.parent)
    created = default or not store.exists() or _created_by_tessera(store)  # default: an earlier version's too
    _claim_private_folder(store, restrict=created)
    try:
        handle = lock_folder(store)
    except CheckpointError as error:
        raise ConfigError(f"snapshot store {store} is in use: {error}") from None
    try:
        _write_marker(store / STORE_MARKER, created=created)
    except ConfigError:
        os.close(handle)
        raise
    for entry in _own_entries(store):
        if entry.name.endswith(PARTIAL_SUFFIX) or entry.name in (RECOVERY_FOLDER, SPARE_FOLDER):
            shutil.rmtree(entry, ignore_errors=True)
    return handle


def _claim_private_folder(folder: Path, *, restrict: bool = True) -> None:
    """Create ``folder`` for its owner alone (``/dev/shm`` is open to every user of the machine, and a snapshot holds
    the model and optimizer state), or check that an existing one is this user's: another user who made it first
    could read the snapshots, plant links, or plant weights. ``restrict``: make an existing one this user's alone
    (Tessera's own; a folder the user made and passed keeps the permissions they gave it)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(f"snapshot store folder {folder} is not a folder of yours (owner uid {info.st_uid}, "
                          f"{'a link' if stat.S_ISLNK(info.st_mode) else stat.filemode(info.st_mode)}); remove it, or "
                          "pass SnapshotConfig(store=...) a folder of your own")
    if restrict and info.st_mode & 0o077:  # Tessera's, that others may read (an earlier version made them 0755)
        os.chmod(folder, 0o700, follow_symlinks=False)
    elif info.st_mode & 0o022:  # the user's: others could plant files in it that snapshots would be read from
        raise ConfigError(f"snapshot store folder {folder} can be written by other users ({stat.filemode(info.st_mode)}); "
                          "run chmod go-w on it, or pass SnapshotConfig(store=...) a folder only you can write")


CREATED_LINE = "tessera created this folder: it is removed when the run finishes"


def _created_by_tessera(store: Path) -> bool:
    """Whether ``store``'s marker says Tessera created the folder (an earlier run's store, not the user's folder)."""
    try:
        return CREATED_LINE in read_bounded(store / STORE_MARKER, 4096).decode("utf-8", "replace")
    except (OSError, ValueError):
        return False


def _write_marker(path: Path, *, created: bool) -> None:
    """The store's marker, never written through a link left in the store; ``created``: Tessera made the folder,
    so a clean finish removes it (a folder the user passed stays)."""
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise ConfigError(f"cannot write the snapshot store's marker {path} ({error.strerror}); a link there is "
                          "not Tessera's: remove it, or give the run a new store folder") from None
    info = os.fstat(handle)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a hard link's other name would be emptied too
        os.close(handle)
        raise ConfigError(f"the snapshot store's marker {path} is a hard link or not a file, not Tessera's: remove "
                          "it, or give the run a new store folder")
    os.ftruncate(handle, 0)
    with os.fdopen(handle, "w") as marker:
        marker.write("in-memory snapshots of one Tessera run (tessera.runtime.snapshots)\n"
                     + (f"{CREATED_LINE}\n" if created else ""))


TAKE_MARK = ".take-"
"""Between a step and ``PARTIAL_SUFFIX`` in the partial folder of a step snapshotted again (``.step-N.take-2.partial``)."""


def partial_snapshot(store: Path, step: int, *, take: int = 0) -> Path:
    """Where this node writes the snapshot of ``step`` before committing it (``take``: how many times this step
    was snapshotted before: each take has its own partial folder)."""
    again = f"{TAKE_MARK}{take}" if take else ""
    return store / f".{STEP_PREFIX}{step:08d}{again}{PARTIAL_SUFFIX}"


def commit_snapshot(partial: Path, manifest: Manifest, *, keep: int) -> Path:
    """Write the whole snapshot's manifest and marker into ``partial``, rename it, keep the newest ``keep``."""
    text = manifest.model_dump_json(indent=2, exclude_none=True)
    (partial / MANIFEST).write_text(text)
    (partial / MARKER).write_text(sha256_text(text))
    final = step_folder(partial.parent, manifest.step)
    shutil.rmtree(final, ignore_errors=True)  # the same step from a run that went on past a later recovery point
    os.rename(partial, final)
    for index, older in enumerate(committed_snapshots(partial.parent)[keep:]):
        if index or not _make_spare(older):
            shutil.rmtree(older, ignore_errors=True)
    return final


def _make_spare(folder: Path) -> bool:
    """Rename a pruned snapshot ``folder`` to the store's spare (replacing the previous spare, whose files the
    snapshots since have taken or left); whether it worked. The rename takes it out of the committed names at
    once: it is never read again, only its files' pages reused."""
    spare = folder.parent / SPARE_FOLDER
    shutil.rmtree(spare, ignore_errors=True)
    try:
        os.rename(folder, spare)
    except OSError:  # a writer's race left something there: prune it the ordinary way
        return False
    return True


def reuse_spare(store: Path, name: str, folder: int, target: str) -> None:
    """Move the spare's file ``name`` (if it has one) to ``target`` in the open folder ``folder``, where it is
    overwritten in place (the caller opens it without truncating). Atomic: each spare file is
    taken by one writer or pruned, never both; a missing one just means a new file."""
    try:
        os.rename(store / SPARE_FOLDER / name, target, dst_dir_fd=folder)
    except OSError:
        pass


def open_store_file(folder: int, name: str, flags: int) -> int:
    """A handle on file ``name`` of the open store folder ``folder`` (``flags``: ``os.O_WRONLY`` or ``os.O_RDWR``),
    created if missing, never opened through a link, as a file with another name too (a hard link: a recovery links
    a snapshot's file, a planted one may be anyone's) or as another user's file: such an entry is removed and a new
    file made."""
    flags |= os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # non-blocking: a FIFO fails, not hangs
    try:
        handle = os.open(name, flags, 0o600, dir_fd=folder)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO without a reader
            raise
    else:
        info = os.fstat(handle)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_uid == os.getuid():
            os.set_blocking(handle, True)
            return handle
        os.close(handle)
    os.unlink(name, dir_fd=folder)
    handle = os.open(name, flags | os.O_EXCL, 0o600, dir_fd=folder)
    os.set_blocking(handle, True)
    return handle


class MappedFiles:
    """Files of a store mapped into memory as byte tensors, so that a snapshot's copy from the buddy partner is
    received straight into its file's pages instead of into a buffer copied to them afterwards (writing 16 MB from
    memory: 3.3-3.7 ms of a rank's CPU here, the ``write`` part of ``benchmarks/snapshot_parts.py``). A file
    recycled through the spare keeps its inode, so its mapping is kept too (``mappings`` of them: the files a store
    rotates through; mapping again costs a fault per page). Each kept mapping holds its file open, so its inode
    cannot be reused: a file opened again with the same device, inode and size is the same file. A kept file that
    was deleted (pruned instead of recycled) is let go at the next ``open``, so its memory is freed. A view returned
    by ``open`` must not be used after the next ``open`` of the same file, which may cut it to another size.

    (This rank's own file is not filled in place: tried on this project's CPU, the training thread's copy into a
    few rotating mapped files took longer than into its one reused staging buffer, by more than the background
    write it saved; the variant was not kept.)"""

    def __init__(self, mappings: int) -> None:
        self._mappings = mappings
        self._files: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        """By (device, inode), most recently used last: the open handle and the mapped bytes."""

    def open(self, folder: int, name: str, size: int) -> torch.Tensor:
        """File ``name`` of the open folder ``folder`` (created if missing), cut to ``size`` bytes and mapped."""
        self._let_go_of_deleted()
        handle = open_store_file(folder, name, os.O_RDWR)
        try:
            info = os.fstat(handle)
            key = (info.st_dev, info.st_ino)
            kept = self._files.pop(key, None)
            if kept is not None:
                os.close(kept[0])
                if kept[1].numel() == size == info.st_size:
                    self._files[key] = (handle, kept[1])
                    return kept[1]
            mapped = torch.empty(0, dtype=torch.uint8)
            os.ftruncate(handle, size)
            if size:
                if hasattr(os, "posix_fallocate"):  # tmpfs allocates the pages now or says ENOSPC: never a SIGBUS
                    os.posix_fallocate(handle, 0, size)
                mapped = torch.frombuffer(mmap.mmap(handle, size, flags=mmap.MAP_SHARED | _POPULATE),
                                          dtype=torch.uint8)
        except BaseException:
            os.close(handle)
            raise
        self._files[key] = (handle, mapped)
        while len(self._files) > self._mappings:
            os.close(self._files.pop(next(iter(self._files)))[0])  # unmapped once its last view is freed
        return mapped

    def close(self) -> None:
        """Release every mapping (their files' memory is freed with the files)."""
        for handle, _ in self._files.values():
            os.close(handle)
        self._files.clear()

    def _let_go_of_deleted(self) -> None:
        for key, (handle, _) in list(self._files.items()):
            if os.fstat(handle).st_nlink == 0:
                os.close(handle)
                del self._files[key]


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Map every page up front (Linux), instead of one fault per page on first touch."""


def committed_snapshots(store: Path) -> list[Path]:
    """Committed snapshot folders of ``store`` (marker present), newest first."""
    return complete_checkpoints(store) if (store / STORE_MARKER).exists() else []


def held_files(folder: Path) -> tuple[Manifest, set[str]] | None:
    """The whole snapshot's manifest and the files of it this folder holds intact; ``None`` if not committed."""
    if manifest_problem(folder) is not None:
        return None
    manifest = read_manifest(folder)
    held = set()
    for name, record in manifest.files.items():
        path = folder / name
        if path.is_file() and not path.is_symlink() and matches(path, record):
            held.add(name)
    return manifest, held


def discard_newer(store: Path, step: int) -> None:
    """Remove this store's snapshots after ``step``: the run continues from ``step``, they belong to a past
    that is no longer its own."""
    for folder in committed_snapshots(store):
        if step_of(folder) > step:
            shutil.rmtree(folder, ignore_errors=True)


def store_bytes(store: Path) -> int:
    """Bytes of this run's snapshot folders in ``store`` (what pruning them would free)."""
    return sum(p.stat().st_size for entry in _own_entries(store) if entry.is_dir() for p in entry.rglob("*")
               if p.is_file())


def free_bytes(store: Path) -> int:
    """Bytes the file system of ``store`` (tmpfs: host memory) still has for unprivileged writers."""
    stat = os.statvfs(store)
    return stat.f_bavail * stat.f_frsize


def remove_store(store: Path) -> None:
    """A clean finish: remove every snapshot, the marker and the lock, then ``store`` itself if Tessera created it
    and it is empty."""
    if not (store / STORE_MARKER).exists():
        return
    created = _created_by_tessera(store)
    for entry in _own_entries(store):
        shutil.rmtree(entry, ignore_errors=True)
    for name in (LOCK_FILE, STORE_MARKER):
        (store / name).unlink(missing_ok=True)
    if not created:
        return  # the user's folder: emptied of Tessera's files, kept
    try:
        store.rmdir()
    except OSError:
        pass  # something else lives there: left alone


def _own_entries(store: Path) -> list[Path]:
    """Entries of ``store`` with names Tessera gives snapshot folders."""
    if not store.is_dir():
        return []

    def ours(name: str) -> bool:
        bare = name.lstrip(".").removesuffix(PARTIAL_SUFFIX).partition(TAKE_MARK)[0]
        return step_of(Path(bare)) is not None or name.startswith(RECOVERY_PREFIX) and name.endswith(
            PARTIAL_SUFFIX) or name in (RECOVERY_FOLDER, SPARE_FOLDER)

    return [entry for entry in store.iterdir() if ours(entry.name)]
