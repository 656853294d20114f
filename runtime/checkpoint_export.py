"""Exporting a checkpoint's model weights to one plain ``torch.save`` file, in one process (``tessera export``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tessera.errors import CheckpointError
from tessera.files import check_writable_file, write_atomically
from tessera.runtime.checkpoint_files import MANIFEST, MARKER, read_manifest, select_checkpoint, step_of
from tessera.runtime.checkpoint_reader import load_metadata, read_state


def export_model_state_dict(
    checkpoint: str | Path, out: str | Path, *, verify: bool = True, overwrite: bool = False
) -> Path:
    """Write the model's weights of ``checkpoint`` (a folder or a root) to one ``torch.save`` file.

    The file is a plain ``{fqn: tensor}`` state dict of full tensors: ``model.load_state_dict(torch.load(out))``
    works on the unsharded model. Runs in one process (reads every shard); needs no process group. An existing
    ``out`` is replaced only with ``overwrite=True``; the file appears whole or not at all.
    """
    out = check_writable_file(out, what="export file", replace_any=True)  # whose file it is: asked just below
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; choose another file name or pass overwrite=True "
                              "(tessera export --overwrite) to replace it")
    folder, _ = select_checkpoint(Path(checkpoint), verify=verify, group=None)
    inside = next((parent for parent in out.resolve().parents if step_of(parent) is not None
                   or (parent / MANIFEST).exists() or (parent / MARKER).exists()), None)
    if inside is not None:  # replacing one of its files would corrupt that checkpoint
        raise CheckpointError(f"{out} is inside the checkpoint {inside}; write the export elsewhere")
    metadata = load_metadata(folder)
    weights = _empty_weights(folder, metadata)
    read_state({"model": weights}, folder, None)
    return write_atomically(out, lambda path: _save_weights(weights, path), what="export file", replace_any=True)


def _save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    """``torch.save`` through a file object: given a path it names the archive's folder after the (temporary) file,
    so two exports of one checkpoint differed byte for byte."""
    with open(path, "wb") as handle:
        torch.save(weights, handle)


def _empty_weights(folder: Path, metadata: Any) -> dict[str, torch.Tensor]:
    """An empty full tensor per model weight the metadata lists, after checking the files can hold them all (so
    metadata claiming absurd sizes fails with a message, not an allocation error)."""
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(key, ())  # ("model", "blocks.0.attn.q.weight")
        if path and path[0] == "model" and isinstance(item, TensorStorageMetadata):
            shapes[".".join(str(part) for part in path[1:])] = (item.size, item.properties.dtype)
    claimed = sum(size.numel() * dtype.itemsize for size, dtype in shapes.values())
    stored = sum(record.size_bytes for name, record in read_manifest(folder).files.items() if name.endswith(".distcp"))
    if claimed > stored:
        raise CheckpointError(f"checkpoint {folder}: its metadata lists {claimed:,} bytes of weights but its data "
                              f"files hold {stored:,}; the metadata is corrupt, load an older checkpoint")
    return {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in shapes.items()}
