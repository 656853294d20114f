"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save a ``ParallelModel``'s training state
under one plan, load it under any other.

**What a checkpoint holds.** The model's parameters and persistent buffers and the optimizer's state, both keyed
by the user's FQNs (``blocks.3.attn.q.weight``): ``torch.distributed.checkpoint.state_dict.get_state_dict`` strips
DDP's ``module.`` prefix and flattens the optimizer state to ``state.<fqn>.exp_avg``. Every rank writes in
parallel and only its own shards: a ``DTensor``'s local shard under FSDP2 or tensor parallelism, its stages'
layers under pipelining; a replicated tensor (DDP) is written once (DCP de-duplicates it). Beside them: the
step, the plan (``plan.json``), every rank's RNG states and learning-rate scheduler state (``rng/rank-00003.pt``;
``runtime.lr_schedule``) and the caller's data position
(``data.pt``: whatever ``data_state`` it passes, e.g. a sampler's ``state_dict()``; read back with
``torch.load(weights_only=True)``, so plain containers of numbers, strings and tensors).

**Resharding.** DCP records each tensor's global shape and which chunk each file holds; a load asks for the
chunks the *new* plan's shards cover. So a checkpoint saved under tp=2 x dp=2 on 4 ranks loads under pp=2 on 2
ranks, or in one process without a process group; :func:`export_model_state_dict` (``runtime.checkpoint_export``) writes one plain
``torch.save`` file that ``model.load_state_dict`` accepts.

**On disk** (``runtime.checkpoint_files``: the folder layout, the manifest, the atomic commit and how damage is
detected). Files are written to a ``.partial`` folder and committed by a manifest of every file's size and
SHA-256, a ``COMPLETE`` marker and a rename, so a crash mid-write leaves only an ignored partial folder. A load
checks the files against the manifest (sizes always; SHA-256 too with ``verify=True``, the default): a truncated
or corrupted checkpoint is reported by file, never loaded silently. Given the root folder, the newest intact
checkpoint is used and the skipped ones are named (``CheckpointInfo.skipped``, and a logged warning). The root
must be on a file system every rank sees (DCP's ``FileSystemWriter`` assumes it: rank 0 writes the metadata of
all).

**RNG and scheduler.** Each rank's CPU (and, when initialised, CUDA) generator and Python ``random`` state, and
its learning-rate scheduler's ``state_dict()``. Under the same world size rank ``r`` gets rank ``r``'s states back;
under another world size every rank gets rank 0's (the runtime already requires every rank to be seeded
identically: ``runtime.materialize.check_same_seed``; every rank's scheduler follows the same schedule).

**Received checkpoints run no code** (``runtime.checkpoint_reader``): DCP's pickled ``.metadata`` and non-tensor
values are read by restricted loaders; a file naming anything else is refused with a ``CheckpointError``.

**One save per root at a time; failures leave nothing behind** (``runtime.checkpoint_files``): rank 0 locks the
root for the whole save, a failure on any rank (a full disk included) raises ``CheckpointError`` on every rank
and removes the partial folder, and ``keep_last`` must be at least 1.

**Asynchronous save.** ``async_save=True`` uses ``dcp.async_save``: the state is copied to host memory (all the
training loop waits for), then written and committed by a background thread on a dedicated gloo process group,
so its collectives never interleave with training's. At most one save is in flight: the next save, a load, or
``ParallelModel.wait_for_checkpoint()`` waits for it.

