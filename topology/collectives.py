r"""Collective times on the link hierarchy: alpha-beta per level, ring/tree algorithms, hierarchical phases.

Notation: a group of ``n`` ranks laid ``stride`` apart (a mesh axis); ``N`` bytes as defined per collective
below; at a level, ``alpha`` is the per-step latency and ``B`` the bandwidth one device reaches,
``B = bandwidth * efficiency / oversubscription`` (``LinkLevel.link``, with the level's per-collective
efficiency and latency where it has them).

**Layout.** The group is decomposed level by level, innermost first (``participants_per_level``): at level
``l`` it joins ``p_l`` sub-groups of the level below, ``n = p_1 * p_2 * ... * p_L``. A group of 8 with
stride 1 on 8-GPU nodes has one phase (NVLink, ``p = 8``); a group of 8 with stride 8 has one phase at the
network level (``p = 8``, one GPU per node); a group of 16 with stride 1 has two (``p = 8`` then ``p = 2``).

**One level, p participants, D bytes** — ``t = steps(p) * alpha + volume(p) * D / B + gamma * D``
(``coefficients``; ``gamma`` is the level's per-byte local cost, ``LinkLevel.collective_local_s_per_byte``,
0 unless profiled; a profiled level may also carry alpha and B measured for exactly this ``p``,
``LinkLevel.collective_measured``, or for exactly this layout, ``p`` ranks ``stride`` apart,
``LinkLevel.collective_measured_by_layout``, which then replace the level-wide values; see ``level_time``):

=================  =========  ===========================  ==========================
collective         algorithm  steps                        volume
=================  =========  ===========================  ==========================
reduce-scatter     ring       p - 1                        (p - 1) / p
all-gather         ring       p - 1                        (p - 1) / p
all-reduce         ring       2 (p - 1)                    2 (p - 1) / p
all-reduce         tree       2 ceil(log2 p)               2
broadcast          ring       p - 1                        1
broadcast          tree       ceil(log2 p)                 ceil(log2 p)
broadcast          flat       p - 1                        p - 1
all-to-all         direct     p - 1                        (p - 1) / p
point-to-point     direct     1                            1
=================  =========  ===========================  ==========================

Ring all-reduce is a reduce-scatter then an all-gather: each device sends ``2(p-1)/p`` of the buffer
(Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005). Tree all-reduce is NCCL's pipelined double
binary tree: a reduce up and a broadcast down, ``log2 p`` steps each, every rank sending the whole buffer
once per direction. Ring broadcast is a pipelined chain; tree broadcast a binomial tree (the whole buffer
per step); flat broadcast the root sending to each peer in turn (what gloo does). Ring beats tree for
all-reduce above ``N* = p * B * alpha * (p - 1 - ceil(log2 p))`` bytes; ``algorithm="auto"`` takes the
faster, as NCCL's tuner does, unless the level pins one (``LinkLevel.collective_algorithm``).

**Across levels** (``D_l = N / (p_1 ... p_{l-1})`` is the data left after the levels below):

- reduce-scatter ``N`` (the full input buffer): ``sum_l RS_l(p_l, D_l)``; all-gather into an ``N``-byte
  output: the mirror image, ``sum_l AG_l(p_l, D_l)``. This is the bandwidth NCCL's multi-channel rings reach
  on rail-optimised clusters: each device's own NIC carries ``1/p`` of the inter-node traffic.
- all-reduce ``N``: reduce-scatter through the inner levels, all-reduce of the ``D_L`` shard at the outermost
  level (ring or tree), all-gather back: ``sum_{l<L} [RS_l + AG_l](D_l) + AR_L(D_L)``.
- broadcast ``N``: outermost level first, then inside each sub-group: ``sum_l BC_l(p_l, N)`` (pipelining
  across levels is ignored: a multi-level chain is overstated by the inner levels' ``N/B`` terms).
- all-to-all, each rank holding ``N`` bytes of which ``N/n`` go to each member: with ``m_l = p_1 ... p_l``
  members inside a level-``l`` sub-group, ``m_l - m_{l-1}`` peers are first reached at level ``l``:
  ``sum_l [(m_l - m_{l-1}) alpha_l + gamma_l N] + max_l (m_l - m_{l-1}) / n * N / B_l`` (each level's
  links carry their share at once).
- point-to-point of ``N`` bytes between consecutive members of the group (a pipeline stage's send): the
  slowest hop, at the outermost level the group spans: ``alpha + N / B + gamma N``.

Every function is pure: numbers in, seconds out. ``tessera profile`` fits ``alpha`` and ``B`` per level
and collective against measurements with the same ``coefficients``.
"""

