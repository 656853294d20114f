"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save a ``ParallelModel``'s training state
under one plan, load it under any other.

**What a checkpoint holds.** The model's parameters and persistent buffers and the optimizer's state, both keyed
by the user's FQNs (``blocks.3.attn.q.weight``): ``torch.distributed.checkpoint.state_dict.get_state_dict`` strips
DDP's ``module.`` prefix and flattens the optimizer state to ``state.<fqn>.exp_avg``. Every rank writes in
parallel and only its own shards: a ``DTensor``'s local shard under FSDP2 or tensor parallelism, its stages'
layers under pipelining; a replicated tensor (DDP) is written once (DCP de-duplicates it). Beside them: the
step, the plan (``plan.json``), every rank's RNG states (``rng/rank-00003.pt``) and the caller's data position
(``data.pt``: whatever ``data_state`` it passes, e.g. a sampler's ``state_dict()``; read back with
``torch.load(weights_only=True)``, so plain containers of numbers, strings and tensors).

**Resharding.** DCP records each tensor's global shape and which chunk each file holds; a load asks for the
chunks the *new* plan's shards cover. So a checkpoint saved under tp=2 x dp=2 on 4 ranks loads under pp=2 on 2
ranks, or in one process without a process group; :func:`export_model_state_dict` writes one plain
``torch.save`` file that ``model.load_state_dict`` accepts.

