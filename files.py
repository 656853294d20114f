"""Writing files safely: every file Tessera writes appears whole or not at all, and never replaces a folder.

A write goes to a temporary file beside the target (same folder, so the rename stays on one file system),
is flushed to disk, and is renamed over the target in one step: a crash, a full disk or an error half-way
leaves the target as it was and removes the temporary file. This module imports nothing from Tessera, so
every layer may use it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError


def write_atomically(path: str | Path, write: Callable[[Path], Any], *, what: str = "file") -> Path:
    """Write ``path`` with ``write(temp_path)`` then rename it into place; raise ``ConfigError`` if it cannot be.

    ``what`` names the file in the error (``"plan file"``, ``"report"``).
    """
    path = Path(path)
    check_writable_file(path, what=what)
    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    temp = Path(temp_name)
    try:
        write(temp)
        _fsync(temp)
        os.replace(temp, path)
    except OSError as error:
        raise ConfigError(f"cannot write {what} {path}: {error.strerror or error}; free space or choose "
                          "another path") from error
    finally:
        temp.unlink(missing_ok=True)
    return path


def write_text_atomically(path: str | Path, text: str, *, what: str = "file") -> Path:
    """``write_atomically`` for text (UTF-8)."""
    return write_atomically(path, lambda temp: temp.write_text(text, encoding="utf-8"), what=what)


def check_writable_file(path: str | Path, *, what: str = "file") -> Path:
    """Raise ``ConfigError`` unless ``path`` can be written as a file: its folder exists and is writable, and
    ``path`` is not a folder. Call it where the path enters, before long work."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {what} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {what} {path}: folder {parent} is not writable; choose another path")
    return path


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
