r"""Fit per-level latency and bandwidth to measured collective times (pure; no processes).

Each measurement is one collective of ``nbytes`` on a group layout (``group_size`` ranks ``stride`` apart,
every such group of the world running at once, as a mesh axis does). A layout whose group crosses exactly
one level of the hierarchy (``participants_per_level`` has one phase, ``p`` participants) fits that level;
layouts crossing several levels are kept for validation only.

For a collective ``c`` and algorithm ``a`` at one level the model is linear in two unknowns
(``tessera.topology.collectives.coefficients``)::

    t = steps_a(p) * alpha_c + volume_a(p) * nbytes * (1 / B_c) + nbytes * gamma_c

and is fitted by non-negative least squares over every size and layout of the level, weighting each point
by ``1 / t_measured`` so the fit minimises *relative* error (small messages count as much as large ones),
and each group size equally (a size measured packed and spread does not count twice).
``gamma_c``, the per-byte cost on the device itself (copies, reductions), is only identifiable when the
level was measured with several group sizes (else it is 0 and folds into ``B_c``). On CPU ranks that
share cores it matters: gloo's time grows less with ``p`` than ``volume(p)`` says. Each algorithm the collective allows is tried
and the one with the smallest relative RMS residual kept (the default unless another is better by more
than ``ALGORITHM_MARGIN``): with a single group size the algorithms are indistinguishable, with several
the ``p``-dependence picks one (gloo's broadcast fits ``flat``).

Where the level was measured with several group sizes, ``alpha`` and ``B`` are also fitted for each ``p``
alone (``LinkLevel.collective_measured``): the formulas' ``p``-scaling does not hold for ranks that share
CPU cores (a 4-rank gloo ring step waits on more context switches than a 2-rank one), and the planner asks
for exactly the group sizes that were measured. Where one ``p`` was measured with several strides, they are
fitted for each layout ``(p, stride)`` alone too (``LinkLevel.collective_measured_by_layout``): on shared
cores which ranks pair up matters (4 gloo ranks on 2 cores: pairs {0,1},{2,3} send ~10% slower than {0,2},
{1,3} in every profile, which a per-``p`` fit averages away), and a mesh axis asks for exactly these
layouts. The level-wide fit serves every other ``p``; the per-``p`` fit, strides that were not measured.

The level's ``bandwidth_bytes_per_s`` is the largest fitted ``B_c``; each collective keeps
``B_c / bandwidth`` as its ``collective_efficiency``, its ``alpha_c`` as ``collective_latency_s`` and its
algorithm as ``collective_algorithm``, so ``tessera.topology.collectives`` reproduces the fit exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, Field

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import FROZEN, Cluster, Collective, DeviceSpec, LinkLevel
from tessera.topology.collectives import ALGORITHMS, coefficients, participants_per_level

ALGORITHM_MARGIN = 0.10
"""A non-default algorithm must cut the relative RMS residual by this fraction to be chosen."""


class Measurement(BaseModel):
    """One measured point: a collective of ``nbytes`` on every group of one layout at once."""

    model_config = FROZEN

    collective: Collective
    """Which collective (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``p2p``)."""
    group_size: int = Field(gt=1)
    """Ranks per group."""
    stride: int = Field(gt=0)
    """Rank distance between consecutive members of a group."""
    nbytes: int = Field(gt=0)
    """Bytes as the cost functions define them (full buffer for all-reduce / reduce-scatter input /
    all-gather output / broadcast; each rank's send buffer for all-to-all; the message for p2p)."""
    seconds: float = Field(gt=0)
    """The time taken as measured: mean of the faster half of the trials (see ``trials_s``)."""
    trials_s: tuple[float, ...] = ()
    """Every trial's time (slowest rank, mean over the ops of the trial), in seconds."""


class CollectiveFit(BaseModel):
    """The fitted alpha-beta parameters of one collective at one level."""

    model_config = FROZEN

    level: str
    """Name of the level."""
    collective: Collective
    """Which collective."""
    algorithm: str
    """The algorithm whose coefficients fitted best."""
    latency_s: float = Field(ge=0)
    """Fitted per-step latency (alpha) in seconds."""
    bandwidth_bytes_per_s: float = Field(gt=0)
    """Fitted per-device bandwidth (1/beta) in bytes/s."""
    local_s_per_byte: float = Field(default=0.0, ge=0)
    """Fitted per-byte local cost (gamma) in seconds per byte; 0 unless several group sizes were measured."""
    rel_rms: float = Field(ge=0)
    """Relative RMS residual of the fit over its points."""
    by_group_size: dict[int, tuple[float, float]] = Field(default_factory=dict)
    """``p -> (latency_s, bandwidth_bytes_per_s)`` fitted on the points of each group size alone (same
    algorithm), when the level was measured with more than one ``p``."""
    by_layout: dict[int, dict[int, tuple[float, float]]] = Field(default_factory=dict)
    """``p -> stride -> (latency_s, bandwidth_bytes_per_s)`` fitted on the points of each layout alone (same
    algorithm), for the group sizes measured with more than one stride."""
    size_dependent: bool = True
    """False when the times showed no growth with size (``bandwidth_bytes_per_s`` is then a 1e15 stand-in)."""
    points: int = Field(gt=0)
    """Number of measurements fitted."""


class Point(NamedTuple):
    """One measurement as a level's fit sees it: ``p`` participants ``stride`` ranks apart at the level."""

    p: int
    stride: int
    nbytes: int
    seconds: float


NO_SLOPE_BANDWIDTH = 1e15
"""Bandwidth reported when measured times do not grow with size (bytes/s; effectively infinite)."""


def fit_alpha_beta(
    steps: Sequence[float], volume_bytes: Sequence[float], seconds: Sequence[float],
    local_bytes: Sequence[float] | None = None, weights: Sequence[float] | None = None,
) -> tuple[float, float, float, float]:
    """``(alpha, bandwidth, gamma, rel_rms)`` minimising ``sum(((steps*alpha + volume/B + local*gamma) - t) / t)^2``.

    Non-negative least squares by enumeration: every subset of the terms is solved by weighted least
    squares and the best solution with no negative coefficient kept. Without ``local_bytes`` (or when it
    is proportional to ``volume_bytes``: a single group size) ``gamma`` is 0. Times that do not grow with
    size give ``bandwidth = NO_SLOPE_BANDWIDTH``. ``weights`` scale each point's squared relative error.
    """
    t = np.asarray(seconds, dtype=float)
    if len(t) < 2 or np.any(t <= 0):
        raise ClusterSpecError("fitting alpha and beta needs at least two positive measurements")
    columns = [np.asarray(steps, dtype=float), np.asarray(volume_bytes, dtype=float)]
    if local_bytes is not None and not _proportional(columns[1], np.asarray(local_bytes, dtype=float)):
        columns.append(np.asarray(local_bytes, dtype=float))
    w = np.sqrt(np.ones_like(t) if weights is None else np.asarray(weights, dtype=float))
    best: tuple[float, np.ndarray] | None = None
    for subset in _subsets(len(columns)):
        a = np.stack([w * columns[i] / t for i in subset], axis=1)
        solution, *_ = np.linalg.lstsq(a, w, rcond=None)
        if np.any(solution < 0):
            continue
        coef = np.zeros(3)
        coef[list(subset)] = solution
        residual = (sum(coef[i] * columns[i] for i in range(len(columns))) - t) / t
        rms = float(np.sqrt(np.sum(w**2 * residual**2) / np.sum(w**2)))
        if best is None or rms < best[0]:
            best = (rms, coef)
    rms, (alpha, inv_bw, gamma) = best  # the one-term subsets are always feasible: t > 0, columns >= 0
    bandwidth = 1.0 / inv_bw if inv_bw > 1 / NO_SLOPE_BANDWIDTH else NO_SLOPE_BANDWIDTH
    return float(alpha), float(bandwidth), float(gamma), rms


def _subsets(n: int) -> list[tuple[int, ...]]:
    return [tuple(i for i in range(n) if mask >> i & 1) for mask in range(1, 2**n)]


def _proportional(x: np.ndarray, y: np.ndarray) -> bool:
    ratio = y / np.where(x == 0, np.nan, x)
    return bool(np.nanmax(ratio) - np.nanmin(ratio) <= 1e-9 * np.nanmax(np.abs(ratio))) if np.any(x) else False


def fit_collective(level: LinkLevel, collective: Collective, points: Sequence[Point]) -> CollectiveFit:
    """Fit one collective at one level from its points, choosing the algorithm."""
    per_p = {p: sum(1 for point in points if point.p == p) for p, *_ in points}
    weights = [1 / per_p[point.p] for point in points]  # every group size counts equally, however many layouts it has
    fits = []
    for algorithm in ALGORITHMS[collective]:
        rows = [coefficients(collective, algorithm, point.p) for point in points]
        alpha, bandwidth, gamma, rms = fit_alpha_beta(
            [steps for steps, _ in rows], [volume * point.nbytes for (_, volume), point in zip(rows, points)],
            [point.seconds for point in points], local_bytes=[point.nbytes for point in points], weights=weights,
        )
        fits.append(CollectiveFit(
            level=level.name, collective=collective, algorithm=algorithm, latency_s=alpha,
            bandwidth_bytes_per_s=bandwidth, local_s_per_byte=gamma, rel_rms=rms, points=len(points),
            size_dependent=bandwidth < NO_SLOPE_BANDWIDTH,
        ))
    best = min(fits, key=lambda fit: fit.rel_rms)
    chosen = fits[0] if fits[0].rel_rms <= best.rel_rms * (1 + ALGORITHM_MARGIN) else best
    return chosen.model_copy(update={
        "by_group_size": _fit_each_group_size(collective, chosen.algorithm, points),
        "by_layout": _fit_each_layout(collective, chosen.algorithm, points),
    })


def _fit_each_group_size(collective: str, algorithm: str, points: Sequence[Point]) -> dict[int, tuple[float, float]]:
    """``p -> (alpha, bandwidth)`` for each group size with two or more sizes, if there are several ``p``."""
    if len({point.p for point in points}) < 2:
        return {}
    return _fit_each(collective, algorithm, points, key=lambda point: point.p)


def _fit_each_layout(collective: str, algorithm: str, points: Sequence[Point]) -> dict[int, dict[int, tuple[float, float]]]:
    """``p -> stride -> (alpha, bandwidth)`` for each group size measured with several strides."""
    table = {}
    for p in sorted({point.p for point in points}):
        mine = [point for point in points if point.p == p]
        if len({point.stride for point in mine}) > 1:
            table[p] = _fit_each(collective, algorithm, mine, key=lambda point: point.stride)
    return {p: row for p, row in table.items() if row}


def _fit_each(
    collective: str, algorithm: str, points: Sequence[Point], *, key: Callable[[Point], int]
) -> dict[int, tuple[float, float]]:
    """``key -> (alpha, bandwidth)`` fitted on each set of points sharing a key and two or more sizes."""
    table = {}
    for value in sorted({key(point) for point in points}):
        mine = [point for point in points if key(point) == value]
        if len({point.nbytes for point in mine}) < 2:
            continue
        steps, volume = coefficients(collective, algorithm, mine[0].p)  # one p per set: both keys imply it
        alpha, bandwidth, _, _ = fit_alpha_beta(
            [steps] * len(mine), [volume * point.nbytes for point in mine], [point.seconds for point in mine]
        )
        table[value] = (alpha, bandwidth)
    return table


def single_level_points(skeleton: Cluster, measurements: Sequence[Measurement]) -> dict[tuple[str, str], list[Point]]:
    """``(level name, collective) -> points`` for layouts crossing exactly one level."""
    points: dict[tuple[str, str], list[Point]] = {}
    for m in measurements:
        phases = participants_per_level(skeleton, group_size=m.group_size, stride=m.stride)
        if m.collective == "p2p":  # a pair: one hop at the level the pair spans
            phases = [(skeleton.level_spanned(2, stride=m.stride), 2)]
        if len(phases) == 1:
            level, p = phases[0]
            points.setdefault((level.name, m.collective), []).append(Point(p, m.stride, m.nbytes, m.seconds))
    return points


def fit_cluster(
    skeleton: Cluster, measurements: Sequence[Measurement], *, device: DeviceSpec, name: str, source: str
) -> tuple[Cluster, tuple[CollectiveFit, ...]]:
    """A Cluster with ``skeleton``'s levels, fitted to ``measurements``, and every fit behind it.

    ``skeleton`` gives the level names and group sizes (its bandwidths and latencies are ignored).
    Every level needs at least two single-level measurements of some collective.
    """
    points = single_level_points(skeleton, measurements)
    levels, fits = [], []
    for level in skeleton.levels:
        level_fits = [
            fit_collective(level, collective, pts)
            for (level_name, collective), pts in sorted(points.items())
            if level_name == level.name and len(pts) >= 2
        ]
        if not level_fits:
            raise ClusterSpecError(
                f"no measurement crosses only level '{level.name}'; profile a layout inside it (e.g. group "
                f"size {level.group_size}, stride 1)"
            )
        levels.append(_level_from_fits(level, level_fits, source=source))
        fits.extend(level_fits)
    cluster = Cluster(name=name, device=device, num_devices=skeleton.num_devices, levels=tuple(levels))
    return cluster, tuple(fits)


def _level_from_fits(level: LinkLevel, fits: Sequence[CollectiveFit], *, source: str) -> LinkLevel:
    """The fitted level; a collective whose times did not grow with size gets the level's bandwidth."""
    sloped = [fit.bandwidth_bytes_per_s for fit in fits if fit.size_dependent]
    bandwidth = max(sloped) if sloped else NO_SLOPE_BANDWIDTH
    by_name = {fit.collective: fit for fit in fits}
    latency = by_name["p2p"].latency_s if "p2p" in by_name else min(fit.latency_s for fit in fits)
    return LinkLevel(
        name=level.name,
        group_size=level.group_size,
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        efficiency=1.0,
        collective_efficiency={
            fit.collective: min(1.0, fit.bandwidth_bytes_per_s / bandwidth) if fit.size_dependent else 1.0 for fit in fits
        },
        collective_latency_s={fit.collective: fit.latency_s for fit in fits},
        collective_local_s_per_byte={fit.collective: fit.local_s_per_byte for fit in fits if fit.local_s_per_byte > 0},
        collective_algorithm={fit.collective: fit.algorithm for fit in fits},
        collective_measured={fit.collective: dict(fit.by_group_size) for fit in fits if fit.by_group_size},
        collective_measured_by_layout={fit.collective: dict(fit.by_layout) for fit in fits if fit.by_layout},
        source=source,
    )


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``."""
    return (predicted - measured) / measured if measured > 0 else math.inf
