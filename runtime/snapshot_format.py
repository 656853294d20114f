"""One rank's share of an in-memory snapshot as one file: its shards of the model and optimizer state in one flat
byte buffer behind a JSON header that says what each byte range is, so that a load under another plan can
reshard them (``runtime.snapshot_staging`` builds them, ``runtime.snapshots`` writes them, ``runtime.snapshot_recovery``
reads them).

**Why not DCP's format.** A snapshot is taken after every step or few; ``dcp.save`` writes each state-dict entry
as its own ``torch.save`` item, and the optimizer's flattened state has about a thousand of them for a 4-layer
model (three quarters are per-parameter param-group settings): 0.65 s for 2.8 MB in one process, where copying
the same bytes into one buffer takes 1.4 ms and writing them 2 ms (measured on this project's 2-core machine).
Disk checkpoints stay on DCP (``runtime.checkpoint``).

**The file** ``rank-00003.snap``: 8 bytes (the header's length, little-endian), the header (JSON, padded with
spaces so that the data starts at a multiple of :data:`ALIGN` and the header's changing tail has room; the
length counts the spaces), then the data. The header lists every chunk -- its state key
(``model.<fqn>``, ``optim.state.<fqn>.exp_avg``), dtype, the tensor's global shape, the chunk's offsets and
shape within it (DCP's description of a shard, ``compute_local_shape_and_global_offset``) and where its bytes
start -- and every non-tensor value (``optim.param_groups.<fqn>.lr``...; tuples tagged so that they come back as
tuples). The optimizer's param-group settings (``lr``, ``betas``...) are kept per group, not per parameter:
``group_params`` lists each group's FQNs and ``group_settings`` its settings, and a load expands them into
DCP's ``optim.param_groups.<fqn>.<setting>`` values; ``lr_scheduler`` is the rank's learning-rate scheduler's
``state_dict()`` (or ``null``). The rank's RNG states are chunks too: ``rng.cpu`` and ``rng.cuda.<i>`` (the generators' byte states)
and ``rng.python`` (``random.getstate()`` packed as :data:`PYTHON_RNG`). Reading one parses JSON and views bytes:
nothing in it can run code.

**Resharding.** A load computes, for each tensor of the new plan's state, the chunk this rank holds, copies in
every saved chunk's overlap with it (one copy of a chunk several files hold), and checks that the overlaps cover
it exactly; it reads only the files that hold such chunks (:func:`files_to_read`).
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # what DCP describes shards by

from tessera.errors import CheckpointError

FORMAT = "tessera-snapshot-4"
ALIGN = 64
"""Every chunk starts at a multiple of this many bytes, so a byte view of it can be viewed as any dtype."""
LENGTH = struct.Struct("<Q")
PYTHON_RNG = struct.Struct("<627qd")
"""``random.getstate()`` as bytes: its version, the 624 Mersenne Twister words and the position, whether a
Gaussian is cached (0/1), then that Gaussian (0.0 when none)."""
RNG_PYTHON = "rng.python"
GROUPS = "optim.param_groups."
"""DCP's prefix of the flattened optimizer's per-parameter group settings (``optim.param_groups.<fqn>.lr``)."""


SHARD_SUFFIX = ".snap"


def shard_file(rank: int) -> str:
    """The name of ``rank``'s file in a snapshot folder."""
    return f"rank-{rank:05d}{SHARD_SUFFIX}"


class Chunk(BaseModel):
    """One tensor chunk in a file: which part of which tensor, and where its bytes are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int = Field(ge=0)
    """Where its bytes start, counted from the data's start."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


