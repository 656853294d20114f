"""Collective times on the link hierarchy (alpha-beta, ring algorithm, hierarchical phases).

A group of ``n`` ranks laid ``stride`` apart is decomposed level by level, innermost first: at each level
it joins ``p`` sub-groups of the level below. A reduce-scatter runs a ring over those ``p`` participants
per level on the data that is left after the levels below (data shrinks by ``p`` each level); an
all-gather is the mirror image; an all-reduce is both. This is the bandwidth NCCL's multi-channel rings
reach on rail-optimised clusters (every device's own NIC carries ``1/p`` of the inter-node traffic).
"""

from __future__ import annotations

from tessera.topology.cluster import Cluster, LinkLevel


def participants_per_level(cluster: Cluster, *, group_size: int, stride: int = 1) -> list[tuple[LinkLevel, int]]:
    """``(level, p)`` for every level the group crosses, where ``p`` sub-groups meet at that level."""
    phases: list[tuple[LinkLevel, int]] = []
    below = 1
    for level in cluster.levels:
        within = min(group_size, max(1, level.group_size // stride))
        if within > below:
            phases.append((level, within // below))
            below = within
    return phases


def reduce_scatter_time(cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1) -> float:
    """Seconds to reduce-scatter ``nbytes`` (the full, unsharded buffer) over the group."""
    if group_size <= 1:
        return 0.0
    seconds, data = 0.0, float(nbytes)
    for level, p in participants_per_level(cluster, group_size=group_size, stride=stride):
        bandwidth = level.bandwidth_bytes_per_s * level.efficiency
        seconds += (p - 1) / p * data / bandwidth + (p - 1) * level.latency_s
        data /= p
    return seconds


def all_gather_time(cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1) -> float:
    """Seconds to all-gather into an ``nbytes`` output buffer (each rank contributes ``nbytes/n``)."""
    return reduce_scatter_time(cluster, nbytes, group_size=group_size, stride=stride)


def all_reduce_time(cluster: Cluster, nbytes: float, *, group_size: int, stride: int = 1) -> float:
    """Seconds to all-reduce ``nbytes``: a reduce-scatter followed by an all-gather."""
    return 2 * reduce_scatter_time(cluster, nbytes, group_size=group_size, stride=stride)


def p2p_time(cluster: Cluster, nbytes: float, *, distance: int) -> float:
    """Seconds to send ``nbytes`` to a rank ``distance`` positions away."""
    level = cluster.level_spanned(2, stride=distance)
    return level.latency_s + nbytes / (level.bandwidth_bytes_per_s * level.efficiency)
