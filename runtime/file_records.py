"""What a file held when it was written, and whether it still does: its size and one content hash, for disk
checkpoints (``runtime.checkpoint_files``: SHA-256) and in-memory snapshots (``runtime.snapshots``: XXH3-128)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from pydantic import BaseModel, ConfigDict, model_validator

HASH_BLOCK_BYTES = 1 << 24
FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


DIGESTS: dict[str, Callable[..., Any]] = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}
"""The content hashes a record may carry, by field name: SHA-256 for disk checkpoints, XXH3-128 for in-memory
snapshots (``runtime.snapshots``), which hash every rank's whole state as often as every step: 25 GB/s against
SHA-256's 1.4 GB/s on this project's CPU, with SHA instructions (``benchmarks/snapshot_parts.py``). Either detects a
torn or damaged file; neither guards against a writer who can also rewrite the manifest."""


class FileRecord(BaseModel):
    """One file of a checkpoint as it was written: its size and one content hash (:data:`DIGESTS`)."""

    model_config = FROZEN

    size_bytes: int
    """Length of the file."""
    sha256: str | None = None
    """SHA-256 of its content (hex): disk checkpoints'."""
    xxh3_128: str | None = None
    """XXH3-128 of its content (hex): in-memory snapshots'."""

    @model_validator(mode="after")
    def _one_digest(self) -> FileRecord:
        if (self.sha256 is None) == (self.xxh3_128 is None):
            raise ValueError("a file record carries exactly one hash (sha256 or xxh3_128)")
        return self

    @property
    def algorithm(self) -> str:
        """The field name of the hash this record carries."""
        return "sha256" if self.sha256 is not None else "xxh3_128"

    @property
    def hash_name(self) -> str:
        """The hash's usual name, for messages."""
        return "SHA-256" if self.sha256 is not None else "XXH3-128"


def file_record(path: Path, algorithm: str = "sha256") -> FileRecord:
    """Size and hash (``algorithm``, a :data:`DIGESTS` name) of ``path``."""
    digest = DIGESTS[algorithm]()
    with path.open("rb") as handle:
        while block := handle.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return FileRecord(size_bytes=path.stat().st_size, **{algorithm: digest.hexdigest()})


def content_record(content: bytes | memoryview, algorithm: str) -> FileRecord:
    """Size and hash (``algorithm``) of ``content``."""
    return FileRecord(size_bytes=len(content), **{algorithm: DIGESTS[algorithm](content).hexdigest()})


def matches(path: Path, record: FileRecord) -> bool:
    """Whether ``path`` holds exactly what ``record`` describes (its size, then its hash by the record's own
    algorithm)."""
    return path.stat().st_size == record.size_bytes and file_record(path, record.algorithm) == record


def sha256_text(text: str) -> str:
    """SHA-256 (hex) of ``text`` as UTF-8: what a ``COMPLETE`` marker holds for its manifest."""
    return hashlib.sha256(text.encode()).hexdigest()