**Not saved:** the loss function, a scheduler ``train_step`` does not step (save it in ``data_state``), NumPy's RNG, and
DTensor's CUDA RNG tracker (dropout under tensor parallelism on GPUs).
"""

from __future__ import annotations

import atexit
import logging
import random
import shutil
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_map_only

from tessera.errors import CheckpointError
from tessera.planner.plan import Plan
from tessera.runtime.checkpoint_files import (
    DATA_FILE, FORMAT_VERSION, MANIFEST, MARKER, PARTIAL_SUFFIX, PLAN_FILE, RNG_FOLDER, STEP_PREFIX, Manifest,
    RootLock, check_checkpoint, check_keep_last, commit_checkpoint, complete_checkpoints, discard_partial,
    has_checkpoint, partial_folder, read_manifest, select_checkpoint, step_folder, write_durably,
)
from tessera.runtime.checkpoint_export import export_model_state_dict
from tessera.runtime.checkpoint_reader import check_plain, load_metadata, load_plain, read_state
from tessera.runtime.file_records import HASH_BLOCK_BYTES, FileRecord
from tessera.runtime.lr_schedule import restore_scheduler, scheduler_state
from tessera.runtime.rank_agreement import all_gather, broadcast, describe_failure, rank, together, world
from tessera.runtime.tied_state import placed_names, read_from_partners, restore_names
from tessera.runtime.tp_styles import unstrided

__all__ = [  # the save/load flow, and the on-disk names of ``checkpoint_files`` so one import serves callers
    "DATA_FILE", "FORMAT_VERSION", "HASH_BLOCK_BYTES", "MANIFEST", "MARKER", "PARTIAL_SUFFIX", "PLAN_FILE",
    "RNG_FOLDER", "STEP_PREFIX", "CheckpointInfo", "Checkpointer", "FileRecord", "Manifest", "PendingSave",
    "TrainingState",
    "check_checkpoint", "complete_checkpoints", "export_model_state_dict", "has_checkpoint", "read_manifest",
    "select_checkpoint", "state_module", "step_folder",
]

log = logging.getLogger(__name__)
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state and param-group settings keyed per FQN (``param_groups.<fqn>.lr``): the nested form keeps
``param_groups`` as one list per rank under one key, which DCP de-duplicates across ranks, so pipeline ranks
(each with its own parameters) would get rank 0's groups back."""


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