class Header(BaseModel):
    """What a file holds (its JSON header)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["tessera-snapshot-2", "tessera-snapshot-3", "tessera-snapshot-4"]
    """4: small replicated chunks in every holder's file; 3: param-group settings per group; 2: the first."""
    rank: int
    chunks: tuple[Chunk, ...]
    values: dict[str, Any]
    """Non-tensor state values, JSON with tuples as ``{"tuple": [...]}`` and dicts as ``{"dict": {...}}``."""
    group_params: tuple[tuple[str, ...], ...] = ()
    """The FQNs of each optimizer param group's parameters."""
    group_settings: tuple[dict[str, Any], ...] = ()
    """Each param group's settings (encoded as ``values``), for every FQN of the group."""
    lr_scheduler: Any = None
    """The rank's learning-rate scheduler's ``state_dict()`` (encoded as ``values``), or ``None``."""

    @model_validator(mode="after")
    def _one_setting_per_group(self) -> Header:
        if len(self.group_params) != len(self.group_settings):
            raise ValueError(f"{len(self.group_params)} param groups but {len(self.group_settings)} groups' settings")
        return self


# ------------------------------------------------------------------------------------------------ reading


class Shard:
    """One rank's file, read: its header and its data (memory-mapped, copy-on-write)."""

    def __init__(self, path: Path) -> None:
        size = path.stat().st_size
        if size < LENGTH.size:
            raise CheckpointError(f"snapshot file {path} is truncated ({size} bytes)")
        raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        (length,) = LENGTH.unpack(raw[:LENGTH.size].numpy().tobytes())
        try:
            if LENGTH.size + length > size:
                raise ValueError(f"its header claims {length:,} bytes, the file has {size:,}")
            self.header = Header.model_validate(json.loads(raw[LENGTH.size:LENGTH.size + length].numpy().tobytes()))
            self.data = raw[aligned(LENGTH.size + length):]
            for chunk in self.header.chunks:
                _check_chunk(chunk, self.data.numel())
        except (ValueError, ValidationError, UnicodeDecodeError) as error:
            raise CheckpointError(f"snapshot file {path} is unreadable ({str(error).splitlines()[0][:200]}); "
                                  "an older snapshot or the disk checkpoint is used instead") from None
        self.path = path

    def tensor(self, chunk: Chunk) -> torch.Tensor:
        return chunk_view(self.data, chunk)

    def lr_scheduler(self) -> dict[str, Any] | None:
        """The learning-rate scheduler's ``state_dict()`` this rank saved, or ``None``."""
        return _decode(self.header.lr_scheduler)

    def rng(self) -> tuple[dict[str, torch.Tensor], Any]:
        """This file's generator states by name (``rng.cpu``, ``rng.cuda.<i>``), and Python's state (``None``
        when the file has none of the right size)."""
        found = {c.key: self.tensor(c) for c in self.header.chunks if c.key.startswith("rng.")}
        packed = found.pop(RNG_PYTHON, None)
        if packed is None or packed.numel() != PYTHON_RNG.size:
            return found, None
        version, *internal, cached, gauss = PYTHON_RNG.unpack(packed.numpy().tobytes())
        return found, (version, tuple(internal), gauss if cached else None)


def load_shards(tensors: dict[str, dict[str, Any]], shards: list[Shard]) -> None:
    """Fill ``tensors`` (this rank's state dicts under the new plan) from ``shards`` (every rank's file of the
    snapshot): each tensor from the saved chunks that overlap its own chunk, each value from the header that has
    it. ``CheckpointError`` if a tensor is not covered or has another shape, or a value is missing."""
    chunks: dict[str, list[tuple[Chunk, Shard]]] = {}
    values: dict[str, Any] = {}
    for shard in shards:
        for chunk in shard.header.chunks:
            chunks.setdefault(chunk.key, []).append((chunk, shard))
        for key, value in shard.header.values.items():
            values.setdefault(key, value)
        for fqns, settings in zip(shard.header.group_params, shard.header.group_settings):
            for fqn in fqns:
                for setting, value in settings.items():
                    values.setdefault(f"{GROUPS}{fqn}.{setting}", value)
    for part, state in tensors.items():
        for name, target in state.items():
            key = f"{part}.{name}"
            if isinstance(target, torch.Tensor):
                _fill(target, key, chunks.get(key, []))
            elif key in values:
                state[name] = _decode(values[key])
            elif key.startswith(GROUPS):
                continue  # a setting added since (a scheduler's initial_lr) keeps this run's value, as on disk
            else:
                raise CheckpointError(f"the snapshot has no value for {key}; it was taken from another model or "
                                      "optimizer: resume with the ones it was taken from")


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk's ``(offsets, shape)`` within its tensor."""