**Atomic commit.** Files go to ``root/.step-00000012.partial``. Once every rank's files and DCP's ``.metadata``
exist, the ranks hash the files (each a share), rank 0 writes ``manifest.json`` (each file's size and SHA-256),
then the ``COMPLETE`` marker (the manifest's own hash), fsyncs, and renames the folder to ``root/step-00000012``.
A folder without the marker, or still named ``.partial``, is never loaded, so a crash mid-write leaves only an
ignored partial folder. A load checks the files against the manifest (sizes always; SHA-256 too with
``verify=True``, the default, each rank hashing a share): a truncated or corrupted checkpoint is reported by
file, never loaded silently. Given the root folder, the newest intact checkpoint is used and the skipped ones
are named (``CheckpointInfo.skipped``, and a logged warning). The root must be on a file system every rank
sees (DCP's ``FileSystemWriter`` assumes it: rank 0 writes the metadata of all).

**RNG.** Each rank's CPU (and, when initialised, CUDA) generator and Python ``random`` state. Under the same
world size rank ``r`` gets rank ``r``'s states back; under another world size every rank gets rank 0's (the
runtime already requires every rank to be seeded identically: ``runtime.materialize.check_same_seed``).

**Asynchronous save.** ``async_save=True`` uses ``dcp.async_save``: the state is copied to host memory (all the
training loop waits for), then written and committed by a background thread on a dedicated gloo process group,
so its collectives never interleave with training's. At most one save is in flight: the next save, a load, or
``ParallelModel.wait_for_checkpoint()`` waits for it.

**Not saved:** the loss function, learning-rate schedulers (save them in ``data_state``), NumPy's RNG, and
DTensor's CUDA RNG tracker (dropout under tensor parallelism on GPUs).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tessera.errors import CheckpointError

if TYPE_CHECKING:
    from tessera.runtime.parallel_model import ParallelModel

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
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state and param-group settings keyed per FQN (``param_groups.<fqn>.lr``): the nested form keeps
``param_groups`` as one list per rank under one key, which DCP de-duplicates across ranks, so pipeline ranks
(each with its own parameters) would get rank 0's groups back."""


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


class CheckpointInfo(BaseModel):
    """What a load restored, and where from."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, use_attribute_docstrings=True)

    path: str
    """The checkpoint folder loaded."""
    step: int
    """Optimizer steps taken when it was saved (now ``ParallelModel.step``)."""
    saved_world_size: int
    """Ranks that saved it."""
    saved_strategy: str
    """Strategy it was saved under."""
    data_state: Any = None
    """The ``data_state`` passed to ``save`` (the data position), or ``None``."""
    skipped: tuple[str, ...] = ()
    """Newer checkpoints passed over, each with the reason (incomplete or corrupt)."""


class PendingSave:
    """A checkpoint being written; :meth:`wait` returns its folder once committed (at once for a synchronous save)."""

    def __init__(self, path: Path, future: Future | None = None) -> None:
        self.path = path
        """Folder the checkpoint has (or will have) once committed."""
        self._future = future

    def done(self) -> bool:
        """Whether the checkpoint is committed (or failed)."""
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        """Block until committed; raise ``CheckpointError`` if writing failed."""
        if self._future is not None:
            try:
                self._future.result()
            except Exception as error:
                raise CheckpointError(f"asynchronous save of {self.path} failed: {error}; no checkpoint was "
                                      "committed there, the previous complete one is still valid") from error
        return self.path


class Checkpointer:
    """A ``ParallelModel``'s checkpoint machinery: the process group checkpoints use and the save in flight."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: PendingSave | None = None

    def save(
        self, pm: ParallelModel, root: str | Path, *, data_state: Any = None, async_save: bool = False,
        keep_last: int | None = None,
    ) -> PendingSave:
        """Write ``root/step-<pm.step>``; see the module docstring. Call on every rank."""
        self.wait()
        root, group = Path(root), self._process_group()
        final, partial = step_folder(root, pm.step), root / f".{STEP_PREFIX}{pm.step:08d}{PARTIAL_SUFFIX}"
        _prepare_partial(final, partial, group)
        _write_side_files(pm, partial, data_state, group)
        state = _state_dict(state_module(pm.modules), pm.optimizer)
        step, strategy = pm.step, pm.plan.strategy.to_string()

        def commit() -> None:
            _commit(partial, final=final, step=step, strategy=strategy, group=group, keep_last=keep_last)

        if not async_save:
            with _single_process_quiet(group):
                dcp.save(state, checkpoint_id=partial, process_group=group, no_dist=group is None)
            commit()
            return PendingSave(final)
        self._pending = PendingSave(final, _then(_write_async(state, partial, group), commit))
        return self._pending

    def load(self, pm: ParallelModel, path: str | Path, *, verify: bool = True) -> CheckpointInfo:
        """Load the checkpoint at ``path`` (a ``step-*`` folder, or a root: the newest intact one) into ``pm``."""
        self.wait()
        group = self._process_group()
        folder, skipped = select_checkpoint(Path(path), verify=verify, group=group)
        manifest = read_manifest(folder)
        module = state_module(pm.modules)
        state = _state_dict(module, pm.optimizer)  # initialises the optimizer's state: DCP loads into its tensors
        with _single_process_quiet(group):
            dcp.load(state, checkpoint_id=folder, process_group=group, no_dist=group is None)
        set_state_dict(module, pm.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=STATE_OPTIONS)
        _restore_rng(folder, saved_world=manifest.world_size, group=group)
        pm.step = manifest.step
        return CheckpointInfo(
            path=str(folder), step=manifest.step, saved_world_size=manifest.world_size,
            saved_strategy=manifest.strategy, data_state=torch.load(folder / DATA_FILE, weights_only=True),
            skipped=tuple(skipped),
        )

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; its folder, or ``None``."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def _process_group(self) -> dist.ProcessGroup | None:
        """A gloo group of every rank, only for checkpoints (``None`` without a process group)."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


# ------------------------------------------------------------------------------------------------ state


def state_module(modules: Sequence[nn.Module]) -> nn.Module:
    """One module holding every parameter the rank trains, under the user's FQNs.

    Without pipelining that is the rank's only module. An interleaved pipeline rank runs several chunk
    modules (each holding its layers under their original FQNs, see ``runtime.pipeline``) with one optimizer;
    ``get_state_dict`` wants one module that owns all of the optimizer's parameters, so the chunks' module
    trees are merged (the very same layer objects; only containers such as ``blocks`` are new).
    """
    if len(modules) == 1:
        return modules[0]
    return _merge_trees(list(modules))


def _merge_trees(modules: list[nn.Module]) -> nn.Module:
    merged = nn.Module()
    for module in modules:
        for name, param in module._parameters.items():
            if param is not None:
                merged.register_parameter(name, param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                merged.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
    for name in dict.fromkeys(name for module in modules for name in module._modules):
        children = list({id(c): c for m in modules if (c := m._modules.get(name)) is not None}.values())
        if children:
            merged.add_module(name, children[0] if len(children) == 1 else _merge_trees(children))
    return merged


def _state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by the user's FQNs; tensors are this rank's shards."""
    model_state, optim_state = get_state_dict(module, optimizer, options=STATE_OPTIONS)
    return {"model": model_state, "optim": optim_state}


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(folder: Path, *, saved_world: int, group: dist.ProcessGroup | None) -> None:
    """This rank's saved RNG states under the same world size; rank 0's under another (see module docstring)."""
    source = _rank(group) if saved_world == _world(group) else 0
    state = torch.load(folder / RNG_FOLDER / f"rank-{source:05d}.pt", weights_only=True)
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------ writing


def step_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once committed."""
    return root / f"{STEP_PREFIX}{step:08d}"


def _prepare_partial(final: Path, partial: Path, group: dist.ProcessGroup | None) -> None:
    """Rank 0 empties the partial folder; every rank raises alike if the step was already saved."""
    problem = None
    if _rank(group) == 0:
        if final.exists():
            problem = (f"checkpoint {final} already exists; a step is saved once: train on before saving again, "
                       "or delete it to replace it")
        else:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was interrupted
            (partial / RNG_FOLDER).mkdir(parents=True)
    problem = _broadcast(problem, group)
    if problem:
        raise CheckpointError(problem)


def _write_side_files(pm: ParallelModel, partial: Path, data_state: Any, group: dist.ProcessGroup | None) -> None:
    """Every rank its RNG states; rank 0 the plan and the data position."""
    rank = _rank(group)
    _write_durably(partial / RNG_FOLDER / f"rank-{rank:05d}.pt", lambda path: torch.save(_rng_state(), path))
    if rank == 0:
        _write_durably(partial / PLAN_FILE, lambda path: pm.plan.to_json(path))
        _write_durably(partial / DATA_FILE, lambda path: torch.save(data_state, path))


def _commit(
    partial: Path, *, final: Path, step: int, strategy: str, group: dist.ProcessGroup | None, keep_last: int | None
) -> None:
    """Hash the files (a share per rank), then rank 0 writes manifest and marker and renames the folder."""
    names = _broadcast(_list_files(partial) if _rank(group) == 0 else None, group)
    mine = {name: _file_record(partial / name) for name in names[_rank(group)::_world(group)]}
    files = {name: record for share in _all_gather(mine, group) for name, record in share.items()}
    if _rank(group) == 0:
        manifest = Manifest(step=step, world_size=_world(group), strategy=strategy, saved_unix_s=time.time(),
                            files=dict(sorted(files.items())))
        text = manifest.model_dump_json(indent=2)
        _write_durably(partial / MANIFEST, lambda path: path.write_text(text))
        _write_durably(partial / MARKER, lambda path: path.write_text(_sha256_text(text)))
        os.replace(partial, final)
        _fsync_folder(final.parent)
        if keep_last is not None:
            _prune(final.parent, keep_last)
    _barrier(group)  # nobody returns before the checkpoint is visible under its final name


def _prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest ``keep_last``."""
    for folder in complete_checkpoints(root)[keep_last:]:
        shutil.rmtree(folder, ignore_errors=True)


def _write_async(state: dict[str, Any], partial: Path, group: dist.ProcessGroup | None) -> Future:
    """``dcp.async_save``: returns once ``state`` is copied to host memory; the future completes when written."""
    with _single_process_quiet(group):
        written = dcp.async_save(state, checkpoint_id=partial, process_group=group, no_dist=group is None)
    return getattr(written, "upload_completion", written)  # an AsyncSaveResponse with a non-blocking stager


def _then(future: Future, action) -> Future:
    """A future that completes after ``future`` and then ``action()`` (run on a background thread)."""
    done: Future = Future()

    def run() -> None:
        try:
            future.result()
            action()
            done.set_result(None)
        except BaseException as error:  # surfaced by PendingSave.wait
            done.set_exception(error)

    threading.Thread(target=run, name="tessera-checkpoint-commit", daemon=True).start()
    return done


# ------------------------------------------------------------------------------------------------ reading


def select_checkpoint(path: Path, *, verify: bool, group: dist.ProcessGroup | None) -> tuple[Path, list[str]]:
    """The folder to load and the newer ones skipped; raises ``CheckpointError`` when none can be loaded.

    A ``step-*`` folder must itself be intact. A root folder yields its newest intact checkpoint.
    """
    if _is_checkpoint_folder(path):
        problem = check_checkpoint(path, verify=verify, group=group)
        if problem:
            raise CheckpointError(f"{problem}; {_previous_hint(path)}")
        return path, []
    candidates = _broadcast(complete_checkpoints(path) if _rank(group) == 0 else None, group)
    if not candidates:
        raise CheckpointError(_nothing_found(path))
    skipped = []
    for folder in candidates:
        problem = check_checkpoint(folder, verify=verify, group=group)
        if problem is None:
            if skipped and _rank(group) == 0:
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
    problem = _broadcast(_manifest_problem(folder) if _rank(group) == 0 else None, group)
    if problem:
        return problem
    manifest = read_manifest(folder)
    names = sorted(manifest.files)
    mine = [_file_problem(folder, name, manifest.files[name], verify=verify)
            for name in names[_rank(group)::_world(group)]]
    problems = [p for share in _all_gather(mine, group) for p in share if p]
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


# ------------------------------------------------------------------------------------------------ export


def export_model_state_dict(checkpoint: str | Path, out: str | Path, *, verify: bool = True) -> Path:
    """Write the model's weights of ``checkpoint`` (a folder or a root) to one ``torch.save`` file.

    The file is a plain ``{fqn: tensor}`` state dict of full tensors: ``model.load_state_dict(torch.load(out))``
    works on the unsharded model. Runs in one process (reads every shard); needs no process group.
    """
    folder, _ = select_checkpoint(Path(checkpoint), verify=verify, group=None)
    metadata = dcp.FileSystemReader(folder).read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]  # ("model", "blocks.0.attn.q.weight")
        if path[0] == "model" and isinstance(item, TensorStorageMetadata):
            weights[".".join(str(part) for part in path[1:])] = torch.empty(item.size, dtype=item.properties.dtype)
    with _single_process_quiet(None):
        dcp.load({"model": weights}, checkpoint_id=folder, no_dist=True)
    out = Path(out)
    torch.save(weights, out)
    return out


# ------------------------------------------------------------------------------------------------ files


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


def _write_durably(path: Path, write) -> None:
    """Write ``path`` with ``write(path)`` and fsync it, so a marker written later never precedes its data."""
    write(path)
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_folder(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (POSIX: fsync the directory)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


# ------------------------------------------------------------------------------------------------ collectives
# ``group`` None means this process alone (no process group): every helper is then the identity.


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _broadcast(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``value`` on every rank."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _all_gather(value: Any, group: dist.ProcessGroup | None) -> list:
    if group is None:
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


@contextmanager
def _single_process_quiet(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is what we asked for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
