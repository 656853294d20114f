"""Staging one rank's snapshot file (``runtime.snapshot_format``) in memory: the buffer a snapshot refills on the
training thread and the background thread writes, hashes and sends as it is.

**Staged as the file itself.** Most of the header depends only on the state's layout (which chunks, which
values), so :class:`StagedShards` builds it once and keeps the whole file in one buffer: header in front, chunks
behind. A snapshot refills the chunks (one ``_foreach_copy_`` and one ``struct.pack_into`` on the training thread)
and then writes, hashes and sends that one buffer as it is: no per-tensor Python, one ``write``, one hash (the
header's share of it computed again only when the header changed), one message to the buddy. What changes from
step to step without changing the layout -- the learning rate a scheduler sets, the scheduler's own state -- is
the header's tail (``group_settings``, ``lr_scheduler``), rewritten in place in the header's slack (spaces, which
JSON ignores) when it changed: a schedule that moves the learning rate every step would otherwise rebuild the
staging (DCP's ``get_state_dict``: 12 ms against 0.8 ms for the refill, one process, the 4-layer tiny GPT:
``benchmarks/snapshot_staging.py``).

**Each chunk is written once.** A chunk held by several ranks (DDP's replicas, a tensor-parallel shard's dp
replicas) is written by one of them, chosen to balance the bytes each rank writes: the de-duplication DCP does
for disk checkpoints, by the same key (state key and offsets: ranks holding the same chunk hold the same
values). The choice is one all-gather of every rank's chunk list, made again only when that list changes.
Small replicated chunks (at most :data:`SMALL_REPLICA` bytes: optimizer steps, the biases and norms of tiny
models) are the exception: every holder writes them, so that a rank's own file has all the small state it shares
and a restart under the same plan reads that file alone (``snapshot_format.files_to_read``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

from tessera.errors import ConfigError
from tessera.runtime.file_records import DIGESTS, FileRecord
from tessera.runtime.rank_agreement import all_gather
from tessera.runtime.snapshot_format import (
    FORMAT, GROUPS, LENGTH, PYTHON_RNG, RNG_PYTHON, Chunk, aligned, chunk_view, dtype_name, encode_value,
    flat_items, geometry, local_tensor, rng_tensors,
)
from tessera.runtime.snapshot_table import SNAPSHOT_DIGEST, snapshot_record
from tessera.runtime.tp_styles import has_strided_split

_SLACK = 512
"""Bytes of spaces the header keeps at least for its tail to grow into (a longer learning rate, a scheduler's
counters); as many as the tail has, if more."""

SMALL_REPLICA = 1024
"""Replicated chunks of at most this many bytes are written by every rank holding them (:func:`_writers`)."""



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
        held = [(key, value, geometry(value)) for key, value in flat_items(tensors) if isinstance(value, torch.Tensor)]
        refuse_strided_splits((key, value) for key, value, _ in held)
        signature = tuple((key, geometry, value.dtype.itemsize) for key, value, geometry in held)
        if signature not in assignments:
            assignments[signature] = _writers(signature, group)
        chunks, self._sources = self._own_chunks(held, assignments[signature], rank)
        start = aligned(chunks[-1].start + chunks[-1].nbytes) if chunks else 0
        for name, state in [*rng_tensors(), (RNG_PYTHON, torch.empty(PYTHON_RNG.size, dtype=torch.uint8))]:
            chunks.append(Chunk(key=name, dtype=dtype_name(state.dtype), global_shape=tuple(state.shape),
                                offsets=(0,) * state.dim(), shape=tuple(state.shape), start=start))
            start = aligned(start + chunks[-1].nbytes)
        values = {key: value for key, value in flat_items(tensors) if not isinstance(value, torch.Tensor)}
        self._group_params = _group_fqns(values, param_groups) if param_groups is not None else None
        """Each param group's FQNs, or ``None``: the settings stay in ``values`` and a change needs a new staging."""
        if self._group_params is not None:
            values = {key: value for key, value in values.items() if not key.startswith(GROUPS)}
        self._fixed_settings = _settings(param_groups) if param_groups is not None else None
        self._static = json.dumps({"format": FORMAT, "rank": rank, "chunks": [c.model_dump() for c in chunks],
                                   "values": {key: encode_value(value, key) for key, value in values.items()},
                                   "group_params": self._group_params or []}).encode()
        tail = self._tail(param_groups, lr_scheduler)
        capacity = aligned(LENGTH.size + len(self._static) + len(tail) + max(_SLACK, len(tail)))
        self.file = torch.zeros(capacity + start, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        """The whole file: header (padded with spaces), then every chunk's bytes at its ``start`` (refilled in
        place; zeroed first, so the gaps between aligned chunks hold no stray memory)."""
        self._prefix = self.file[:capacity].numpy()
        self._prefix[:LENGTH.size] = numpy.frombuffer(LENGTH.pack(capacity - LENGTH.size), dtype=numpy.uint8)
        self._data = self.file[capacity:]
        self._views = [chunk_view(self._data, chunk) for chunk in chunks[:-1]]
        self._python = chunk_view(self._data, chunks[-1]).numpy()
        self._written_tail: bytes | None = None
        self._prefix_digest: Any = None
        """The header's share of the file's hash (hashed again only after the header changed)."""
        self._write_header(tail)

    @staticmethod
    def _own_chunks(held: list, writers: list[int], rank: int) -> tuple[list[Chunk], list[torch.Tensor]]:
        """The chunks this rank writes (packed, aligned) and the tensors they are copied from."""
        chunks, sources, start = [], [], 0
        for (key, value, (global_shape, offsets, shape)), writer in zip(held, writers):
            if writer in (rank, None):
                chunks.append(Chunk(key=key, dtype=dtype_name(value.dtype), global_shape=global_shape,
                                    offsets=offsets, shape=shape, start=start))
                sources.append(local_tensor(value))
                start = aligned(start + chunks[-1].nbytes)
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
        rng = [state for _, state in rng_tensors()]
        with torch.no_grad():
            torch._foreach_copy_(self._views, self._sources + rng)
        version, internal, gauss = random.getstate()
        PYTHON_RNG.pack_into(self._python, 0, version, *internal, gauss is not None, gauss or 0.0)
        return True

    @property
    def nbytes(self) -> int:
        return self.file.numel()

    def record(self) -> FileRecord:
        """The file's size and hash (``snapshot_table.SNAPSHOT_DIGEST``), hashed from memory (the header's share
        cached while it is unchanged; xxhash releases the GIL, so training runs on meanwhile)."""
        if self._prefix_digest is None:
            self._prefix_digest = DIGESTS[SNAPSHOT_DIGEST](memoryview(self._prefix))
        digest = self._prefix_digest.copy()
        digest.update(memoryview(self._data.numpy()))
        return FileRecord(size_bytes=self.nbytes, **{SNAPSHOT_DIGEST: digest.hexdigest()})

    def _tail(self, param_groups: list[dict[str, Any]] | None, lr_scheduler: dict[str, Any] | None) -> bytes:
        """The header's changing part: the groups' settings (when kept per group) and the scheduler's state."""
        settings = [{key: encode_value(value, f"param group {i}'s {key}") for key, value in group.items() if key != "params"}
                    for i, group in enumerate(param_groups)] if self._group_params is not None and param_groups else []
        return json.dumps({"group_settings": settings, "lr_scheduler": encode_value(lr_scheduler, "lr_scheduler")}).encode()

    def _write_header(self, tail: bytes) -> bool:
        """The header (the fixed part, then ``tail``, as one JSON object) into the file, padded with spaces;
        ``False`` if it does not fit."""
        header = self._static[:-1] + b", " + tail[1:]
        room = self._prefix.size - LENGTH.size
        if len(header) > room:
            return False
        self._prefix[LENGTH.size:LENGTH.size + len(header)] = numpy.frombuffer(header, dtype=numpy.uint8)
        self._prefix[LENGTH.size + len(header):] = ord(" ")
        self._written_tail, self._prefix_digest = tail, None
        return True


def _settings(param_groups: list[dict[str, Any]]) -> list[list[tuple[str, Any]]]:
    return [[(key, value) for key, value in group.items() if key != "params"] for group in param_groups]


def _group_fqns(values: dict[str, Any], param_groups: list[dict[str, Any]]) -> tuple[tuple[str, ...], ...] | None:
    """Each param group's FQNs, read from DCP's flattened settings (``optim.param_groups.<fqn>.<setting>``, written
    group by group, each group's parameters in turn), or ``None`` where the values do not bear that reading out:
    every group's settings must be exactly the values under its FQNs."""
    keys = [key for key in values if key.startswith(GROUPS)]
    order = list(dict.fromkeys(key[len(GROUPS):].rsplit(".", 1)[0] for key in keys))
    sizes = [len(group["params"]) for group in param_groups]
    if len(order) != sum(sizes) or len(keys) != sum(size * (len(g) - 1) for size, g in zip(sizes, param_groups)):
        return None
    groups, start = [], 0
    for size, group in zip(sizes, param_groups):
        fqns = tuple(order[start:start + size])
        start += size
        if any(values.get(f"{GROUPS}{fqn}.{key}", _MISSING) != value
               for fqn in fqns for key, value in group.items() if key != "params"):
            return None
        groups.append(fqns)
    return tuple(groups)


_MISSING = object()


def refuse_strided_splits(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """A packed tensor-parallel split (``q|k|v`` under tp: a strided shard) is several chunks per rank, which this
    format's one box per tensor cannot describe; disk checkpoints write it gathered (``tp_styles.unstrided``, a
    collective per save). Refused when snapshots are enabled and again at staging, on every rank alike (the
    placements are the plan's), not written wrong."""
    packed = [key for key, value in tensors if has_strided_split(value)]
    if packed:
        raise ConfigError(f"in-memory snapshots cannot hold packed tensor-parallel splits yet ({packed[0]} and "
                          f"{len(packed) - 1} more are strided shards); train without snapshots=, or with tp=1, and "
                          "rely on disk checkpoints (pm.save), which hold them")


def write_shard(path: Path, file: torch.Tensor) -> FileRecord:
    """Write ``file`` (bytes) to ``path``; its size and hash, hashed from memory."""
    view = memoryview(file.numpy()) if file.numel() else b""
    with path.open("wb") as handle:
        handle.write(view)
    return snapshot_record(view)


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