_SETTINGS = "settings."
"""Key prefix of a parameter's param-group settings in the boxes below (a zero-dimensional box: all or nothing)."""


def held_boxes(tensors: dict[str, dict[str, Any]]) -> dict[str, Box]:
    """Per state key, the box of the chunk this rank holds of each tensor in ``tensors``: what a load fills; and
    ``settings.<fqn>`` for each parameter whose param-group settings it takes."""
    boxes = {key: geometry(value)[1:] for key, value in flat_items(tensors) if isinstance(value, torch.Tensor)}
    return boxes | {f"{_SETTINGS}{fqn}": ((), ()) for fqn in _setting_fqns(key for key, _ in flat_items(tensors))}


class SavedKeys:
    """The state keys a snapshot holds, from its files' :func:`state_boxes` (``chunks``: per file); a param-group
    setting (``optim.param_groups.<fqn>.<setting>``) where the snapshot holds that parameter's settings."""

    def __init__(self, chunks: dict[str, list[tuple[str, Box]]]) -> None:
        self._keys = {key for boxes in chunks.values() for key, _ in boxes}

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and key.startswith(GROUPS):
            return f"{_SETTINGS}{key[len(GROUPS):].rsplit('.', 1)[0]}" in self._keys
        return key in self._keys


def state_boxes(shard: Shard) -> list[tuple[str, Box]]:
    """The state chunks of ``shard`` (its RNG states aside), by key and box, and ``settings.<fqn>`` for each
    parameter whose param-group settings it holds."""
    fqns = {fqn for group in shard.header.group_params for fqn in group} | _setting_fqns(shard.header.values)
    return ([(c.key, (c.offsets, c.shape)) for c in shard.header.chunks if not c.key.startswith("rng.")]
            + [(f"{_SETTINGS}{fqn}", ((), ())) for fqn in sorted(fqns)])


def _setting_fqns(keys: Iterable[str]) -> set[str]:
    """The parameters named by DCP's flattened settings keys (``optim.param_groups.<fqn>.<setting>``)."""
    return {key[len(GROUPS):].rsplit(".", 1)[0] for key in keys if key.startswith(GROUPS)}


def files_to_read(wanted: dict[str, Box], chunks: dict[str, list[tuple[str, Box]]], *, first: str) -> set[str]:
    """The files a rank reads: for every saved chunk (``chunks``: per file, its chunks) that overlaps a box the
    rank ``wanted``, one file holding it, ``first`` and the files already chosen preferred (a small replicated
    chunk is in every holder's file: one of them is enough)."""
    holding: dict[str, dict[Box, list[str]]] = {}
    for name, boxes in sorted(chunks.items()):
        for key, box in boxes:
            holding.setdefault(key, {}).setdefault(box, []).append(name)
    needs = [names for key, want in wanted.items() for box, names in holding.get(key, {}).items()
             if _overlap(want, box)]
    chosen = {first} | {names[0] for names in needs if len(names) == 1}  # the files nothing else can replace first
    for names in sorted(needs, key=len):
        if chosen.isdisjoint(names):
            chosen.add(names[0])
    return chosen


def _overlap(a: Box, b: Box) -> bool:
    return all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))


