"""Collective formulas checked against arithmetic done by hand, and the profiler's fit on synthetic data."""

import math

import pytest

from tessera.topology import load_cluster
from tessera.topology.cluster import Cluster, DeviceSpec, LinkLevel
from tessera.topology.collectives import (
    all_gather_time, all_reduce_time, all_to_all_time, broadcast_time, collective_time, p2p_time,
    participants_per_level, reduce_scatter_time, ring_tree_crossover_bytes,
)
from tessera.topology.fitting import Measurement, fit_alpha_beta, fit_cluster

DEVICE = DeviceSpec(name="test", peak_flops_by_dtype={"fp32": 1e12}, memory_bytes=2**30, memory_bandwidth_bytes_per_s=1e11, source="test")
GB = 1e9


def level(name="link", group=8, *, bw=100 * GB, alpha=0.0, **extra) -> LinkLevel:
    return LinkLevel(name=name, group_size=group, bandwidth_bytes_per_s=bw, latency_s=alpha, source="test", **extra)


def cluster(*levels: LinkLevel) -> Cluster:
    return Cluster(name="test", device=DEVICE, num_devices=levels[-1].group_size, levels=levels)


ONE = cluster(level(group=8, bw=100 * GB, alpha=0.0))
TWO = cluster(level("node", 8, bw=400 * GB, alpha=2e-6), level("net", 64, bw=50 * GB, alpha=10e-6))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_moves_two_n_minus_one_over_n_of_the_buffer(n):
    nbytes = 8e9
    assert all_reduce_time(ONE, nbytes, group_size=n, algorithm="ring") == pytest.approx(2 * (n - 1) / n * nbytes / (100 * GB))
    assert reduce_scatter_time(ONE, nbytes, group_size=n) == pytest.approx((n - 1) / n * nbytes / (100 * GB))
    assert all_gather_time(ONE, nbytes, group_size=n) == pytest.approx((n - 1) / n * nbytes / (100 * GB))


def test_ring_all_reduce_latency_is_two_n_minus_one_steps():
    c = cluster(level(group=8, bw=1e30, alpha=5e-6))
    assert all_reduce_time(c, 1.0, group_size=8, algorithm="ring") == pytest.approx(2 * 7 * 5e-6)
    assert all_reduce_time(c, 1.0, group_size=8, algorithm="tree") == pytest.approx(2 * 3 * 5e-6)


def test_tree_beats_ring_below_the_crossover_and_ring_wins_above():
    c = cluster(level(group=16, bw=50 * GB, alpha=10e-6))
    n = 16
    crossover = ring_tree_crossover_bytes(c.levels[0], n)
    assert crossover == pytest.approx(16 * 50e9 * 10e-6 * (15 - 4))  # p * B * alpha * (p - 1 - log2 p) = 88 MB
    ring = lambda nbytes: all_reduce_time(c, nbytes, group_size=n, algorithm="ring")  # noqa: E731
    tree = lambda nbytes: all_reduce_time(c, nbytes, group_size=n, algorithm="tree")  # noqa: E731
    assert ring(crossover) == pytest.approx(tree(crossover))
    assert tree(crossover / 4) < ring(crossover / 4)
    assert all_reduce_time(c, crossover / 4, group_size=n) == pytest.approx(tree(crossover / 4))  # auto = faster
    assert all_reduce_time(c, crossover * 4, group_size=n) == pytest.approx(ring(crossover * 4))
    # by hand at 1 MB: tree = 2*4*alpha + 2*N/B = 80 us + 40 us; ring = 2*15*alpha + 2*15/16*N/B = 300 us + 37.5 us
    assert tree(1e6) == pytest.approx(120e-6) and ring(1e6) == pytest.approx(337.5e-6)


def test_two_ranks_never_pick_tree():
    c = cluster(level(group=2, bw=GB, alpha=1e-3))
    for nbytes in (1, 1e3, 1e9):
        assert all_reduce_time(c, nbytes, group_size=2) == pytest.approx(all_reduce_time(c, nbytes, group_size=2, algorithm="ring"))


