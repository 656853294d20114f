"""Writing files safely: every file Tessera writes appears whole or not at all, never replaces a folder, and
replaces an existing file only if Tessera wrote it.

A write goes to a temporary file beside the target (same folder, so the rename stays on one file system),
is flushed to disk, and is renamed over the target in one step: a crash, a full disk or an error half-way
leaves the target as it was and removes the temporary file. Every file Tessera writes for a user carries
``MARK`` (a report's first line, a chart's ``Software`` tag, a cluster file's header) or is a plan (JSON with
``PLAN_KEYS``), so a second run into the same place replaces its own output and refuses a file of the user's
of the same name (``written_by_tessera``); a caller that asked the user (``tessera export --overwrite``) passes
``replace_any``. This module imports nothing from Tessera, so every layer may use it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError


MARK = "Written by Tessera"
"""What every file Tessera writes for a user says of itself (compared without case)."""
PLAN_KEYS = ("schema_version", "strategy", "training")
"""Top-level keys of a plan's JSON (``planner.plan.Plan``), which has no room for a comment."""
MAX_PLAN_BYTES = 64 * 2**20
"""A JSON file larger than this is not taken for a plan (nor read whole to tell)."""
MARK_LINES = 8
"""Among how many first lines a text file states ``MARK`` (an HTML report's ``<meta>`` is its fifth)."""
MARK_BYTES = 64 * 1024
"""How far into a file the mark is looked for (a PNG's text chunks come before its image data)."""
EARLIER_MARKS = (b"# Tessera plan:", b"<title>Tessera plan")
"""How the reports of Tessera versions before ``MARK`` began (Markdown: its first line; HTML: a line among its first
``MARK_LINES``): a run into their folder replaces them too, and the charts beside them
(:func:`written_by_tessera_beside`)."""
EARLIER_CLUSTER_FILE = b"# cluster file written by tessera profile"
"""The first line of a cluster file of ``tessera profile`` before it stated ``MARK`` first."""
COMMENT_OPENERS = (b"<!--", b"#")
GENERATOR_META = b'<meta name="generator" content="' + MARK.lower().encode() + b'">'


def written_by_tessera(path: str | Path) -> bool:
    """Whether the file at ``path`` is one Tessera wrote: it states ``MARK`` where Tessera puts it (a comment or
    ``<meta>`` line among its first lines, a PNG's ``Software`` tag; or an earlier version's report's opening,
    ``EARLIER_MARKS``), or it is a plan. A user's notes that merely mention the words are not."""
    head = _head(path)
    if _marked(head) or _earlier_report(head):
        return True
    if not head.lstrip().startswith(b"{"):
        return False
    try:
        document = json.loads(read_bounded(path, MAX_PLAN_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return _is_plan(document)


def _marked(head: bytes) -> bool:
    """``MARK`` opening a comment line among the first ``MARK_LINES`` (``# Written by Tessera ...``,
    ``<!-- Written by Tessera ...``), an HTML report's generator ``<meta>``, or a PNG's ``Software`` tag."""
    if b"Software\x00" + MARK.encode() in head:  # a PNG's text chunk, before its image data
        return True
    mark = MARK.lower().encode()
    for line in (line.strip().lower() for line in head.splitlines()[:MARK_LINES]):
        opener = next((o for o in COMMENT_OPENERS if line.startswith(o)), None)
        if line == GENERATOR_META or (opener and line[len(opener):].lstrip().startswith(mark)):
            return True
    return head.lower().startswith(EARLIER_CLUSTER_FILE)


def _is_plan(document: object) -> bool:
    """A plan's JSON: its top-level keys, a strategy of degrees and a training of a batch and length."""
    if not isinstance(document, dict) or not all(key in document for key in PLAN_KEYS):
        return False
    strategy, training = document["strategy"], document["training"]
    return (isinstance(strategy, dict) and {"dp", "tp", "pp"} <= strategy.keys()
            and isinstance(training, dict) and {"global_batch", "seq_len"} <= training.keys()
            and "layers" in document and "estimate" in document)


def written_by_tessera_beside(path: str | Path, report: str | Path) -> bool:
    """Whether ``path`` may be replaced: it is Tessera's, or an unmarked chart beside an earlier version's
    ``report`` (those charts carried no mark; a current report's charts do, so a file beside one is the user's)."""
    path, report = Path(path), Path(report)
    if not path.is_file() or written_by_tessera(path):
        return True
    head = _head(report) if report.is_file() else b""
    return _earlier_report(head) and MARK.lower().encode() not in head.lower()


def _head(path: str | Path) -> bytes:
    try:
        with open_plain_file(path) as handle:
            return handle.read(MARK_BYTES)
    except OSError:  # unreadable, or a device or FIFO: not known to be Tessera's
        return b""


def open_plain_file(path: str | Path):
    """``path`` opened for reading in binary, if it is a plain file (after any links); ``OSError`` otherwise. A
    FIFO or device someone left in its place would block the open or never end (``/dev/zero``): neither is read."""
    handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        raise OSError(errno.EINVAL, "not a plain file (a folder, device or FIFO)", str(path))
    os.set_blocking(handle, True)
    return os.fdopen(handle, "rb")


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of the plain file at ``path`` (``open_plain_file``); ``ValueError`` when it holds more than
    ``limit`` (read up to ``limit + 1``: a size checked before reading can change while it is read)."""
    with open_plain_file(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"holds more than {limit:,} bytes")
    return data


def _earlier_report(head: bytes) -> bool:
    markdown, html = EARLIER_MARKS
    return head.startswith(markdown) or any(line.strip().startswith(html) for line in head.splitlines()[:MARK_LINES])


def write_atomically(path: str | Path, write: Callable[[Path], Any], *, what: str = "file",
                     replace_any: bool = False) -> Path:
    """Write ``path`` with ``write(temp_path)`` then rename it into place; raise ``ConfigError`` if it cannot be,
    or if ``path`` is a file Tessera did not write (``replace_any``: the user asked to replace whatever is there).

    ``what`` names the file in the error (``"plan file"``, ``"report"``).
    """
    path = Path(path)
    check_writable_file(path, what=what, replace_any=replace_any)
    temp = _new_temp_file(path)
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


def check_writable_file(path: str | Path, *, what: str = "file", replace_any: bool = False) -> Path:
    """Raise ``ConfigError`` unless ``path`` can be written as a file: its folder exists and is writable, ``path``
    is not a folder, and an existing file there is one Tessera wrote (unless ``replace_any``). Call it where the
    path enters, before long work."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; give a file name")
    if not replace_any and path.is_symlink():  # the rename would replace the user's link, not write where it points
        raise ConfigError(f"{what} {path} is a link (to {os.readlink(path)}); give the file's own path, or another")
    if not replace_any and path.exists() and not path.is_file():
        raise ConfigError(f"{what} {path} exists and is not a plain file; choose another path")
    if not replace_any and path.is_file() and not written_by_tessera(path):
        why = "Tessera did not write it" if os.access(path, os.R_OK) else "it cannot be read to tell whether Tessera wrote it"
        raise ConfigError(f"{what} {path} already exists and {why}; Tessera replaces only its own files: move it away "
                          "or choose another path")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {what} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {what} {path}: folder {parent} is not writable; choose another path")
    return path


def _new_temp_file(path: Path) -> Path:
    """An empty new file beside ``path`` with the permissions a plain new file gets (``0o666`` less the umask;
    ``tempfile.mkstemp``'s are ``0o600``, which would leave a report only its writer can read)."""
    for _ in range(100):
        temp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return temp
    raise ConfigError(f"cannot create a temporary file beside {path}; choose another path")


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
