"""One rank's share of an in-memory snapshot as one file: its shards of the model and optimizer state in one flat
byte buffer behind a JSON header that says what each byte range is, so that a load under another plan can
reshard them (``runtime.snapshots`` writes these files, ``runtime.snapshot_recovery`` reads them).

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

**Staged as the file itself.** Most of the header depends only on the state's layout (which chunks, which
values), so :class:`StagedShards` builds it once and keeps the whole file in one buffer: header in front, chunks
behind. A snapshot refills the chunks (one ``_foreach_copy_`` and one ``struct.pack_into`` on the training thread)
and then writes, hashes and sends that one buffer as it is: no per-tensor Python, one ``write``, one hash (the
header's share of it computed again only when the header changed), one message to the buddy. What changes from
step to step without changing the layout -- the learning rate a scheduler sets, the scheduler's own state -- is
the header's tail (``group_settings``, ``lr_scheduler``), rewritten in place in the header's slack (spaces, which
JSON ignores) when it changed: a schedule that moves the learning rate every step would otherwise rebuild the
staging (DCP's ``get_state_dict``: 16 ms against 0.8 ms for the refill, one process, the 4-layer tiny GPT).

**Each chunk is written once.** A chunk held by several ranks (DDP's replicas, a tensor-parallel shard's dp
replicas) is written by one of them, chosen to balance the bytes each rank writes: the de-duplication DCP does
for disk checkpoints, by the same key (state key and offsets: ranks holding the same chunk hold the same
values). The choice is one all-gather of every rank's chunk list, made again only when that list changes.
Small replicated chunks (at most :data:`SMALL_REPLICA` bytes: optimizer steps, the biases and norms of tiny
models) are the exception: every holder writes them, so that a rank's own file has all the small state it shares
and a restart under the same plan reads that file alone (:func:`files_to_read`).

**Resharding.** A load computes, for each tensor of the new plan's state, the chunk this rank holds, copies in
every saved chunk's overlap with it (one copy of a chunk several files hold), and checks that the overlaps cover
it exactly; it reads only the files that hold such chunks (:func:`files_to_read`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # what DCP describes shards by

from tessera.errors import CheckpointError, ConfigError
from tessera.runtime.checkpoint_files import FileRecord, all_gather
from tessera.runtime.tp_styles import unstrided

FORMAT = "tessera-snapshot-4"
ALIGN = 64
"""Every chunk starts at a multiple of this many bytes, so a byte view of it can be viewed as any dtype."""
_LENGTH = struct.Struct("<Q")
PYTHON_RNG = struct.Struct("<627qd")
"""``random.getstate()`` as bytes: its version, the 624 Mersenne Twister words and the position, whether a
Gaussian is cached (0/1), then that Gaussian (0.0 when none)."""
_RNG_PYTHON = "rng.python"
_GROUPS = "optim.param_groups."
"""DCP's prefix of the flattened optimizer's per-parameter group settings (``optim.param_groups.<fqn>.lr``)."""
SMALL_REPLICA = 1024
"""Replicated chunks of at most this many bytes are written by every rank holding them (:func:`_writers`)."""
_SLACK = 512
"""Bytes of spaces the header keeps at least for its tail to grow into (a longer learning rate, a scheduler's
counters); as many as the tail has, if more."""


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


# ------------------------------------------------------------------------------------------------ writing


class StagedShards:
    """This rank's file of a snapshot, kept in one buffer reused by every snapshot of the same state layout: the
    header (built once; its tail rewritten when a group setting or the scheduler changed), then its chunks and RNG
    states (:meth:`refill`: the only part on the training thread)."""

    def __init__(self, tensors: dict[str, dict[str, Any]], group: dist.ProcessGroup | None, *,
                 assignments: dict, param_groups: list[dict[str, Any]] | None = None,
                 lr_scheduler: dict[str, Any] | None = None) -> None:
        """``assignments`` caches the de-duplication per chunk list (shared by every staging of a run);
        ``param_groups``: the optimizer's, whose settings the header then keeps per group (else as DCP's
        per-parameter values, fixed at this staging); ``lr_scheduler``: the scheduler's state now (its header
        room is sized by it)."""
        rank = dist.get_rank(group) if group is not None else 0
        held = [(key, value, _geometry(value)) for key, value in _flat(tensors) if isinstance(value, torch.Tensor)]
        _refuse_strided_splits(held)
        signature = tuple((key, geometry, value.dtype.itemsize) for key, value, geometry in held)
        if signature not in assignments:
            assignments[signature] = _writers(signature, group)
        chunks, self._sources = self._own_chunks(held, assignments[signature], rank)
        start = _aligned(chunks[-1].start + chunks[-1].nbytes) if chunks else 0
        for name, state in [*_rng_tensors(), (_RNG_PYTHON, torch.empty(PYTHON_RNG.size, dtype=torch.uint8))]:
            chunks.append(Chunk(key=name, dtype=_dtype_name(state.dtype), global_shape=tuple(state.shape),
                                offsets=(0,) * state.dim(), shape=tuple(state.shape), start=start))
            start = _aligned(start + chunks[-1].nbytes)
        values = {key: value for key, value in _flat(tensors) if not isinstance(value, torch.Tensor)}
        self._group_params = _group_fqns(values, param_groups) if param_groups is not None else None
        """Each param group's FQNs, or ``None``: the settings stay in ``values`` and a change needs a new staging."""
        if self._group_params is not None:
            values = {key: value for key, value in values.items() if not key.startswith(_GROUPS)}
        self._fixed_settings = _settings(param_groups) if param_groups is not None else None
        self._static = json.dumps({"format": FORMAT, "rank": rank, "chunks": [c.model_dump() for c in chunks],
                                   "values": {key: _encode(value, key) for key, value in values.items()},
                                   "group_params": self._group_params or []}).encode()
        tail = self._tail(param_groups, lr_scheduler)
        capacity = _aligned(_LENGTH.size + len(self._static) + len(tail) + max(_SLACK, len(tail)))
        self.file = torch.empty(capacity + start, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        """The whole file: header (padded with spaces), then every chunk's bytes at its ``start`` (refilled in
        place)."""
        self._prefix = self.file[:capacity].numpy()
        self._prefix[:_LENGTH.size] = numpy.frombuffer(_LENGTH.pack(capacity - _LENGTH.size), dtype=numpy.uint8)
        self._data = self.file[capacity:]
        self._views = [_view(self._data, chunk) for chunk in chunks[:-1]]
        self._python = _view(self._data, chunks[-1]).numpy()
        self._written_tail: bytes | None = None
        self._prefix_digest: Any = None
        """The header's share of the file's SHA-256 (hashed again only after the header changed)."""
        self._write_header(tail)

    @staticmethod
    def _own_chunks(held: list, writers: list[int], rank: int) -> tuple[list[Chunk], list[torch.Tensor]]:
        """The chunks this rank writes (packed, aligned) and the tensors they are copied from."""
        chunks, sources, start = [], [], 0
        for (key, value, (global_shape, offsets, shape)), writer in zip(held, writers):
            if writer in (rank, None):
                chunks.append(Chunk(key=key, dtype=_dtype_name(value.dtype), global_shape=global_shape,
                                    offsets=offsets, shape=shape, start=start))
                sources.append(_local(value))
                start = _aligned(start + chunks[-1].nbytes)
        return chunks, sources

    def refill(self, param_groups: list[dict[str, Any]] | None = None, lr_scheduler: dict[str, Any] | None = None
               ) -> bool:
        """Copy the current state and RNG states into the file (device to host where the state is on a device),
        and the param groups' settings and the scheduler's state (``state_dict()``) into the header. ``False``
        (nothing copied) when the header cannot take them: a setting changed while the settings are fixed at
        staging, or the tail outgrew the header's slack; stage again then."""
        if param_groups is None and self._group_params is not None:
            return False  # the header keeps the groups' settings: they must be given
        if param_groups is not None and self._group_params is None and _settings(param_groups) != self._fixed_settings:
            return False
        tail = self._tail(param_groups, lr_scheduler)
        if tail != self._written_tail and not self._write_header(tail):
            return False
        rng = [state for _, state in _rng_tensors()]
        with torch.no_grad():
            torch._foreach_copy_(self._views, self._sources + rng)
        version, internal, gauss = random.getstate()
        PYTHON_RNG.pack_into(self._python, 0, version, *internal, gauss is not None, gauss or 0.0)
        return True

    @property
    def nbytes(self) -> int:
        return self.file.numel()

    def record(self) -> FileRecord:
        """The file's size and SHA-256, hashed from memory (the header's share cached while it is unchanged;
        hashlib releases the GIL on large buffers, so training runs on meanwhile)."""
        if self._prefix_digest is None:
            self._prefix_digest = hashlib.sha256(memoryview(self._prefix))
        digest = self._prefix_digest.copy()
        digest.update(memoryview(self._data.numpy()))
        return FileRecord(size_bytes=self.nbytes, sha256=digest.hexdigest())

    def _tail(self, param_groups: list[dict[str, Any]] | None, lr_scheduler: dict[str, Any] | None) -> bytes:
        """The header's changing part: the groups' settings (when kept per group) and the scheduler's state."""
        settings = [{key: _encode(value, f"param group {i}'s {key}") for key, value in group.items() if key != "params"}
                    for i, group in enumerate(param_groups)] if self._group_params is not None and param_groups else []
        return json.dumps({"group_settings": settings, "lr_scheduler": _encode(lr_scheduler, "lr_scheduler")}).encode()

    def _write_header(self, tail: bytes) -> bool:
        """The header (the fixed part, then ``tail``, as one JSON object) into the file, padded with spaces;
        ``False`` if it does not fit."""
        header = self._static[:-1] + b", " + tail[1:]
        room = self._prefix.size - _LENGTH.size
        if len(header) > room:
            return False
        self._prefix[_LENGTH.size:_LENGTH.size + len(header)] = numpy.frombuffer(header, dtype=numpy.uint8)
        self._prefix[_LENGTH.size + len(header):] = ord(" ")
        self._written_tail, self._prefix_digest = tail, None
        return True


def _settings(param_groups: list[dict[str, Any]]) -> list[list[tuple[str, Any]]]:
    return [[(key, value) for key, value in group.items() if key != "params"] for group in param_groups]


def _group_fqns(values: dict[str, Any], param_groups: list[dict[str, Any]]) -> tuple[tuple[str, ...], ...] | None:
    """Each param group's FQNs, read from DCP's flattened settings (``optim.param_groups.<fqn>.<setting>``, written
    group by group, each group's parameters in turn), or ``None`` where the values do not bear that reading out:
    every group's settings must be exactly the values under its FQNs."""
    keys = [key for key in values if key.startswith(_GROUPS)]
    order = list(dict.fromkeys(key[len(_GROUPS):].rsplit(".", 1)[0] for key in keys))
    sizes = [len(group["params"]) for group in param_groups]
    if len(order) != sum(sizes) or len(keys) != sum(size * (len(g) - 1) for size, g in zip(sizes, param_groups)):
        return None
    groups, start = [], 0
    for size, group in zip(sizes, param_groups):
        fqns = tuple(order[start:start + size])
        start += size
        if any(values.get(f"{_GROUPS}{fqn}.{key}", _MISSING) != value
               for fqn in fqns for key, value in group.items() if key != "params"):
            return None
        groups.append(fqns)
    return tuple(groups)


_MISSING = object()


def _refuse_strided_splits(held: list) -> None:
    """A packed tensor-parallel split (``q|k|v`` under tp: a strided shard) is several chunks per rank, which this
    format's one box per tensor cannot describe; disk checkpoints write it gathered (``tp_styles.unstrided``, a
    collective per save). Refused here, on every rank alike (the placements are the plan's), not written wrong."""
    packed = [key for key, value, _ in held if isinstance(value, DTensor) and unstrided(value) is not value]
    if packed:
        raise ConfigError(f"in-memory snapshots cannot hold packed tensor-parallel splits yet ({packed[0]} and "
                          f"{len(packed) - 1} more are strided shards); train without snapshots=, or with tp=1, and "
                          "rely on disk checkpoints (pm.save), which hold them")


def write_shard(path: Path, file: torch.Tensor) -> FileRecord:
    """Write ``file`` (bytes) to ``path``; its size and SHA-256, hashed from memory."""
    view = memoryview(file.numpy()) if file.numel() else b""
    with path.open("wb") as handle:
        handle.write(view)
    return FileRecord(size_bytes=file.numel(), sha256=hashlib.sha256(view).hexdigest())


def _writers(signature: tuple, group: dist.ProcessGroup | None) -> list[int | None]:
    """For each of this rank's chunks, the rank that writes it: among the ranks holding the same chunk (same
    key, offsets and shape), the one with the fewest bytes so far, largest chunks first (every rank computes
    the same answer from the same gathered lists); ``None`` for a chunk of at most :data:`SMALL_REPLICA` bytes,
    which every holder writes, so that a rank's own file has the small state it shares (optimizer steps, norms)
    and a restart under the same plan reads that file alone."""
    everyone = all_gather(signature, group)
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    for rank, chunks in enumerate(everyone):
        for key, (_, offsets, shape), itemsize in chunks:
            holders.setdefault((key, offsets, shape), []).append(rank)
            sizes[(key, offsets, shape)] = math.prod(shape) * itemsize
    written = [0] * len(everyone)
    writer = {}
    for chunk in sorted(holders, key=lambda c: (-sizes[c], c)):
        writer[chunk] = min(holders[chunk], key=lambda r: (written[r], r))
        written[writer[chunk]] += sizes[chunk]
    return [None if sizes[(key, offsets, shape)] <= SMALL_REPLICA else writer[(key, offsets, shape)]
            for key, (_, offsets, shape), _ in signature]


# ------------------------------------------------------------------------------------------------ reading


class Shard:
    """One rank's file, read: its header and its data (memory-mapped, copy-on-write)."""

    def __init__(self, path: Path) -> None:
        size = path.stat().st_size
        if size < _LENGTH.size:
            raise CheckpointError(f"snapshot file {path} is truncated ({size} bytes)")
        raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        (length,) = _LENGTH.unpack(raw[:_LENGTH.size].numpy().tobytes())
        try:
            if _LENGTH.size + length > size:
                raise ValueError(f"its header claims {length:,} bytes, the file has {size:,}")
            self.header = Header.model_validate(json.loads(raw[_LENGTH.size:_LENGTH.size + length].numpy().tobytes()))
            self.data = raw[_aligned(_LENGTH.size + length):]
            for chunk in self.header.chunks:
                _check_chunk(chunk, self.data.numel())
        except (ValueError, ValidationError, UnicodeDecodeError) as error:
            raise CheckpointError(f"snapshot file {path} is unreadable ({str(error).splitlines()[0][:200]}); "
                                  "an older snapshot or the disk checkpoint is used instead") from None
        self.path = path

    def tensor(self, chunk: Chunk) -> torch.Tensor:
        return _view(self.data, chunk)

    def lr_scheduler(self) -> dict[str, Any] | None:
        """The learning-rate scheduler's ``state_dict()`` this rank saved, or ``None``."""
        return _decode(self.header.lr_scheduler)

    def rng(self) -> tuple[dict[str, torch.Tensor], Any]:
        """This file's generator states by name (``rng.cpu``, ``rng.cuda.<i>``), and Python's state (``None``
        when the file has none of the right size)."""
        found = {c.key: self.tensor(c) for c in self.header.chunks if c.key.startswith("rng.")}
        packed = found.pop(_RNG_PYTHON, None)
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
                    values.setdefault(f"{_GROUPS}{fqn}.{setting}", value)
    for part, state in tensors.items():
        for name, target in state.items():
            key = f"{part}.{name}"
            if isinstance(target, torch.Tensor):
                _fill(target, key, chunks.get(key, []))
            elif key in values:
                state[name] = _decode(values[key])
            elif key.startswith(_GROUPS):
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
    boxes = {key: _geometry(value)[1:] for key, value in _flat(tensors) if isinstance(value, torch.Tensor)}
    return boxes | {f"{_SETTINGS}{fqn}": ((), ()) for fqn in _setting_fqns(key for key, _ in _flat(tensors))}


def state_boxes(shard: Shard) -> list[tuple[str, Box]]:
    """The state chunks of ``shard`` (its RNG states aside), by key and box, and ``settings.<fqn>`` for each
    parameter whose param-group settings it holds."""
    fqns = {fqn for group in shard.header.group_params for fqn in group} | _setting_fqns(shard.header.values)
    return ([(c.key, (c.offsets, c.shape)) for c in shard.header.chunks if not c.key.startswith("rng.")]
            + [(f"{_SETTINGS}{fqn}", ((), ())) for fqn in sorted(fqns)])


def _setting_fqns(keys: Iterable[str]) -> set[str]:
    """The parameters named by DCP's flattened settings keys (``optim.param_groups.<fqn>.<setting>``)."""
    return {key[len(_GROUPS):].rsplit(".", 1)[0] for key in keys if key.startswith(_GROUPS)}


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
    global_shape, offsets, shape = _geometry(target)
    local, covered, copied = _local(target), 0, set()
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


def _flat(tensors: dict[str, dict[str, Any]]) -> Iterator[tuple[str, Any]]:
    for part, state in tensors.items():
        for name, value in state.items():
            yield f"{part}.{name}", value


def _geometry(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(global shape, offsets, shape)`` of this rank's chunk of ``tensor`` (all of it unless a ``DTensor``)."""
    if isinstance(tensor, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(tensor.shape), tuple(offsets), tuple(shape)
    return tuple(tensor.shape), (0,) * tensor.dim(), tuple(tensor.shape)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rng_tensors() -> list[tuple[str, torch.Tensor]]:
    found = [("rng.cpu", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found += [(f"rng.cuda.{i}", state) for i, state in enumerate(torch.cuda.get_rng_state_all())]
    return found


def _view(data: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    return data[chunk.start:chunk.start + chunk.nbytes].view(_dtype(chunk.dtype)).view(chunk.shape)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _encode(value: Any, key: str) -> Any:
    """``value`` as JSON: plain numbers, strings, lists, and tuples as ``{"tuple": [...]}``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(item, key) for item in value]
        return {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, Counter) and all(isinstance(name, int) for name in value):  # MultiStepLR's milestones
        return {"counter": [[name, count] for name, count in value.items()]}
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        return {"dict": {name: _encode(item, f"{key}.{name}") for name, item in value.items()}}
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