def test_all_to_all_one_level_by_hand():
    c = cluster(level(group=8, bw=100 * GB, alpha=4e-6))
    # each rank sends 7/8 of its 1 GB buffer, one message per peer
    assert all_to_all_time(c, 1e9, group_size=8) == pytest.approx(7 * 4e-6 + 7 / 8 * 1e9 / 100e9)


def test_all_to_all_across_nodes_is_bound_by_the_network_share():
    # group of 16 = 2 nodes of 8: 7 peers over NVLink (7/16 of the data), 8 over the network (8/16)
    expected = 7 * 2e-6 + 8 * 10e-6 + max(7 / 16 * 1e9 / 400e9, 8 / 16 * 1e9 / 50e9)
    assert all_to_all_time(TWO, 1e9, group_size=16) == pytest.approx(expected)


def test_broadcast_algorithms_by_hand():
    c = cluster(level(group=8, bw=10 * GB, alpha=1e-5))
    n = 1e8
    assert broadcast_time(c, n, group_size=8, algorithm="ring") == pytest.approx(7 * 1e-5 + n / 10e9)
    assert broadcast_time(c, n, group_size=8, algorithm="tree") == pytest.approx(3 * (1e-5 + n / 10e9))
    assert broadcast_time(c, n, group_size=8, algorithm="flat") == pytest.approx(7 * (1e-5 + n / 10e9))
    assert broadcast_time(c, n, group_size=8) == pytest.approx(7 * 1e-5 + n / 10e9)  # large: pipelined chain wins
    assert broadcast_time(c, 10, group_size=8) == pytest.approx(3 * (1e-5 + 10 / 10e9))  # small: binomial tree wins


def test_a_group_across_nodes_is_slower_than_one_inside_a_node():
    h100 = load_cluster("dgx-h100:nodes=8")
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"):
        inside = collective_time(collective, h100, 1e8, group_size=8, stride=1)
        across = collective_time(collective, h100, 1e8, group_size=8, stride=8)
        assert across > 3 * inside, collective


def test_hierarchical_all_reduce_is_reduce_scatter_in_ring_or_tree_on_top_all_gather_out():
    n = 6.4e9
    node_rs = 7 * 2e-6 + 7 / 8 * n / 400e9
    shard = n / 8
    top_ring = 2 * 7 * 10e-6 + 2 * 7 / 8 * shard / 50e9
    assert all_reduce_time(TWO, n, group_size=64, algorithm="ring") == pytest.approx(2 * node_rs + top_ring)
    top_tree = 2 * 3 * 10e-6 + 2 * shard / 50e9
    assert all_reduce_time(TWO, n, group_size=64, algorithm="tree") == pytest.approx(2 * node_rs + top_tree)


def test_reduce_scatter_shrinks_data_level_by_level():
    n = 6.4e9
    expected = 7 * 2e-6 + 7 / 8 * n / 400e9 + 7 * 10e-6 + 7 / 8 * (n / 8) / 50e9
    assert reduce_scatter_time(TWO, n, group_size=64) == pytest.approx(expected)
    assert all_reduce_time(TWO, n, group_size=1) == 0.0 and all_to_all_time(TWO, 0, group_size=8) == 0.0


def test_oversubscription_divides_the_bandwidth_of_groups_crossing_the_level():
    plain = cluster(level("node", 8, bw=400 * GB), level("net", 64, bw=50 * GB))
    blocked = cluster(level("node", 8, bw=400 * GB), level("net", 64, bw=50 * GB, oversubscription=4.0))
    assert reduce_scatter_time(blocked, 1e9, group_size=8, stride=8) == pytest.approx(
        4 * reduce_scatter_time(plain, 1e9, group_size=8, stride=8)
    )
    assert reduce_scatter_time(blocked, 1e9, group_size=8) == reduce_scatter_time(plain, 1e9, group_size=8)