class TrainingState(Protocol):
    """What a checkpoint saves and restores; ``ParallelModel`` is one (this module does not import it)."""

    modules: Sequence[nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler | None
    plan: Plan
    step: int
    tied_names: Sequence[tuple[str, ...]]


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
        self._exit_hook = False

    def save(
        self, state: TrainingState, root: str | Path, *, data_state: Any = None, async_save: bool = False,
        keep_last: int | None = None,
    ) -> PendingSave:
        """Write ``root/step-<state.step>``; see the module docstring. Call on every rank."""
        check_keep_last(keep_last)
        check_plain(data_state, what="data_state")  # what a resume could not read back is refused before it is saved
        self.wait()
        root, group = Path(root), self._process_group()
        final, partial = step_folder(root, state.step), partial_folder(root, state.step)
        lock = RootLock.acquire(root, group)
        try:
            _prepare_partial(final, partial, group)
            together(lambda: _write_side_files(state, partial, data_state, group), group,
                     what=f"writing the plan, RNG and data files of {partial}")
            tensors = _writable(_state_dict(state_module(state.modules), state.optimizer))
            step, strategy = state.step, state.plan.strategy.to_string()  # training moves on during an async save

            def commit() -> None:
                commit_checkpoint(partial, final=final, step=step, strategy=strategy, group=group, keep_last=keep_last)

            if not async_save:
                together(lambda: _write_tensors(tensors, partial, group), group, what=f"writing {partial}")
                commit()
                lock.release()
                return PendingSave(final)
            # Not ``together``: DCP's background thread starts using ``group`` as soon as this returns.
            written = _write_async(tensors, partial, group)
            self._finish_at_exit()
        except BaseException:
            discard_partial(partial, group)
            lock.release()
            raise
        self._pending = PendingSave(final, _then(written, commit, cleanup=lambda: discard_partial(partial, group),
                                                 finally_=lock.release))
        return self._pending

    def load(self, state: TrainingState, path: str | Path, *, verify: bool = True) -> CheckpointInfo:
        """Load the checkpoint at ``path`` (a ``step-*`` folder, or a root: the newest intact one) into ``state``.

        Falling back from a root past corrupt newer checkpoints moves them aside (``step-N.corrupt-<time>``),
        so the run can save those steps again."""
        self.wait()
        group = self._process_group()
        folder, skipped = select_checkpoint(Path(path), verify=verify, group=group, set_aside=True)
        manifest = read_manifest(folder)
        data_state = together(lambda: load_plain(folder / DATA_FILE), group,  # before anything is overwritten
                              what=f"reading the data position of {folder}")
        module = state_module(state.modules)
        tensors = _state_dict(module, state.optimizer)  # initialises the optimizer's state: DCP loads into it
        saved = load_metadata(folder).state_dict_metadata
        _check_no_saved_weights_left_out(saved, placed_names(tensors["model"], state.tied_names), folder, group)
        writable = _writable(tensors)
        renamed = read_from_partners(writable, saved, ties=state.tied_names)  # a tied weight saved under one name only
        writable = _saved_settings_only(writable, saved)
        read_state(writable, folder, group)
        restore_names(writable, renamed)
        _copy_back(writable, tensors)
        set_state_dict(module, state.optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"],
                       options=STATE_OPTIONS)
        together(lambda: _restore_rank_state(state, folder, saved_world=manifest.world_size, group=group), group,
                 what=f"restoring the RNG and scheduler states of {folder}")  # a refusal on one rank: on all
        state.step = manifest.step
        return CheckpointInfo(
            path=str(folder), step=manifest.step, saved_world_size=manifest.world_size,
            saved_strategy=manifest.strategy, data_state=data_state,
            skipped=tuple(skipped),
        )

    def _finish_at_exit(self) -> None:
        """Commit a save still in flight when the program ends (once per checkpointer): its files are written by then,
        but only ``wait`` renames the partial folder into place, so a script ending without ``pm.close()`` would
        leave its last checkpoint partial, never loaded."""
        if not self._exit_hook:
            atexit.register(self._commit_at_exit)
            self._exit_hook = True

    def _commit_at_exit(self) -> None:
        if self._pending is None:
            return
        if self._group is not None and not dist.is_initialized():  # its commit agrees over a group that is gone
            self._pending = None
            log.error("a checkpoint save was still in flight when the program ended, after its process group was "
                      "destroyed: it stays partial (never loaded); call pm.close() before destroy_process_group()")
            return
        log.warning("a checkpoint save was still in flight when the program ended: committing it now (call "
                    "pm.close() or pm.wait_for_checkpoint() when training ends)")
        try:
            self.wait()
        except Exception as error:  # noqa: BLE001 (at exit: say it, do not raise over the program's own outcome)
            log.error("the checkpoint in flight at exit was not committed: %s", error)

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


def training_tensors(state: TrainingState) -> dict[str, Any]:
    """What a checkpoint (or an in-memory snapshot) saves of ``state``'s model and optimizer, as DCP state dicts."""
    return _state_dict(state_module(state.modules), state.optimizer)


def _state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by the user's FQNs; tensors are this rank's shards."""
    model_state, optim_state = get_state_dict(module, optimizer, options=STATE_OPTIONS)
    return {"model": model_state, "optim": optim_state}


def _writable(tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` as DCP can write them: strided tensor-parallel splits gathered (``tp_styles.unstrided``)."""
    return tree_map_only(DTensor, unstrided, tensors)


def _check_no_saved_weights_left_out(saved: Mapping[str, Any], names: set[str], folder: Path,
                                     group: dist.ProcessGroup | None) -> None:
    """Refuse a checkpoint holding model tensors no rank's model has (a larger model's): DCP would load the rest and
    drop them without a word. ``names``: this rank's model state names (a pipeline stage holds only its own)."""
    everyone = set().union(*all_gather(sorted(names), group))
    extra = sorted(key.removeprefix("model.") for key in saved if key.startswith("model.")
                   and key.removeprefix("model.") not in everyone)
    if extra:
        raise CheckpointError(f"checkpoint {folder} holds {len(extra)} model tensor(s) this model has no place for "
                              f"(first: {extra[0]}): it was saved from another model; resume with the model it was "
                              "saved from")


def _saved_settings_only(writable: dict[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """``writable`` less the param-group settings the checkpoint does not hold (``initial_lr``, which a scheduler
    passed since it was saved adds): they keep this run's values instead of failing the load."""
    optim = {key: value for key, value in writable["optim"].items()
             if not key.startswith("param_groups.") or f"optim.{key}" in saved}
    return {**writable, "optim": optim}


@torch.no_grad()
def _copy_back(loaded: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Copy what DCP read into gathered copies (:func:`_writable`) back into the shards they were made from, and
    the non-tensor values it read (the param groups' ``lr``, ``betas``...: DCP replaces them in ``loaded``'s dicts,
    which are not ``tensors``') into ``tensors``."""
    for part, state in tensors.items():
        for key, target in state.items():
            source = loaded[part].get(key, target)
            if isinstance(target, DTensor) and source is not target:
                target.copy_(source.redistribute(placements=target.placements))
            elif not isinstance(target, torch.Tensor):
                state[key] = source


def rng_state() -> dict[str, Any]:
    """This process's CPU (and initialised CUDA) generator states and Python ``random``'s."""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rank_state(state: TrainingState, folder: Path, *, saved_world: int,
                        group: dist.ProcessGroup | None) -> None:
    """This rank's saved RNG and scheduler states under the same world size; rank 0's under another (see module
    docstring)."""
    source = rank(group) if saved_world == world(group) else 0
    path = folder / RNG_FOLDER / f"rank-{source:05d}.pt"
    saved = load_plain(path)
    torch.set_rng_state(saved["cpu"])
    random.setstate(saved["python"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    restore_scheduler(state.lr_scheduler, saved.get("lr_scheduler"), source=str(folder),
                      groups=len(state.optimizer.param_groups))


# ------------------------------------------------------------------------------------------------ writing


def _prepare_partial(final: Path, partial: Path, group: dist.ProcessGroup | None) -> None:
    """Rank 0 empties the partial folder (the root is locked: no other save is writing it); every rank raises
    alike if the step was already saved."""
    problem = None
    if rank(group) == 0:
        if final.exists():
            problem = (f"checkpoint {final} already exists; a step is saved once: train on before saving again, "
                       "or move it away to replace it")
        elif partial.is_symlink() or (partial.exists() and not partial.is_dir()):
            problem = (f"{partial} is {'a link' if partial.is_symlink() else 'a file'}, not a save Tessera left "
                       "unfinished; remove it, or save into another folder")
        else:
            try:
                shutil.rmtree(partial, ignore_errors=True)  # left by a save that was interrupted
                partial.mkdir()  # not exist_ok: whatever appeared there since is not this save's
                (partial / RNG_FOLDER).mkdir()
            except OSError as error:
                problem = f"cannot write a checkpoint into {final.parent}: {describe_failure(error)}"
    problem = broadcast(problem, group)
    if problem:
        raise CheckpointError(problem)


def _write_side_files(state: TrainingState, partial: Path, data_state: Any, group: dist.ProcessGroup | None) -> None:
    """Every rank its RNG and scheduler states; rank 0 the plan and the data position."""
    this_rank = rank(group)
    own = {**rng_state(), "lr_scheduler": scheduler_state(state.lr_scheduler)}
    write_durably(partial / RNG_FOLDER / f"rank-{this_rank:05d}.pt", lambda path: torch.save(own, path))
    if this_rank == 0:
        write_durably(partial / PLAN_FILE, lambda path: path.write_text(state.plan.to_json()))
        write_durably(partial / DATA_FILE, lambda path: torch.save(data_state, path))


def _write_tensors(tensors: dict[str, Any], partial: Path, group: dist.ProcessGroup | None) -> None:
    with _single_process_quiet(group):
        dcp.save(tensors, checkpoint_id=partial, process_group=group, no_dist=group is None)


def _write_async(state: dict[str, Any], partial: Path, group: dist.ProcessGroup | None) -> Future:
    """``dcp.async_save``: returns once ``state`` is copied to host memory; the future completes when written."""
    with _single_process_quiet(group):
        written = dcp.async_save(state, checkpoint_id=partial, process_group=group, no_dist=group is None)
    return getattr(written, "upload_completion", written)  # an AsyncSaveResponse with a non-blocking stager


def _then(future: Future, action, *, cleanup, finally_) -> Future:
    """A future that completes after ``future`` and then ``action()`` (run on a background thread); on failure
    ``cleanup()`` runs first; ``finally_()`` runs before the future completes (a waiter sees its effect)."""
    done: Future = Future()

    def run() -> None:
        try:
            future.result()
            action()
        except BaseException as error:  # surfaced by PendingSave.wait
            _quietly(cleanup, error)
            _quietly(finally_, error)
            done.set_exception(error)
            return
        try:
            finally_()
        except BaseException as error:  # noqa: BLE001 -- the waiter must be answered either way
            done.set_exception(error)
            return
        done.set_result(None)

    threading.Thread(target=run, name="tessera-checkpoint-commit", daemon=True).start()
    return done


def _quietly(step, error: BaseException) -> None:
    """Run ``step`` after ``error``; a failure of its own is noted on ``error``, so the waiter still gets an answer
    (a process group destroyed under an async save made the cleanup raise, and the program hung at exit)."""
    try:
        step()
    except BaseException as more:  # noqa: BLE001
        error.add_note(f"then, cleaning up: {type(more).__name__}: {more}")


@contextmanager
def _single_process_quiet(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is what we asked for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
