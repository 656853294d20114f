"""Times and sizes as people read them: a tiny model's step is "0.85 ms", not "0.000 s"."""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30


def format_seconds(seconds: float) -> str:
    """``12.345 s``, ``0.123 s``; below 0.1 s in ``ms``, below 0.1 ms in ``µs``."""
    if seconds >= 0.1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def seconds_unit(seconds: float) -> tuple[float, str]:
    """The multiplier and unit ``format_seconds`` writes ``seconds`` in: ``(1e3, "ms")`` for 0.85 ms. A table of
    several times uses the unit of its largest, so its parts read beside it."""
    if seconds >= 0.1:
        return 1.0, "s"
    return (1e3, "ms") if seconds >= 1e-4 else (1e6, "µs")


def format_in(seconds: float, unit: tuple[float, str]) -> str:
    """``seconds`` as a bare number in ``unit`` (``seconds_unit``): three decimals in seconds, two in ms, one in µs."""
    scale, name = unit
    return f"{seconds * scale:.{ {'s': 3, 'ms': 2}.get(name, 1) }f}"


def format_seconds_range(low: float, high: float) -> str:
    """``8.400 to 11.600 s``; ``0.85 ms to 0.102 s`` where the two ends need different units."""
    first, second = format_seconds(low), format_seconds(high)
    number, unit = first.split(" ")
    return f"{number} to {second}" if second.endswith(f" {unit}") else f"{first} to {second}"


def format_bytes(count: float) -> str:
    """``12.3 GiB``; below 0.1 GiB in ``MiB``, below 0.1 MiB in ``KiB``, below 1 KiB in bytes."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if count >= 0.1 * unit:
            return f"{count / unit:.1f} {name}"
    return f"{count:.0f} B"
