"""The one collective of a snapshot (``runtime.snapshots``): an integer table every rank fills its own row of.

A rank's row: whether it failed (writing this snapshot, or copying or committing the previous one), its file's
size and hash; rank 0's tail adds its plan's and data position's size and hash and its clock. Summed by one
all-reduce, the table is every row on every rank: every leader writes the same manifest from it, each rank knows
the sizes its buddy partner will send, and a failure anywhere raises the same ``CheckpointError`` everywhere.
"""

from __future__ import annotations

import struct
import time

import torch
import torch.distributed as dist

from tessera.errors import CheckpointError
from tessera.runtime.checkpoint_files import DATA_FILE, PLAN_FILE, Manifest
from tessera.runtime.file_records import FileRecord, content_record
from tessera.runtime.rank_agreement import all_gather
from tessera.runtime.snapshot_format import shard_file

SNAPSHOT_DIGEST = "xxh3_128"
"""The hash of snapshot files (``file_records.DIGESTS``)."""
_DIGEST = struct.Struct("<2q")
"""An XXH3-128 as two int64 words: how digests travel in the integer table."""
_RECORD = 1 + 2
"""A file's entries: its size, then its hash."""
_ROW = 1 + _RECORD
"""A rank's row of the table: failed (0/1), then its file's record."""
_TAIL = 2 * _RECORD + 1
"""Rank 0's extra entries: the plan's and the data position's records, then its clock (ns)."""


def side_files(rank: int) -> tuple[str, ...]:
    """The files of ``rank``'s share besides its snapshot file (rank 0's plan and data position)."""
    return (PLAN_FILE, DATA_FILE) if rank == 0 else ()


def snapshot_record(content: bytes) -> FileRecord:
    """Size and hash of a snapshot file's ``content``."""
    return content_record(content, SNAPSHOT_DIGEST)


def agree_on_table(records: dict[str, FileRecord], problem: str | None, *, rank: int, world: int,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """The one all-reduce: this rank's row (``problem``, else its records) summed with every other rank's.
    ``CheckpointError`` on every rank if any failed (a second, rare gather carries the messages)."""
    table = torch.zeros(world * _ROW + _TAIL, dtype=torch.int64)
    row = table[rank * _ROW:(rank + 1) * _ROW]
    row[0] = problem is not None
    if problem is None:
        _put(row[1:], records[shard_file(rank)])
        if rank == 0:
            tail = table[world * _ROW:]
            for index, name in enumerate(side_files(0)):
                _put(tail[index * _RECORD:(index + 1) * _RECORD], records[name])
            tail[-1] = time.time_ns()
    if group is not None:
        dist.all_reduce(table, group=group)
    if int(table[:world * _ROW:_ROW].sum()):
        raise CheckpointError(next(p for p in all_gather(problem, group) if p))
    return table


def share_sizes(table: torch.Tensor, rank: int, *, world: int) -> list[int]:
    """Sizes of ``rank``'s files in the agreed table: its snapshot file, then its ``side_files``."""
    tail = world * _ROW
    return [int(table[rank * _ROW + 1])] + [int(table[tail + i * _RECORD]) for i in range(len(side_files(rank)))]


def table_manifest(table: torch.Tensor, *, step: int, world: int, strategy: str) -> Manifest:
    """The whole snapshot's manifest from the agreed table: the same on every leader (rank 0's clock)."""
    files = {shard_file(rank): _get(table[rank * _ROW + 1:(rank + 1) * _ROW]) for rank in range(world)}
    tail = table[world * _ROW:]
    files.update({name: _get(tail[index * _RECORD:(index + 1) * _RECORD]) for index, name in enumerate(side_files(0))})
    return Manifest(step=step, world_size=world, strategy=strategy, saved_unix_s=int(tail[-1]) / 1e9,
                    files=dict(sorted(files.items())))


def _put(entries: torch.Tensor, record: FileRecord) -> None:
    """``record`` into its table entries: size, then the hash as two words."""
    entries[0] = record.size_bytes
    entries[1:_RECORD] = torch.tensor(_DIGEST.unpack(bytes.fromhex(record.xxh3_128)))


def _get(entries: torch.Tensor) -> FileRecord:
    size, *words = entries.tolist()
    return FileRecord(size_bytes=size, xxh3_128=_DIGEST.pack(*words).hex())