def _fill(target: torch.Tensor, key: str, saved: list[tuple[Chunk, Shard]]) -> None:
    global_shape, offsets, shape = geometry(target)
    local, covered, copied = local_tensor(target), 0, set()
    for chunk, shard in saved:
        if (chunk.offsets, chunk.shape) in copied:
            continue  # a small replicated chunk: every holder wrote it, one copy is enough
        copied.add((chunk.offsets, chunk.shape))
        if chunk.global_shape != global_shape:
            raise CheckpointError(f"the snapshot's {key} has shape {list(chunk.global_shape)}, this model's "
                                  f"{list(global_shape)}; resume with the model it was taken from")
        box = [(max(a, b), min(a + n, b + m)) for a, n, b, m in zip(offsets, shape, chunk.offsets, chunk.shape)]
        if any(lo >= hi for lo, hi in box):
            continue
        into, source = local, shard.tensor(chunk)
        for dim, (lo, hi) in enumerate(box):
            into = into.narrow(dim, lo - offsets[dim], hi - lo)
            source = source.narrow(dim, lo - chunk.offsets[dim], hi - lo)
        with torch.no_grad():
            into.copy_(source)
        covered += math.prod(hi - lo for lo, hi in box)
    if covered != local.numel():
        raise CheckpointError(f"the snapshot holds {covered:,} of the {local.numel():,} elements of {key} this "
                              "rank needs (its files are incomplete or from another model)")


def _check_chunk(chunk: Chunk, data_bytes: int) -> None:
    _dtype(chunk.dtype)
    if not len(chunk.global_shape) == len(chunk.offsets) == len(chunk.shape):
        raise ValueError(f"chunk {chunk.key} has shapes of different lengths")
    if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.shape, chunk.global_shape)):
        raise ValueError(f"chunk {chunk.key} lies outside its tensor")
    if chunk.start % ALIGN or chunk.start + chunk.nbytes > data_bytes:
        raise ValueError(f"chunk {chunk.key} lies outside the file's data")


# ------------------------------------------------------------------------------------------------ helpers


def flat_items(tensors: dict[str, dict[str, Any]]) -> Iterator[tuple[str, Any]]:
    for part, state in tensors.items():
        for name, value in state.items():
            yield f"{part}.{name}", value


def geometry(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(global shape, offsets, shape)`` of this rank's chunk of ``tensor`` (all of it unless a ``DTensor``)."""
    if isinstance(tensor, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(tensor.shape), tuple(offsets), tuple(shape)
    return tuple(tensor.shape), (0,) * tensor.dim(), tuple(tensor.shape)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def rng_tensors() -> list[tuple[str, torch.Tensor]]:
    found = [("rng.cpu", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found += [(f"rng.cuda.{i}", state) for i, state in enumerate(torch.cuda.get_rng_state_all())]
    return found


def chunk_view(data: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    return data[chunk.start:chunk.start + chunk.nbytes].view(_dtype(chunk.dtype)).view(chunk.shape)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def encode_value(value: Any, key: str) -> Any:
    """``value`` as JSON: plain numbers, strings, lists, and tuples as ``{"tuple": [...]}``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [encode_value(item, key) for item in value]
        return {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, Counter) and all(isinstance(name, int) for name in value):  # MultiStepLR's milestones
        return {"counter": [[name, count] for name, count in value.items()]}
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        return {"dict": {name: encode_value(item, f"{key}.{name}") for name, item in value.items()}}
    raise CheckpointError(f"snapshots hold numbers, strings, lists, tuples, dicts with string keys, counters and tensors; {key} "
                          f"is a {type(value).__name__}: keep it out of the optimizer's param groups (and the "
                          "scheduler's state) or train without snapshots")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"tuple"} and isinstance(value["tuple"], list):
            return tuple(_decode(item) for item in value["tuple"])
        if set(value) == {"dict"} and isinstance(value["dict"], dict):
            return {name: _decode(item) for name, item in value["dict"].items()}
        if set(value) == {"counter"} and isinstance(value["counter"], list) and all(
                isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, int) for n in pair)
                for pair in value["counter"]):
            return Counter(dict(value["counter"]))
        raise CheckpointError(f"snapshot header holds an unknown value {str(value)[:80]}")
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value