from __future__ import annotations

import math
from typing import Literal

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import Algorithm, Cluster, Collective, LinkLevel

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
    "all_reduce": ("ring", "tree"),
    "broadcast": ("ring", "tree", "flat"),
    "all_to_all": ("direct",),
    "p2p": ("direct",),
}
"""Algorithms each collective may run, first is the default. NCCL picks ring or tree for all-reduce and
rings for the others; the profiler may find a library doing something else (gloo's flat broadcast)."""


def coefficients(collective: str, algorithm: str, p: int) -> tuple[float, float]:
    """``(steps, volume)`` such that one level's time is ``steps * alpha + volume * D / B`` (table above)."""
    if p <= 1:
        return 0.0, 0.0
    row = _COEFFICIENTS.get((collective, algorithm))
    if row is None:
        raise ClusterSpecError(
            f"no algorithm {algorithm!r} for {collective}; choose one of {', '.join(ALGORITHMS.get(collective, ()))}"
        )
    steps, volume = row(p, math.ceil(math.log2(p)))
    return float(steps), float(volume)


_COEFFICIENTS = {
    ("reduce_scatter", "ring"): lambda p, log: (p - 1, (p - 1) / p),
    ("all_gather", "ring"): lambda p, log: (p - 1, (p - 1) / p),
    ("all_reduce", "ring"): lambda p, log: (2 * (p - 1), 2 * (p - 1) / p),
    ("all_reduce", "tree"): lambda p, log: (2 * log, 2.0),
    ("broadcast", "ring"): lambda p, log: (p - 1, 1.0),
    ("broadcast", "tree"): lambda p, log: (log, float(log)),
    ("broadcast", "flat"): lambda p, log: (p - 1, float(p - 1)),
    ("all_to_all", "direct"): lambda p, log: (p - 1, (p - 1) / p),
    ("p2p", "direct"): lambda p, log: (1, 1.0),
}
"""The table above, ``(collective, algorithm) -> (p, ceil(log2 p)) -> (steps, volume)``."""


