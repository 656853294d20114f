"""Argument types and bounds of the ``tessera`` command line: every number and path is checked where argparse
reads it, so a bad one is one line (``tessera VERB: error: argument --NAME: ...``, exit 2) before any work.

Each ``type=`` function raises ``argparse.ArgumentTypeError`` with a message naming the value and what to give
instead. The bounds are generous for real runs and refuse what would only hang (a global batch of 10^15).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

MAX_GLOBAL_BATCH = 2**30
"""Sequences per step the CLI accepts (~10^9), as ``TrainingConfig`` (published runs use up to ~10^4): a batch
of 10^15 is refused here instead of being searched."""
MAX_SEQ_LEN = 2**24
"""Tokens per sequence (16,777,216), as ``TrainingConfig`` and the models (the longest published contexts: 10M).
These copies are not imported from ``tessera.cost_models``/``tessera.models`` so that parsing stays instant; a
test keeps them equal."""
MAX_NODES = 10**6
"""Nodes (or processes per node) ``launch`` accepts."""
MAX_LOCAL_RANKS = 256
"""Ranks ``profile`` spawns on this one machine."""
MAX_COUNT = 10**6
"""Runners-up, trials per point, checkpoint interval in steps: bound so a typo cannot run for days."""
MAX_CAPACITY_FACTOR = 1024.0
"""``--expert-capacity``: a factor above experts / top_k already plans every expert for every token."""
MAX_PLAN_FILE_BYTES = 64 * 2**20
"""A plan file is a few hundred KiB even for 1000 layers; anything past 64 MiB is the wrong file."""


# ----------------------------------------------------------------------------------------- argument types


def whole_number(*, unit: str, at_least: int = 1, at_most: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``[at_least, at_most]``; ``unit`` (plural) names what it counts."""
    expected = f"expected a whole number of {unit} from {at_least:,} to {at_most:,}"
    return _bounded(int, expected=expected, low_ok=lambda value: value >= at_least, at_most=at_most)


def finite_number(*, noun: str, above: float | None = None, at_least: float | None = None,
                  at_most: float) -> Callable[[str], float]:
    """An argparse ``type=``: a finite float, more than ``above`` (or at least ``at_least``), at most ``at_most``;
    ``noun`` names it in the message (``"a number of hours"``)."""
    low = f"more than {_number(above)}" if above is not None else f"at least {_number(at_least)}"

    def low_ok(value: float) -> bool:
        return math.isfinite(value) and (value > above if above is not None else value >= at_least)

    expected = f"expected {noun}, finite, {low} and at most {_number(at_most)}"
    return _bounded(float, expected=expected, low_ok=low_ok, at_most=at_most)


def _bounded(convert: Callable[[str], float], *, expected: str, low_ok: Callable[[float], bool],
             at_most: float) -> Callable[[str], float]:
    """The ``type=`` function: ``convert(text)``, refused with ``expected`` unless ``low_ok`` and ``<= at_most``."""

    def parse(text: str) -> float:
        try:
            if not text.isascii():  # Python reads '٨' and '１６' as numbers; cluster specs and files do not
                raise ValueError(text)
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {_shown(text)}") from None
        if not low_ok(value):
            raise argparse.ArgumentTypeError(f"{expected}, got {_shown(text)}")
        if value > at_most:
            raise argparse.ArgumentTypeError(f"{expected} (Tessera's bound), got {_shown(text)}")
        return value

    return parse


def _number(value: float) -> str:
    """``1000000.0`` -> ``1,000,000``; ``0.5`` -> ``0.5``."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _shown(text: str) -> str:
    """User text for a message: quoted, at most 60 characters."""
    return repr(text if len(text) <= 60 else text[:57] + "...")


def file_to_write(what: str) -> Callable[[str], str]:
    """An argparse ``type=``: a path a file can be created at (its folder exists and takes a new file; the path
    is not a folder). Checked when parsed, so a bad path fails before the search, not after."""

    def parse(text: str) -> str:
        from tessera.errors import ConfigError
        from tessera.files import check_writable_file

        _require_path(text, what=what)
        try:
            path = check_writable_file(text, what=what)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        _probe_folder(path.parent, what=f"{what} {text}")
        return text

    return parse


def report_folder(text: str) -> str:
    """An argparse ``type=``: a folder for a report, existing or creatable (its nearest existing parent takes
    new files), and not a file."""
    _require_path(text, what="report folder")
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"report folder {text} is a file; give a folder name (the report, its "
                                         "charts and plan.json are written into it)")
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create report folder {text}: {existing} is a file, not a folder")
    _probe_folder(existing, what=f"report folder {text}")
    return text


def cluster_file_to_write(text: str) -> str:
    """An argparse ``type=``: where ``profile`` writes its cluster file: a ``.yaml``/``.yml`` name that can be
    created (checked before the sweep, which takes minutes)."""
    if not text.endswith((".yaml", ".yml")):
        raise argparse.ArgumentTypeError(f"must end in .yaml or .yml so load_cluster can read it, got {_shown(text)}")
    return file_to_write("cluster file")(text)


def plan_file_to_read(text: str) -> str:
    """An argparse ``type=``: an existing, readable, regular file of plausible size (``launch``'s plan)."""
    _require_path(text, what="plan file")
    path = Path(text)
    hint = f"write one with 'tessera plan ... --json {text}'"
    if not path.exists():
        raise argparse.ArgumentTypeError(f"plan file {text} does not exist; {hint}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"plan file {text} is a folder; give the plan's JSON file ({hint})")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"plan file {text} is not a regular file; {hint}")
    if path.stat().st_size > MAX_PLAN_FILE_BYTES:
        raise argparse.ArgumentTypeError(f"plan file {text} is {path.stat().st_size / 2**20:,.0f} MiB, not a plan "
                                         f"(those are well under {MAX_PLAN_FILE_BYTES // 2**20} MiB); {hint}")
    return text


def script_name(text: str) -> str:
    """An argparse ``type=``: the training script each launched rank runs (not empty)."""
    _require_path(text, what="training script")
    return text


def _require_path(text: str, *, what: str) -> None:
    """An empty path would mean the working directory: refuse it rather than guess."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the {what} path is empty; give a path")


def _probe_folder(folder: Path, *, what: str) -> None:
    """Create and remove a temporary file in ``folder``: the one test of "can write here" that holds for root,
    read-only mounts and pseudo file systems (``/proc``) alike."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {what}: folder {folder} does not take new files "
                                         f"({error.strerror or error}); choose another path") from None
