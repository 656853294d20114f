"""The text form of a ``Strategy`` (``dp=16,tp=8,block_recompute=2xfull/1xnone``): reading its items and writing
its per-block lists compactly. ``cost_models.types.Strategy.parse`` / ``to_string`` use it; it knows no model."""

from __future__ import annotations

from collections.abc import Mapping

from tessera.errors import ConfigError
from tessera.topology.validation import quoted

MAX_BLOCKS = 2**20
"""Most blocks ``block_recompute`` / ``chunk_blocks`` may describe (a bound on what a strategy string expands to)."""


STRATEGY_ALIASES = {"mbs": "micro_batch", "zero_stage": "zero"}
"""Short names a strategy string may use for ``Strategy`` fields."""
STRATEGY_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
"""How a strategy string writes the boolean fields (``sp=true``)."""


def parse_item(item: str, *, known: Mapping[str, object]) -> tuple[str, object]:
    """``"mbs=2"`` -> ``("micro_batch", 2)``: one ``key=value`` item of a strategy string, its value read."""
    key, sep, value = (part.strip() for part in item.partition("="))
    key = STRATEGY_ALIASES.get(key, key)
    if not sep or key not in known:
        raise ConfigError(
            f"bad strategy item {quoted(item)}; expected key=value with key in {sorted(set(known) | set(STRATEGY_ALIASES))}"
        )
    if key in ("chunk_blocks", "block_recompute"):
        return key, _parse_sequence(key, value, item=item)
    if key == "recompute_modules":  # mla_up_proj/mlp; their names are checked by Strategy
        return key, tuple(part.strip() for part in value.split("/") if part.strip())
    if key == "block_reshard":
        return key, _parse_flags(value, item=item)
    if key in ("sp", "tp_overlap", "sp_regather"):
        if value.lower() not in STRATEGY_FLAGS:
            raise ConfigError(f"bad strategy item {quoted(item)}; write {key}=true or {key}=false")
        return key, STRATEGY_FLAGS[value.lower()]
    return key, coerce_number(value)


def run_lengths(items: tuple[str, ...]) -> list[str]:
    """``("full", "full", "none")`` -> ``["2xfull", "1xnone"]``: compact and readable."""
    runs: list[list] = []
    for item in items:
        if runs and runs[-1][1] == item:
            runs[-1][0] += 1
        else:
            runs.append([1, item])
    return [f"{count}x{item}" for count, item in runs]


def _parse_sequence(key: str, value: str, *, item: str) -> tuple:
    """Read ``4/4/3`` (chunk_blocks) or ``2xfull/1xnone`` (block_recompute), at most ``MAX_BLOCKS`` entries
    (counted before anything is expanded)."""
    try:
        runs = [(1, int(part)) if key == "chunk_blocks" else _run(part) for part in value.split("/")]
    except ValueError:
        raise ConfigError(
            f"bad strategy item {quoted(item)}; write e.g. chunk_blocks=4/4/3 or block_recompute=2xfull/1xnone"
        ) from None
    if sum(count for count, _ in runs) > MAX_BLOCKS:
        raise ConfigError(f"bad strategy item {quoted(item)}: more than {MAX_BLOCKS:,} blocks; give one entry per block")
    return tuple(entry for count, entry in runs for _ in range(count))


def _parse_flags(value: str, *, item: str) -> tuple[bool, ...]:
    """Read ``3xtrue/58xfalse`` (block_reshard), at most ``MAX_BLOCKS`` entries."""
    flags = _parse_sequence("block_reshard", value, item=item)
    if any(flag.lower() not in STRATEGY_FLAGS for flag in flags):
        raise ConfigError(f"bad strategy item {quoted(item)}; write e.g. block_reshard=3xtrue/58xfalse")
    return tuple(STRATEGY_FLAGS[flag.lower()] for flag in flags)


def _run(part: str) -> tuple[int, str]:
    """``"79xfull"`` -> ``(79, "full")``, ``"full"`` -> ``(1, "full")``; ``ValueError`` unless the count is >= 1."""
    count, _, policy = part.rpartition("x")
    number = int(count) if count else 1
    if number < 1:
        raise ValueError(f"count {number} is not positive")
    return number, policy


def coerce_number(value: object) -> object:
    """A strategy string's number as an int (pydantic reports anything else); very long digit strings stay text."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    return value