def test_per_collective_overrides_and_pinned_algorithm():
    lvl = level(group=4, bw=10 * GB, alpha=1e-4, efficiency=0.5,
                collective_efficiency={"broadcast": 0.25}, collective_latency_s={"broadcast": 1e-3},
                collective_algorithm={"broadcast": "flat"})
    c = cluster(lvl)
    assert broadcast_time(c, 1e8, group_size=4) == pytest.approx(3 * (1e-3 + 1e8 / 2.5e9))
    assert all_gather_time(c, 1e8, group_size=4) == pytest.approx(3 * 1e-4 + 3 / 4 * 1e8 / 5e9)


def test_p2p_takes_the_slowest_hop_of_the_group():
    assert p2p_time(TWO, 1e9, distance=1) == pytest.approx(2e-6 + 1e9 / 400e9)
    assert p2p_time(TWO, 1e9, distance=8) == pytest.approx(10e-6 + 1e9 / 50e9)
    # a 4-stage pipeline with stages 4 ranks apart: the 4 -> 8 hop leaves the node
    assert p2p_time(TWO, 1e9, group_size=4, stride=4) == p2p_time(TWO, 1e9, distance=8)
    assert p2p_time(TWO, 1e9, group_size=2, stride=4) == p2p_time(TWO, 1e9, distance=1)


def test_tpu_torus_group_runs_one_ring_per_axis():
    tpu = load_cluster("tpu-v5p:nodes=64")  # 256 chips
    phases = participants_per_level(tpu, group_size=64)
    assert [(lvl.name, p) for lvl, p in phases] == [("ici-x", 4), ("ici-y", 4), ("ici-z", 4)]


def test_nvl72_keeps_a_72_gpu_group_on_nvlink():
    nvl = load_cluster("gb200-nvl72:nodes=4")
    assert [(lvl.name, p) for lvl, p in participants_per_level(nvl, group_size=72)] == [("nvlink-nvl72", 72)]
    assert all_reduce_time(nvl, 1e9, group_size=72) < all_reduce_time(nvl, 1e9, group_size=72, stride=72) / 5


# --- the profiler's fit, on synthetic measurements from a known model ---------------------------------


def synthetic(c: Cluster, layouts, sizes) -> list[Measurement]:
    out = []
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"):
        for g, s in layouts:
            if collective == "p2p" and g != 2:
                continue
            for n in sizes:
                t = collective_time(collective, c, n, group_size=g, stride=s)
                out.append(Measurement(collective=collective, group_size=g, stride=s, nbytes=n, seconds=t))
    return out


def test_fit_alpha_beta_recovers_a_line_exactly():
    alpha, bandwidth, gamma, rms = fit_alpha_beta([3, 3, 3], [1e3, 1e6, 1e9], [3e-4 + 1e3 / 1e9, 3e-4 + 1e6 / 1e9, 3e-4 + 1.0])
    assert alpha == pytest.approx(1e-4) and bandwidth == pytest.approx(1e9) and rms < 1e-9


def test_fit_recovers_latency_bandwidth_and_gloos_flat_broadcast():
    # one algorithm per collective (an 'auto' min of ring and tree is not a single alpha-beta line)
    truth = cluster(level("loopback", 8, bw=2 * GB, alpha=3e-4, collective_efficiency={"all_to_all": 0.5},
                          collective_algorithm={"broadcast": "flat", "all_reduce": "ring"}))
    layouts = [(2, 1), (2, 4), (4, 1), (4, 2), (8, 1)]
    measured = synthetic(truth, layouts, [2**k for k in range(12, 25, 2)])
    fitted, fits = fit_cluster(truth, measured, device=DEVICE, name="fit", source="synthetic")
    lvl = fitted.levels[0]
    assert lvl.bandwidth_bytes_per_s == pytest.approx(2 * GB, rel=1e-6)
    assert lvl.collective_efficiency["all_to_all"] == pytest.approx(0.5, rel=1e-6)
    assert lvl.collective_algorithm["broadcast"] == "flat"
    assert lvl.collective_latency_s["all_reduce"] == pytest.approx(3e-4, rel=1e-6)
    for m in measured:  # the fitted cluster reproduces every point
        g = 2 if m.collective == "p2p" else m.group_size
        assert collective_time(m.collective, fitted, m.nbytes, group_size=g, stride=m.stride) == pytest.approx(m.seconds, rel=1e-6)
    assert all(fit.rel_rms < 1e-6 for fit in fits)