def level_time(
    level: LinkLevel, collective: Collective, nbytes: float, p: int, *, algorithm: str = "auto",
    stride: int | None = None,
) -> float:
    """Seconds for ``collective`` of ``nbytes`` among ``p`` participants on one level.

    ``algorithm="auto"`` uses the level's pinned algorithm for the collective if it has one, else the
    fastest the collective allows (``ALGORITHMS``). Where the level has values measured for exactly this
    layout (``stride``: the group's rank stride, given when the group crosses this level only;
    ``LinkLevel.collective_measured_by_layout``) or else for exactly ``p`` participants
    (``LinkLevel.collective_measured``), they replace the level-wide alpha, B and gamma.
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    pieces, gamma = _level_pieces(level, collective, p, algorithm, stride)
    return min(fixed + volume * nbytes / bandwidth for fixed, volume, bandwidth in pieces) + gamma * nbytes


def _level_pieces(
    level: LinkLevel, collective: Collective, p: int, algorithm: str, stride: int | None,
) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """``level_time``'s affine pieces: ``((steps * alpha, volume, B), ...)`` per candidate algorithm and the
    per-byte ``gamma``, so that the time is ``min(steps * alpha + volume * D / B) + gamma * D``. Memoised: the
    search prices the same few groups of a cluster hundreds of thousands of times, and a level never changes."""
    key = (id(level), collective, p, algorithm, stride)
    hit = _PIECES.get(key)
    if hit is not None and hit[0] is level:
        return hit[1]
    alpha, bandwidth = level.link(collective)
    gamma = level.collective_local_s_per_byte.get(collective, 0.0)
    pinned = level.collective_algorithm.get(collective)
    measured = level.measured_link(collective, p, stride=stride)
    if measured is not None and algorithm in ("auto", pinned or ALGORITHMS[collective][0]):
        steps, volume = coefficients(collective, pinned or ALGORITHMS[collective][0], p)
        pieces = (((steps * measured[0], volume, measured[1]),), 0.0)
    else:
        if algorithm == "auto":
            candidates = (pinned,) if pinned else ALGORITHMS[collective]
        else:
            candidates = (algorithm,)
        lines = []
        for name in candidates:
            steps, volume = coefficients(collective, name, p)
            lines.append((steps * alpha, volume, bandwidth))
        pieces = (tuple(lines), gamma)
    _remember(_PIECES, key, (level, pieces))
    return pieces


_PIECES: dict[tuple, tuple] = {}
_PHASES: dict[tuple, tuple] = {}
CACHE_LIMIT = 65536
"""Entries a memo holds before it starts afresh (each is a few small tuples)."""


def _remember(cache: dict, key: tuple, value: tuple) -> None:
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def participants_per_level(cluster: Cluster, *, group_size: int, stride: int = 1) -> list[tuple[LinkLevel, int]]:
    """``(level, p)`` for every level the group crosses, where ``p`` sub-groups meet at that level.

    A level whose groups hold a number of members that the level below does not divide (a 20-node
    InfiniBand unit under a 128-node group) joins ``ceil`` of the ratio: the last sub-group is partial.
    """
    return list(_levels_crossed(cluster, group_size, stride))


def _levels_crossed(cluster: Cluster, group_size: int, stride: int) -> tuple[tuple[LinkLevel, int], ...]:
    """``participants_per_level`` as a tuple, memoised per cluster object (clusters are immutable)."""
    key = (id(cluster), group_size, stride)
    hit = _PHASES.get(key)
    if hit is not None and hit[0] is cluster:
        return hit[1]
    phases: list[tuple[LinkLevel, int]] = []
    below = 1
    for level in cluster.levels:
        within = min(group_size, max(1, level.group_size // stride))
        if within > below:
            phases.append((level, math.ceil(within / below)))
            below = within
    _remember(_PHASES, key, (cluster, tuple(phases)))
    return tuple(phases)


def _one_level_stride(phases: list, stride: int) -> int | None:
    """``stride`` when the group crosses one level only (a layout the profiler measures as such), else None."""
    return stride if len(phases) == 1 else None


def _sharded_phases(cluster: Cluster, nbytes: float, *, group_size: int, stride: int) -> list[tuple[LinkLevel, int, float]]:
    """``(level, p, D)``: each phase with the data left after the levels below have split it."""
    phases, data = [], float(nbytes)
    for level, p in _levels_crossed(cluster, group_size, stride):
        phases.append((level, p, data))
        data /= p
    return phases


def reduce_scatter_time(cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1) -> float:
    """Seconds to reduce-scatter ``nbytes`` (the full, unsharded buffer) over the group."""
    if group_size <= 1:
        return 0.0
    phases = _sharded_phases(cluster, nbytes, group_size=group_size, stride=stride)
    layout = _one_level_stride(phases, stride)
    return sum(level_time(level, "reduce_scatter", data, p, stride=layout) for level, p, data in phases)


def all_gather_time(cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1) -> float:
    """Seconds to all-gather into an ``nbytes`` output buffer (each rank contributes ``nbytes/n``)."""
    if group_size <= 1:
        return 0.0
    phases = _sharded_phases(cluster, nbytes, group_size=group_size, stride=stride)
    layout = _one_level_stride(phases, stride)
    return sum(level_time(level, "all_gather", data, p, stride=layout) for level, p, data in phases)


def all_reduce_time(
    cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1,
    algorithm: Literal["auto", "ring", "tree"] = "auto",
) -> float:
    """Seconds to all-reduce ``nbytes``: reduce-scatter inward, ring or tree at the top, all-gather back."""
    if group_size <= 1:
        return 0.0
    phases = _sharded_phases(cluster, nbytes, group_size=group_size, stride=stride)
    *inner, (top, p, data) = phases
    inner_s = sum(
        level_time(level, "reduce_scatter", d, q) + level_time(level, "all_gather", d, q) for level, q, d in inner
    )
    return inner_s + level_time(top, "all_reduce", data, p, algorithm=algorithm, stride=_one_level_stride(phases, stride))


def broadcast_time(
    cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1,
    algorithm: Literal["auto", "ring", "tree", "flat"] = "auto",
) -> float:
    """Seconds to broadcast ``nbytes`` from one member to the group: outer level first, then within."""
    if group_size <= 1:
        return 0.0
    phases = _levels_crossed(cluster, group_size, stride)
    layout = _one_level_stride(phases, stride)
    return sum(level_time(level, "broadcast", nbytes, p, algorithm=algorithm, stride=layout) for level, p in phases)


def all_to_all_time(
    cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1, per_node_share: float | None = None
) -> float:
    """Seconds for an all-to-all where each rank holds ``nbytes``, ``nbytes/n`` for each member.

    ``per_node_share``: the exchange sends once to each other node and fans out inside it (DeepEP's dispatch:
    ``cost_models.sparse.per_node_share``): of the bytes bound for other nodes, that share crosses the levels beyond a
    node, one message to each other node; inside a node, NVLink carries the copies for every other member, those that
    arrived from other nodes included."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    phases = _levels_crossed(cluster, group_size, stride)
    per_node = per_node_share is not None
    if len(phases) == 1 and not (per_node and _beyond_node(cluster, phases[0][0])):
        (level, p), = phases  # one level: the table's formula, with what was measured for the layout or p
        return level_time(level, "all_to_all", nbytes, p, stride=stride)
    latency_s, transfer_s, below = 0.0, 0.0, 1
    for level, p in phases:
        peers = below * p - below  # members first reached at this level
        alpha, bandwidth = level.link("all_to_all")
        share, messages = peers / group_size, peers
        if per_node and _beyond_node(cluster, level):
            share, messages = per_node_share * share, p - 1  # once to each other node, of the bytes bound there
        elif per_node:
            share = (below * p - 1) / (below * p)  # the node's fan-out: every other member's copies
        latency_s += messages * alpha + level.collective_local_s_per_byte.get("all_to_all", 0.0) * nbytes
        transfer_s = max(transfer_s, share * nbytes / bandwidth)
        below *= p
    return latency_s + transfer_s


