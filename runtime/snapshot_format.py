"""One rank's share of an in-memory snapshot as one file: its shards of the model and optimizer state in one flat
byte buffer behind a JSON header that says what each byte range is, so that a load under another plan can
reshard them (``runtime.snapshots`` writes these files, ``runtime.snapshot_recovery`` reads them).

**Why not DCP's format.** A snapshot is taken after every step or few; ``dcp.save`` writes each state-dict entry
as its own ``torch.save`` item, and the optimizer's flattened state has about a thousand of them for a 4-layer
model (three quarters are per-parameter param-group settings): 0.65 s for 2.8 MB in one process, where copying
the same bytes into one buffer takes 1.4 ms and writing them 2 ms (measured on this project's 2-core machine).
Disk checkpoints stay on DCP (``runtime.checkpoint``).

**The file** ``rank-00003.snap``: 8 bytes (the header's length, little-endian), the header (JSON), zero padding
to a multiple of :data:`ALIGN`, then the data. The header lists every chunk -- its state key
(``model.<fqn>``, ``optim.state.<fqn>.exp_avg``), dtype, the tensor's global shape, the chunk's offsets and
shape within it (DCP's description of a shard, ``compute_local_shape_and_global_offset``) and where its bytes
start -- every non-tensor value (``optim.param_groups.<fqn>.lr``...; tuples tagged so that they come back as
tuples), and the rank's RNG states (CPU and CUDA generator states as chunks ``rng.*``, Python's in the header).
Reading one parses JSON and views bytes: nothing in it can run code.

**Each chunk is written once.** A chunk held by several ranks (DDP's replicas, a tensor-parallel shard's dp
replicas) is written by one of them, chosen to balance the bytes each rank writes: the de-duplication DCP does
for disk checkpoints, by the same key (state key and offsets: ranks holding the same chunk hold the same
values). The choice is one all-gather of every rank's chunk list, made again only when that list changes.

**Resharding.** A load computes, for each tensor of the new plan's state, the chunk this rank holds, copies in
every saved chunk's overlap with it, and checks that the overlaps cover it exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # what DCP describes shards by

from tessera.errors import CheckpointError, ConfigError
from tessera.runtime.checkpoint_files import FileRecord, all_gather
from tessera.runtime.tp_styles import unstrided

FORMAT = "tessera-snapshot-1"
ALIGN = 64
"""Every chunk starts at a multiple of this many bytes, so a byte view of it can be viewed as any dtype."""
_LENGTH = struct.Struct("<Q")


def shard_file(rank: int) -> str:
    """The name of ``rank``'s file in a snapshot folder."""
    return f"rank-{rank:05d}.snap"


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

    format: Literal["tessera-snapshot-1"]
    rank: int
    chunks: tuple[Chunk, ...]
    values: dict[str, Any]
    """Non-tensor state values, JSON with tuples as ``{"tuple": [...]}``."""
    rng_python: Any
    """Python ``random.getstate()``, encoded as ``values``."""


# ------------------------------------------------------------------------------------------------ writing


