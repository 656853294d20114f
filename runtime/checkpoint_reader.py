"""Reading a checkpoint someone else wrote without running code from it.

DCP stores two things with ``pickle``: the ``.metadata`` file (which tensor chunk lives where) and every
non-tensor value of the state dict (an optimizer's ``lr``, ``betas``...), which its default load planner reads
back with ``torch.load(weights_only=False)``. Unpickling runs whatever callables the file names, so a crafted
checkpoint would run code the moment it is loaded; the manifest's SHA-256s do not help, since whoever crafts the
file recomputes them. Tessera therefore reads both through restricted loaders:

- :class:`SafeReader` unpickles ``.metadata`` admitting only DCP's own metadata classes, ``torch.Size``, dtypes,
  layouts, memory formats and paths (:data:`METADATA_GLOBALS`); anything else is a ``CheckpointError`` naming
  the file and the refused name, before a single object is built from it. It also refuses metadata whose data
  files lie outside the checkpoint folder.
- :class:`SafeLoadPlanner` reads non-tensor values with ``torch.load(weights_only=True)`` (plain containers,
  numbers, strings, tensors), as DCP already does for tensors.

Everything else a load reads is JSON (``manifest.json``, ``plan.json``) or is read with ``weights_only=True``
(``data.pt``, ``rng/*.pt``).
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses

from tessera.errors import CheckpointError
from tessera.files import open_plain_file
from tessera.runtime.checkpoint_files import is_inside

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: a lookup by name
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
})
"""The only globals a DCP ``.metadata`` file may name (seen in files torch 2.13 writes)."""
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allowed set."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only checkpoint-metadata objects (Python docs, "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(value := getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return value  # torch.float32 and friends are pickled by name
        raise RefusedGlobal(f"{module}.{name}")


def load_metadata(folder: Path) -> Metadata:
    """The DCP metadata of ``folder``, unpickled with :class:`_MetadataUnpickler` and checked."""
    path = folder / METADATA_FILE
    try:
        with open_plain_file(path) as handle:  # not a FIFO left in a received checkpoint: it would block
            metadata = _MetadataUnpickler(handle).load()
    except RefusedGlobal as error:
        raise CheckpointError(
            f"checkpoint {folder}: {METADATA_FILE} names {error}, which checkpoint metadata never holds; refusing "
            "to load it (a crafted file runs code when unpickled); ask its sender for a checkpoint Tessera wrote"
        ) from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError, IndexError) as error:
        raise CheckpointError(f"checkpoint {folder}: {METADATA_FILE} is unreadable ({type(error).__name__}: "
                              f"{str(error)[:200]}); load an older checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {folder}: {METADATA_FILE} holds a {type(metadata).__name__}, not DCP "
                              "metadata; load an older checkpoint")
    _check_data_files(folder, metadata)
    return metadata


def _check_data_files(folder: Path, metadata: Metadata) -> None:
    """Every data file the metadata points to is a plain name inside ``folder`` (no ``..``, no absolute path)."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not is_inside(name):
            raise CheckpointError(f"checkpoint {folder}: {METADATA_FILE} points to data file {str(name)[:120]!r} "
                                  "outside the checkpoint folder; refusing to read it")


class SafeReader(FileSystemReader):
    """DCP's file-system reader with :func:`load_metadata` instead of a plain ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: Tessera never writes them
            raise CheckpointError(f"checkpoint {self.path}: per-rank metadata files are not supported")
        metadata = load_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def named_global(error: pickle.UnpicklingError) -> str:
    """What a refused pickle names, from torch's ``weights_only`` message (``builtins.exec``), or 'a Python
    object' where the message names none."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return found[1] if found else "a Python object"


def load_plain(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``: plain containers of numbers, strings and tensors; a file naming
    anything else, or unreadable, is a ``CheckpointError`` (torch's own message advises ``weights_only=False``,
    which would run what the file names)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"checkpoint file {path} is not plain data (it names {named_global(error)}); refusing "
                              "to load it (a crafted file runs code when unpickled)") from None
    except (OSError, EOFError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:200] if str(error) else ''})") from None


def check_plain(value: Any, *, what: str) -> None:
    """Refuse ``value`` unless :func:`load_plain` would read it back: plain containers of numbers, strings and
    tensors (a NumPy integer, a ``datetime`` or a ``Path`` saves, and no resume could load it)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{what} holds {named_global(error)}, which a resume would refuse "
                              "to unpickle (it reads plain containers of numbers, strings and tensors); convert it "
                              "(NumPy values to tensors or Python numbers, paths and dates to strings)") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} is not plain data (it names {named_global(error)}); "
                "refusing to load it (a crafted file runs code when unpickled)"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_state(state: dict[str, Any], folder: Path, group: dist.ProcessGroup | None) -> None:
    """``dcp.load`` of ``folder`` into ``state`` through :class:`SafeReader` and :class:`SafeLoadPlanner`; a
    failure on any rank is one ``CheckpointError`` (the refusal itself, or what went wrong)."""
    try:
        with warnings.catch_warnings():  # without a process group DCP warns it assumes one process: as asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=folder, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(),
                     process_group=group, no_dist=group is None)
    except CheckpointException as error:
        inner = next(iter(error.failures.values()))[0] if error.failures else error
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"cannot load checkpoint {folder}: {type(inner).__name__}: "
                              f"{str(inner).splitlines()[0][:300] if str(inner) else ''}") from None