def _beyond_node(cluster: Cluster, level: LinkLevel) -> bool:
    """Whether ``level`` joins devices of different nodes."""
    return level.group_size > cluster.devices_per_node


def p2p_time(
    cluster: Cluster, nbytes: float, *, group_size: int = 2, stride: int = 1, distance: int | None = None
) -> float:
    """Seconds to send ``nbytes`` between consecutive members of a group (the slowest hop).

    ``group_size`` ranks ``stride`` apart (a pipeline axis): some consecutive pair crosses the outermost
    level the group spans. ``distance=d`` is shorthand for one pair ``d`` ranks apart.
    """
    if distance is not None:
        group_size, stride = 2, distance
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    level = cluster.level_spanned(group_size, stride=stride)
    pair_level = cluster.level_spanned(2, stride=stride)  # where a measured pair this far apart talked
    return level_time(level, "p2p", nbytes, 2, stride=stride if pair_level.name == level.name else None)


def collective_time(collective: Collective, cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1) -> float:
    """Dispatch by collective name (``all_reduce``, ``all_gather``, ...), with each one's default algorithm."""
    functions = {
        "all_reduce": all_reduce_time,
        "all_gather": all_gather_time,
        "reduce_scatter": reduce_scatter_time,
        "all_to_all": all_to_all_time,
        "broadcast": broadcast_time,
        "p2p": p2p_time,
    }
    if collective not in functions:
        raise ClusterSpecError(f"unknown collective {collective!r}; known: {', '.join(functions)}")
    return functions[collective](cluster, nbytes, group_size=group_size, stride=stride)


def ring_tree_crossover_bytes(level: LinkLevel, p: int) -> float:
    """All-reduce size above which ring beats tree among ``p`` participants of ``level`` (0 if ring always wins)."""
    alpha, bandwidth = level.link("all_reduce")
    return max(0.0, p * bandwidth * alpha * (p - 1 - math.ceil(math.log2(p)))) if p > 1 else 0.0


__all__ = [
    "ALGORITHMS", "Algorithm", "all_gather_time", "all_reduce_time", "all_to_all_time", "broadcast_time",
    "coefficients", "collective_time", "level_time", "p2p_time", "participants_per_level",
    "reduce_scatter_time", "ring_tree_crossover_bytes",
]