def test_fit_two_levels_uses_single_level_layouts_and_predicts_the_world():
    pinned = {"all_reduce": "ring", "broadcast": "ring"}
    truth = cluster(*(lvl.model_copy(update={"collective_algorithm": pinned}) for lvl in TWO.levels))
    layouts = [(2, 1), (8, 1), (2, 8), (8, 8)]
    fitted, _ = fit_cluster(truth, synthetic(truth, layouts, [2**k for k in range(12, 26, 2)]), device=DEVICE, name="f", source="s")
    assert [lvl.name for lvl in fitted.levels] == ["node", "net"]
    # the world group (crossing both levels) was never measured, yet is predicted from the two levels
    for nbytes in (2**14, 2**22):
        assert all_gather_time(fitted, nbytes, group_size=64) == pytest.approx(all_gather_time(truth, nbytes, group_size=64), rel=1e-6)
    assert math.isclose(fitted.levels[1].bandwidth_bytes_per_s, 50e9, rel_tol=1e-6)


def test_values_measured_for_a_group_size_replace_the_level_wide_ones_for_that_size_only():
    lvl = level(group=4, bw=1 * GB, alpha=1e-4, collective_measured={"all_gather": {4: (1e-3, 0.5 * GB)}})
    c = cluster(lvl)
    assert all_gather_time(c, 1e8, group_size=4) == pytest.approx(3 * 1e-3 + 3 / 4 * 1e8 / 0.5e9)
    assert all_gather_time(c, 1e8, group_size=2) == pytest.approx(1e-4 + 1 / 2 * 1e8 / 1e9)
    assert all_reduce_time(c, 1e8, group_size=4) == pytest.approx(all_reduce_time(cluster(level(group=4, bw=GB, alpha=1e-4)), 1e8, group_size=4))


def test_values_measured_for_a_layout_replace_the_per_size_ones_for_that_layout_only():
    lvl = level(group=4, bw=1 * GB, alpha=1e-4, collective_measured={"all_gather": {2: (1e-3, 0.5 * GB)}},
                collective_measured_by_layout={"all_gather": {2: {2: (2e-3, 0.25 * GB)}}, "all_to_all": {2: {1: (3e-3, GB)}},
                                               "p2p": {2: {2: (4e-3, 2 * GB)}}})
    c = cluster(lvl)
    assert all_gather_time(c, 1e8, group_size=2, stride=2) == pytest.approx(2e-3 + 1 / 2 * 1e8 / 0.25e9)  # the layout
    assert all_gather_time(c, 1e8, group_size=2, stride=1) == pytest.approx(1e-3 + 1 / 2 * 1e8 / 0.5e9)  # the p
    assert all_gather_time(c, 1e8, group_size=4) == pytest.approx(3 * 1e-4 + 3 / 4 * 1e8 / 1e9)  # the level
    assert all_to_all_time(c, 1e8, group_size=2, stride=1) == pytest.approx(3e-3 + 1 / 2 * 1e8 / 1e9)
    assert all_to_all_time(c, 1e8, group_size=2, stride=2) == pytest.approx(1e-4 + 1 / 2 * 1e8 / 1e9)
    assert p2p_time(c, 1e8, distance=2) == pytest.approx(4e-3 + 1e8 / 2e9)
    assert p2p_time(c, 1e8, distance=1) == pytest.approx(1e-4 + 1e8 / 1e9)