class StagedShards:
    """This rank's chunks of a training state, and its RNG states, copied into one buffer that is reused by
    every snapshot of the same state layout (:meth:`refill`: the only part on the training thread)."""

    def __init__(self, tensors: dict[str, dict[str, Any]], group: dist.ProcessGroup | None, *,
                 assignments: dict) -> None:
        """``assignments`` caches the de-duplication per chunk list (shared by every staging of a run)."""
        rank = dist.get_rank(group) if group is not None else 0
        held = [(key, value, _geometry(value)) for key, value in _flat(tensors) if isinstance(value, torch.Tensor)]
        _refuse_strided_splits(held)
        signature = tuple((key, geometry, value.dtype.itemsize) for key, value, geometry in held)
        if signature not in assignments:
            assignments[signature] = _writers(signature, group)
        writers = assignments[signature]
        chunks, sources, start = [], [], 0
        for (key, value, (global_shape, offsets, shape)), writer in zip(held, writers):
            if writer == rank:
                chunks.append(Chunk(key=key, dtype=_dtype_name(value.dtype), global_shape=global_shape,
                                    offsets=offsets, shape=shape, start=start))
                sources.append(_local(value))
                start = _aligned(start + chunks[-1].nbytes)
        for name, state in _rng_tensors():
            chunks.append(Chunk(key=name, dtype=_dtype_name(state.dtype), global_shape=tuple(state.shape),
                                offsets=(0,) * state.dim(), shape=tuple(state.shape), start=start))
            start = _aligned(start + chunks[-1].nbytes)
        self._sources = sources
        self.buffer = torch.empty(start, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        """Every chunk's bytes, at its ``start``."""
        self._views = [_view(self.buffer, chunk) for chunk in chunks]
        fixed = {"format": FORMAT, "rank": rank, "chunks": [c.model_dump() for c in chunks],
                 "values": {key: _encode(value, key) for key, value in _flat(tensors)
                            if not isinstance(value, torch.Tensor)}}
        self._fixed_json = json.dumps(fixed)[:-1]
        """The header without its last field (Python's RNG state): the same for every snapshot of this layout."""

    def refill(self) -> Any:
        """Copy the current state and RNG into the buffer (device to host where the state is on a device);
        Python's RNG state, for :meth:`prefix`."""
        rng = [state for _, state in _rng_tensors()]
        with torch.no_grad():
            torch._foreach_copy_(self._views, self._sources + rng)
        return random.getstate()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def prefix(self, rng_python: Any) -> bytes:
        """What precedes the data in the file: the header's length, the header and its padding (built on the
        background thread: JSON of a thousand entries is not free)."""
        header = f'{self._fixed_json}, "rng_python": {json.dumps(_encode(rng_python, "rng_python"))}}}'.encode()
        head = _LENGTH.size + len(header)
        return _LENGTH.pack(len(header)) + header + bytes(_aligned(head) - head)


def _refuse_strided_splits(held: list) -> None:
    """A packed tensor-parallel split (``q|k|v`` under tp: a strided shard) is several chunks per rank, which this
    format's one box per tensor cannot describe; disk checkpoints write it gathered (``tp_styles.unstrided``, a
    collective per save). Refused here, on every rank alike (the placements are the plan's), not written wrong."""
    packed = [key for key, value, _ in held if isinstance(value, DTensor) and unstrided(value) is not value]
    if packed:
        raise ConfigError(f"in-memory snapshots cannot hold packed tensor-parallel splits yet ({packed[0]} and "
                          f"{len(packed) - 1} more are strided shards); train without snapshots=, or with tp=1, and "
                          "rely on disk checkpoints (pm.save), which hold them")


def write_shard(path: Path, prefix: bytes, data: torch.Tensor) -> FileRecord:
    """Write ``prefix`` and ``data`` (bytes) to ``path``; its size and SHA-256, hashed from memory."""
    view = memoryview(data.numpy()) if data.numel() else b""
    digest = hashlib.sha256(prefix)
    digest.update(view)  # hashlib releases the GIL on large buffers: training runs on meanwhile
    with path.open("wb") as handle:
        handle.write(prefix)
        handle.write(view)
    return FileRecord(size_bytes=len(prefix) + data.numel(), sha256=digest.hexdigest())


def _writers(signature: tuple, group: dist.ProcessGroup | None) -> list[int]:
    """For each of this rank's chunks, the rank that writes it: among the ranks holding the same chunk (same
    key, offsets and shape), the one with the fewest bytes so far, largest chunks first (every rank computes
    the same answer from the same gathered lists)."""
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
    return [writer[(key, offsets, shape)] for key, (_, offsets, shape), _ in signature]


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

    def rng(self) -> tuple[dict[str, torch.Tensor], Any]:
        """This file's RNG chunks by name, and Python's state."""
        found = {c.key: self.tensor(c) for c in self.header.chunks if c.key.startswith("rng.")}
        return found, _decode(self.header.rng_python)


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
    for part, state in tensors.items():
        for name, target in state.items():
            key = f"{part}.{name}"
            if isinstance(target, torch.Tensor):
                _fill(target, key, chunks.get(key, []))
            elif key in values:
                state[name] = _decode(values[key])
            else:
                raise CheckpointError(f"the snapshot has no value for {key}; it was taken from another model or "
                                      "optimizer: resume with the ones it was taken from")


def _fill(target: torch.Tensor, key: str, saved: list[tuple[Chunk, Shard]]) -> None:
    global_shape, offsets, shape = _geometry(target)
    local, covered = _local(target), 0
    for chunk, shard in saved:
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
    raise CheckpointError(f"snapshots hold numbers, strings, lists, tuples and tensors; {key} is a "
                          f"{type(value).__name__}: keep it out of the optimizer's param groups or train without "
                          "snapshots")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) != {"tuple"}:
            raise CheckpointError(f"snapshot header holds an unknown value {str(value)[:80]}")
        return tuple(_decode(item) for item in value["tuple"])
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value
