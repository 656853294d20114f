"""Checking values that come from users and files: bounded quoting, pydantic errors as one line, safe YAML.

Everything here is about input Tessera did not write, so every message stays one line and short however
large or hostile the value: a quoted value is cut to ``MAX_QUOTED_CHARS`` characters.

YAML is read with ``StrictLoader``: PyYAML's safe loader that also refuses anchors and aliases (a few hundred
bytes of nested aliases, "billion laughs", expand to gigabytes; no cluster file needs them) and duplicate
keys (PyYAML keeps the last one silently). Files are refused above ``MAX_YAML_BYTES`` before parsing.

This is the lowest layer that reads user input, so ``cost_models`` and ``planner`` reuse these helpers. It
imports only ``tessera.errors`` and ``tessera.files`` from Tessera.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tessera.errors import ClusterSpecError
from tessera.files import read_bounded

MAX_QUOTED_CHARS = 80
"""Longest quoted user value in an error message (longer ones are cut and marked with ``...``)."""
MAX_YAML_BYTES = 2**20
"""Largest cluster file read (1 MiB): a profiled file with every raw trial is ~100 KiB."""
MAX_YAML_DEPTH = 32
"""Deepest nesting of a YAML file read (a profiled cluster file nests 6 levels)."""
SMALLEST_NUMBER, LARGEST_NUMBER = 1e-9, 1e12
"""Every number of a cluster file, in the file's own units (GB/s, us, TFLOP/s, GiB, ms, ratios), is 0 where 0 is
allowed or lies in this range: wide enough for any real device or link (1 byte/s to 10^21 bytes/s), narrow enough
that no product or quotient of them in the cost model overflows to infinity or underflows to 0."""
MAX_DEVICES = 2**20
"""Most devices a cluster may have (1,048,576): beyond today's largest training clusters by ~10x, and small
enough that the search's enumeration of mesh shapes stays fast."""


def quoted(value: Any, *, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters: how an error message quotes a value it was given."""
    text = _bounded_repr(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x1b``): a name from a received plan or
    checkpoint could otherwise move the cursor, fake a line or set the clipboard through the terminal."""
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode("ascii") for c in text)


def short(value: Any, *, limit: int = MAX_QUOTED_CHARS) -> str:
    """``str(value)`` cut to ``limit`` characters, for names (field names, keys) shown without quotes."""
    text = value if isinstance(value, str) else _bounded_repr(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded_repr(value: Any, limit: int) -> str:
    """``repr`` that never renders a huge container or integer whole (both can be megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of about {int(value.bit_length() * math.log10(2))} digits>"
    if isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        return f"<a {type(value).__name__} of {len(value)} items>"
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit])
    return repr(value)


def first_problem(exc: ValidationError, *, renames: Mapping[str, str] | None = None) -> str:
    """The first error of a pydantic validation as one line: ``field 'seq_len': Input should be greater than 0,
    got -1``. ``renames`` maps model field names to the names the user wrote (``latency_s`` -> ``latency_us``)."""
    error = exc.errors(include_url=False)[0]
    field = ".".join(str(part) for part in error["loc"]) or "value"
    for name, shown in (renames or {}).items():
        field = field.replace(name, shown)
    got = f", got {quoted(error['input'])}" if "input" in error and not isinstance(error["input"], Mapping) else ""
    return f"field {field!r}: {error['msg']}{got}"


def file_number(value: Any, what: str, *, positive: bool = False) -> float:
    """A number of a cluster file, in the file's own units: finite, and 0 (unless ``positive``) or within
    ``[SMALLEST_NUMBER, LARGEST_NUMBER]``; otherwise ``ClusterSpecError`` naming ``what`` and the value."""
    number = finite_number(value)
    if number is not None and (SMALLEST_NUMBER <= number <= LARGEST_NUMBER or (number == 0 and not positive)):
        return number
    need = "a positive number" if positive else "0 or a number"
    raise ClusterSpecError(f"{what} must be {need} from {SMALLEST_NUMBER:g} to {LARGEST_NUMBER:g} (the file's units), "
                           f"got {quoted(value)}")


def significant(value: float, digits: int = 6) -> float:
    """``value`` rounded to ``digits`` significant digits, for readable files (measurements are not finer)."""
    return float(f"{value:.{digits}g}")


def file_value(value: float, *, positive: bool = False) -> float:
    """``value`` (in the file's units) as a cluster file writes it, so that ``file_number`` reads it back: 6
    significant digits, within ``[SMALLEST_NUMBER, LARGEST_NUMBER]``; below it, 0 (``SMALLEST_NUMBER`` where
    ``positive``): a fitted latency of 1e-12 us is 0 as far as any measurement can tell."""
    rounded = significant(value)
    if rounded < SMALLEST_NUMBER:
        return SMALLEST_NUMBER if positive else 0.0
    return min(rounded, LARGEST_NUMBER)


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` where it is not a number, is a bool, infinite or NaN."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


class YamlRefused(yaml.YAMLError):
    """A YAML construct ``StrictLoader`` refuses (an anchor, an alias, a duplicate key); the message says which."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without anchors, aliases, duplicate keys or nesting deeper than ``MAX_YAML_DEPTH``
    (see the module docstring)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YamlRefused(
                f"line {event.start_mark.line + 1} uses a YAML anchor or alias ({quoted(event.anchor)}); "
                "write the values out in full (anchors and aliases are not allowed)"
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise YamlRefused(f"line {event.start_mark.line + 1} nests deeper than {MAX_YAML_DEPTH} levels; "
                              "a cluster file needs a handful")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: the base constructor reports it
            if duplicate:
                raise YamlRefused(f"line {key_node.start_mark.line + 1}: duplicate key {quoted(key)}; keep only one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str) -> Any:
    """Parse ``text`` with ``StrictLoader``; raises ``yaml.YAMLError`` (``YamlRefused`` for refused constructs)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader


def read_bounded_text(path: Path, *, limit: int = MAX_YAML_BYTES) -> str:
    """The text of ``path``; ``ValueError`` (saying the size and the limit) when it is larger than ``limit``."""
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"is {size:,} bytes, more than the {limit:,} a cluster file may have")
    try:
        data = read_bounded(path, limit)
    except ValueError:  # grew while read
        raise ValueError(f"is more than the {limit:,} bytes a cluster file may have") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte {exc.start} is not valid)") from None