def test_a_layout_entry_applies_only_to_groups_crossing_that_level_alone():
    plain = cluster(level("node", 4, bw=400 * GB, alpha=2e-6), level("net", 8, bw=50 * GB, alpha=10e-6))
    entry = {2: {1: (5e-3, 0.1 * GB), 4: (5e-3, 0.1 * GB)}}
    net = plain.levels[1].model_copy(update={"collective_measured_by_layout": {"reduce_scatter": entry, "p2p": entry}})
    c = cluster(plain.levels[0], net)
    # two ranks 4 apart meet at the network level only: the layout measured there
    assert reduce_scatter_time(c, 1e8, group_size=2, stride=4) == pytest.approx(5e-3 + 1 / 2 * 1e8 / 0.1e9)
    assert p2p_time(c, 1e8, distance=4) == pytest.approx(5e-3 + 1e8 / 0.1e9)
    # the world crosses both levels (its network phase has p = 2, stride 1 is not that phase's layout)
    assert reduce_scatter_time(c, 1e8, group_size=8) == pytest.approx(reduce_scatter_time(plain, 1e8, group_size=8))
    # its slowest hop crosses the network between neighbours, not a pair measured 1 apart inside a node
    assert p2p_time(c, 1e8, group_size=8) == pytest.approx(p2p_time(plain, 1e8, group_size=8))


def test_fit_keeps_each_measured_layout_and_pools_group_sizes_for_the_rest():
    ring = {"all_reduce": "ring", "broadcast": "flat"}
    packed = cluster(level("loop", 4, bw=2 * GB, alpha=3e-4, collective_algorithm=ring))
    spread = cluster(level("loop", 4, bw=1 * GB, alpha=5e-4, collective_algorithm=ring))
    sizes = [2**k for k in range(12, 25, 2)]
    measured = synthetic(packed, [(2, 1), (4, 1)], sizes) + synthetic(spread, [(2, 2)], sizes)
    fitted, fits = fit_cluster(packed, measured, device=DEVICE, name="fit", source="synthetic")
    assert all(set(fit.by_layout) == {2} and set(fit.by_layout[2]) == {1, 2} for fit in fits)
    assert fitted.levels[0].collective_measured_by_layout["all_gather"][2][2] == pytest.approx((5e-4, 1 * GB), rel=1e-6)
    for m in measured:  # every measured layout is reproduced, though 2 x 1 and 2 x 2 follow different lines
        g = 2 if m.collective == "p2p" else m.group_size
        assert collective_time(m.collective, fitted, m.nbytes, group_size=g, stride=m.stride) == pytest.approx(m.seconds, rel=1e-6)


def test_profiler_layouts_tile_the_world_and_cover_each_level():
    from tessera.topology.profiler import group_layouts
    from tessera.topology.measure import groups_of

    assert group_layouts(4, per_node=4) == [(2, 1), (2, 2), (4, 1)]
    assert group_layouts(16, per_node=8) == [(2, 1), (8, 1), (2, 8), (16, 1)]  # intra, inter, and the world
    assert group_layouts(4, per_node=1) == [(2, 1), (4, 1)]
    for world, per_node in ((4, 4), (8, 8), (16, 8), (32, 8)):
        for g, s in group_layouts(world, per_node=per_node):
            groups = groups_of(world, g, s)
            assert sorted(r for group in groups for r in group) == list(range(world))
            assert all(b - a == s for group in groups for a, b in zip(group, group[1:]))


def test_a_level_that_does_not_tile_the_group_counts_its_partial_sub_group():
    a100 = load_cluster("dgx-a100:nodes=128")  # leaf units of 20 nodes (160 GPUs) under the spine
    phases = participants_per_level(a100, group_size=128, stride=8)
    assert [(lvl.name, p) for lvl, p in phases] == [("infiniband", 20), ("spine", 7)]  # 20 x 7 >= 128
