"""The chart ``benchmarks/published.py`` writes beside its table: every published run's predicted step against its
published one, and each run's error by regime against issue #19's goals, held-out runs filled, training runs hollow."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from goal_stats import MEDIAN_GOAL, WORST_GOAL

REGIME_COLORS = {"ptd-p": "#1f77b4", "fsdp": "#2ca02c", "fp8": "#ff7f0e", "cp": "#9467bd",
                 "deepspeed-zero3": "#8c564b", "moe": "#d62728"}


class Point(NamedTuple):
    run: str
    held_out: bool
    regime: str
    published_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1


def write_chart(points: list[Point], path: Path) -> Path:
    """Two panels: predicted against published step time (log-log, the 15% band shaded), and the signed error of every
    run by regime with the goals' lines; the held-out runs beyond 15% named. Returns ``path`` (a PNG)."""
    from matplotlib.figure import Figure  # the table does not need matplotlib; the chart alone imports it

    figure = Figure(figsize=(13, 5.5), layout="constrained")
    scatter, strips = figure.subplots(1, 2, width_ratios=(1, 1.25))
    _scatter_panel(scatter, points)
    _error_panel(strips, points)
    figure.savefig(path, format="png", dpi=110, metadata={"Software": None})
    return path


def _marker(point: Point) -> dict:
    color = REGIME_COLORS.get(point.regime, "#7f7f7f")
    return {"facecolors": color if point.held_out else "none", "edgecolors": color, "s": 22, "linewidths": 1.0}


def _scatter_panel(axes, points: list[Point]) -> None:
    low = min(min(p.published_s, p.predicted_s) for p in points) / 1.5
    high = max(max(p.published_s, p.predicted_s) for p in points) * 1.5
    axes.fill_between([low, high], [low * (1 - WORST_GOAL), high * (1 - WORST_GOAL)],
                      [low * (1 + WORST_GOAL), high * (1 + WORST_GOAL)], color="#dddddd", label=f"within {WORST_GOAL:.0%}")
    axes.plot([low, high], [low, high], color="#555555", linewidth=0.8)
    for point in points:
        axes.scatter([point.published_s], [point.predicted_s], **_marker(point))
    axes.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="published step (s)",
             ylabel="predicted step (s)", title=f"{len(points)} published runs: predicted against published")
    for regime in sorted({p.regime for p in points}):  # one legend entry per regime's colour
        axes.scatter([], [], color=REGIME_COLORS.get(regime, "#7f7f7f"), s=22, label=regime)
    axes.legend(loc="upper left", fontsize=8, frameon=False)


LABEL_GAP = 2.5
"""Least vertical distance, in points of error (%), between two run names in one regime's column."""


def _error_panel(axes, points: list[Point]) -> None:
    regimes = sorted({p.regime for p in points})
    for index, regime in enumerate(regimes):
        members = sorted((p for p in points if p.regime == regime), key=lambda p: p.error)
        missed = []
        for rank, point in enumerate(members):  # spread each regime's runs across its column so none hide another
            x = index + (rank / max(1, len(members) - 1) - 0.5) * 0.6
            axes.scatter([x], [100 * point.error], **_marker(point))
            if point.held_out and abs(point.error) > WORST_GOAL:
                missed.append((x, 100 * point.error, point.run))
        _name_runs(axes, missed)
    for goal, style in ((WORST_GOAL, "--"), (MEDIAN_GOAL, ":")):
        for sign in (1, -1):
            axes.axhline(100 * sign * goal, color="#555555", linestyle=style, linewidth=0.8)
    axes.axhline(0, color="#555555", linewidth=0.8)
    held_out = sum(p.held_out for p in points)
    axes.set(xticks=range(len(regimes)), xlim=(-0.6, len(regimes) - 0.4), ylabel="error (%, + predicted slower)",
             title=f"error by regime: {held_out} held out (filled), {len(points) - held_out} calibration (hollow); "
                   f"lines at {MEDIAN_GOAL:.0%} and {WORST_GOAL:.0%}")
    axes.set_xticklabels(regimes, fontsize=8)
    axes.title.set_fontsize(9)


def _name_runs(axes, marked: list[tuple[float, float, str]]) -> None:
    """Each ``(x, y, run)`` named beside its marker, names pushed apart so that none overlaps the one below it."""
    last = None
    for x, y, run in sorted(marked, key=lambda m: m[1]):
        text_y = y if last is None else max(y, last + LABEL_GAP)
        axes.annotate(run, (x, y), xytext=(x + 0.05, text_y), fontsize=6, va="center",
                      arrowprops={"arrowstyle": "-", "color": "#999999", "linewidth": 0.5} if text_y != y else None)
        last = text_y
