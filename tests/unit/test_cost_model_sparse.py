"""Expert and context parallelism in the cost model and the search space, against arithmetic done by hand.

The cluster is two link levels with round numbers and no latency (nodes of 8 at 100 GB/s per device and
direction, a network at 10 GB/s), so every collective below is bytes over bandwidth times its volume factor.
"""

from dataclasses import replace

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import Calibration, attention_core_rate
from tessera.cost_models.profiles import TESSERA
from tessera.cost_models.estimate import stage_time
from tessera.cost_models.partition import stage_totals
from tessera.cost_models.sparse import (
    cp_comm_s, dense_group, ep_comm_s, expert_group, exposed_ep_comm_s, group_all_reduce_s, local_param_split,
    per_node_share, unpartnered_share,
)
from tessera.cost_models.layer_stats import LayerStats, LinearPair
from tessera.errors import ConfigError
from tessera.planner.plan_facts import exposed_comm_by_kind
from tessera.planner.space import LONG_CONTEXT_TOKENS, mesh_shapes, runtime_refusal
from tessera.topology import load_cluster
from tessera.topology.clusterfile import cluster_from_raw
from tessera.topology.collectives import all_gather_time, all_reduce_time, reduce_scatter_time

GiB = 2**30
FLAT = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0)  # achievable = 494.5 TFLOP/s, any width
NODE_BW, NET_BW = 100e9, 10e9


def cluster(nodes: int):
    raw = {
        "device": "H100-SXM-80GB", "devices_per_node": 8, "size_key": "nodes",
        "levels": [
            {"name": "nvlink", "group_size": "node", "bandwidth_gb_per_s": NODE_BW / 1e9, "latency_us": 0},
            {"name": "network", "group_size": "world", "bandwidth_gb_per_s": NET_BW / 1e9, "latency_us": 0},
        ],
    }
    return cluster_from_raw(raw, name=f"test:nodes={nodes}", size=nodes)


OUT = 2**24  # output bytes of a block for one sequence (e.g. 2048 tokens x 4096 x 2 B)
EXPERT_PARAMS, DENSE_PARAMS = 8 * 10**8, 2 * 10**8


def moe_block(i: int, *, experts: int = 8, top_k: int = 2, factor: float = 1.0) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="m", param_count=DENSE_PARAMS + EXPERT_PARAMS,
        forward_flops=1e12, backward_flops=2e12, saved_bytes_no_recompute=GiB, saved_bytes_full_recompute=OUT,
        output_bytes=OUT, hidden_size=4096, attention_heads=32, kv_heads=8, experts=experts, top_k=top_k,
        expert_param_count=EXPERT_PARAMS, expert_forward_flops=5e11, expert_backward_flops=1e12,
        expert_capacity_factor=factor, selective_recompute_flops=1e11, saved_bytes_selective=GiB // 2,
        tp_pairs=(LinearPair(column=("attn.q", "attn.k", "attn.v"), row="attn.o", role="attention"),
                  *(LinearPair(column=(f"moe.experts.{e}.gate", f"moe.experts.{e}.up"), row=f"moe.experts.{e}.down",
                               role="expert") for e in range(experts))),
    )


def dense_block(i: int, *, core_flops: float = 1e11) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="d", param_count=10**9, forward_flops=1e12, backward_flops=2e12,
        saved_bytes_no_recompute=GiB, saved_bytes_full_recompute=OUT, output_bytes=OUT, hidden_size=4096,
        attention_heads=32, kv_heads=8, selective_recompute_flops=core_flops, saved_bytes_selective=GiB // 2,
    )


MOE = [moe_block(i) for i in range(4)]
TRAINING = TrainingConfig(global_batch=64, seq_len=2048)


# ----------------------------------------------------------------------------------------------- conventions


def test_ep_is_carved_out_of_dp_and_adds_no_ranks():
    s = Strategy.parse("dp=16,tp=2,cp=2,ep=8,zero=1")
    assert s.world_size == 16 * 2 * 2 and s.expert_dp == 2
    assert Strategy.parse(s.to_string()) == s and "cp=2" in s.to_string() and "ep=8" in s.to_string()
    with pytest.raises(ConfigError, match="ep=4 must divide dp=2"):
        Strategy.parse("dp=2,ep=4")


def test_weight_groups_follow_the_layout_tp_cp_ep_pp_edp():
    # Dense weights: cp*ep contiguous ranks tp apart, then edp = dp/ep at stride tp*cp*ep*pp.
    s = Strategy(dp=4, tp=2, cp=2, ep=2, pp=3)
    assert dense_group(s) == ((4, 2), (2, 24))
    assert expert_group(s) == ((2, 2), (2, 24))
    # Without ep or cp it is the plain dp axis at stride tp*pp.
    assert dense_group(Strategy(dp=8, tp=2, pp=2)) == ((8, 4),)
    assert expert_group(Strategy(dp=8, ep=8)) == ()  # every expert lives once: nothing to reduce


def test_a_group_on_two_axes_reduces_hierarchically():
    c, n = cluster(4), 8 * GiB
    axes = ((2, 1), (4, 8))  # 2 ranks in a node, then 4 nodes
    expected = (reduce_scatter_time(c, n, group_size=2) + all_gather_time(c, n, group_size=2)
                + all_reduce_time(c, n / 2, group_size=4, stride=8))
    assert group_all_reduce_s(c, n, axes) == pytest.approx(expected)
    assert group_all_reduce_s(c, n, ((8, 4),)) == pytest.approx(all_reduce_time(c, n, group_size=8, stride=4))


# ----------------------------------------------------------------------------------------------- expert parallelism


def test_expert_parameters_divide_by_ep_dense_ones_do_not():
    totals = stage_totals(MOE, 0, {})
    dense, expert = local_param_split(totals, Strategy(dp=8, tp=2, ep=4))
    assert dense == pytest.approx(4 * DENSE_PARAMS / 2) and expert == pytest.approx(4 * EXPERT_PARAMS / 8)


def test_all_to_all_inside_a_node():
    # ep=8, tp=1: one NVLink phase; each of the 4 a2a per layer (dispatch+combine, fwd+bwd) moves
    # N = mbs * s * k * f * h * B = 2 * 2 * OUT bytes per device, 7/8 of it to peers.
    s = Strategy(dp=8, ep=8, micro_batch=2)
    n = 2 * 2 * 1.0 * OUT
    per_a2a = 7 / 8 * n / NODE_BW
    assert ep_comm_s(stage_totals(MOE, 0, {}), cluster(1), s) == pytest.approx(4 * 4 * per_a2a)


def test_all_to_all_across_nodes_is_bound_by_the_network():
    # tp=2 puts the 8 ep ranks 2 apart: 4 per node over 2 nodes. Peers: 3 on NVLink, 4 across the network;
    # the slower share dominates: 4/8 * N / 10 GB/s, with N halved by tp (each tp rank sends 1/tp of the tokens).
    s = Strategy(dp=8, tp=2, ep=8, micro_batch=1)
    n = 1 * 2 * 1.0 * OUT / 2
    per_a2a = max(3 / 8 * n / NODE_BW, 4 / 8 * n / NET_BW)
    assert ep_comm_s(stage_totals(MOE, 0, {}), cluster(2), s) == pytest.approx(4 * 4 * per_a2a)


def test_a_per_node_dispatch_sends_a_token_once_to_each_other_node_holding_one_of_its_experts():
    # The same 8 ranks over 2 nodes, 4 of the 8 experts on each: a token's 2 experts both sit on its own node with
    # probability C(4, 2) / C(8, 2) = 6/28, so it crosses once with probability 22/28, where a copy per expert crosses
    # 2 * 1/2 = 1 time on average. NVLink carries the copies for the node's 3 other members, those that came from the
    # other node included: 3/4 of N where a copy per expert sends it 3/8.
    s = Strategy(dp=8, tp=2, ep=8, micro_batch=1)
    totals = stage_totals(MOE, 0, {})
    assert per_node_share(totals, cluster(2), s) == pytest.approx(22 / 28)
    n = 1 * 2 * 1.0 * OUT / 2
    per_a2a = max(3 / 4 * n / NODE_BW, 22 / 28 * 4 / 8 * n / NET_BW)
    assert ep_comm_s(totals, cluster(2), s, dispatch="per-node") == pytest.approx(4 * 4 * per_a2a)
    # Peers a node apart (tp 8): no NVLink level in the group, its only level thinned all the same
    apart = Strategy(dp=2, tp=8, ep=2, micro_batch=1)
    share = per_node_share(totals, cluster(2), apart)
    assert share == pytest.approx(22 / 28)  # as above: 2 nodes of 4 experts, one remote copy per token on average
    m = 1 * 2 * 1.0 * OUT / 8
    thinned = 4 * 4 * share * 1 / 2 * m / NET_BW
    assert ep_comm_s(totals, cluster(2), apart, dispatch="per-node") == pytest.approx(thinned)
    assert ep_comm_s(totals, cluster(2), apart) == pytest.approx(4 * 4 * 1 / 2 * m / NET_BW)
    inside = Strategy(dp=8, ep=8)  # one node: nothing to spare
    assert per_node_share(totals, cluster(1), inside) == 1.0
    assert ep_comm_s(totals, cluster(1), inside, dispatch="per-node") == ep_comm_s(totals, cluster(1), inside)
    with pytest.raises(ConfigError, match="ep_dispatch='per-token' is not one of per-expert, per-node"):
        replace(TESSERA, ep_dispatch="per-token")


def test_consecutive_routing_sends_a_token_to_the_nodes_its_neighbouring_experts_span():
    # MOE's 8 experts over 2 nodes, 2 a token: a token's two consecutive experts (2t, 2t + 1) always share a node, so a
    # per-node dispatch sends it once, with probability 1/2 across, against a copy per expert's 2 x 1/2: share 1/2
    s = Strategy(dp=8, tp=2, ep=8, micro_batch=1)
    totals = stage_totals(MOE, 0, {})
    assert per_node_share(totals, cluster(2), s, routing="consecutive") == pytest.approx(1 / 2)
    assert ep_comm_s(totals, cluster(2), s, dispatch="per-node", routing="consecutive") < ep_comm_s(
        totals, cluster(2), s, dispatch="per-node")
    assert ep_comm_s(totals, cluster(2), s, routing="consecutive") == ep_comm_s(totals, cluster(2), s)  # per expert
    with pytest.raises(ConfigError, match="ep_routing='random' is not one of uniform, consecutive"):
        replace(TESSERA, ep_routing="random")


def test_all_to_alls_beside_another_micro_batch_expose_what_its_compute_does_not_cover():
    # The forward's half beside the partner's backward, the backward's half beside its forward
    assert exposed_ep_comm_s(3.0, 5.0, 10.0, contention=0.2) == pytest.approx(0.6)  # hidden, the compute 20% slower
    assert exposed_ep_comm_s(10.0, 2.0, 4.0, contention=0.2) == pytest.approx(10 - 6 + 0.2 * 6)
    assert exposed_ep_comm_s(6.0, 1.0, 5.0, contention=0.0) == pytest.approx(2.0)  # covered in sum, not by direction
    assert exposed_ep_comm_s(3.0, 5.0, 10.0, contention=0.2, unpartnered=0.25) == pytest.approx(0.75 * 0.6 + 0.25 * 3.0)
    # 1F1B's warm-up forwards and cool-down backwards, pp micro-batches' worth, have no partner
    assert unpartnered_share(Strategy(dp=2, pp=4, ep=2), 16) == 0.25
    assert unpartnered_share(Strategy(dp=2, pp=4, ep=2), 2) == unpartnered_share(Strategy(dp=8, ep=8), 1) == 1.0
    s = Strategy(dp=16, tp=2, ep=8, micro_batch=1)
    training = TrainingConfig(global_batch=64, seq_len=2048)
    calibration = replace(FLAT, overlap_contention=0.25)
    stage = stage_totals(MOE, 0, {})
    in_line = stage_time(stage, cluster(4), training, s, calibration=calibration)
    beside = stage_time(stage, cluster(4), training, s, calibration=calibration, profile=replace(TESSERA, ep_overlap=True))
    assert beside.ep_comm_total == in_line.ep_comm_total == in_line.ep_comm > 0
    assert beside.ep_comm == pytest.approx(exposed_ep_comm_s(
        in_line.ep_comm, in_line.forward, in_line.backward + in_line.recompute, contention=0.25,
        unpartnered=1 / 4))  # 4 micro-batches, pp 1
    assert beside.ep_comm < in_line.ep_comm
    # Reports split the exposed time by kind: the all-to-alls by what stays exposed, the rest data-parallel
    whole = estimate(MOE, cluster(4), training, s, calibration=calibration, profile=replace(TESSERA, ep_overlap=True))
    by_kind = exposed_comm_by_kind(whole)
    assert by_kind["ep_alltoall"] == pytest.approx(whole.micro_batches * beside.ep_comm, rel=1e-6)
    assert by_kind["ep_alltoall"] < whole.comm_time_by_kind_s["ep_alltoall"]
    assert sum(by_kind.values()) == pytest.approx(whole.exposed_comm_time_s)


def test_folding_experts_into_the_tp_axis_keeps_the_all_to_all_on_nvlink():
    # etp=1 < tp=2 (Megatron's "MoE parallel folding"): the 8 ep ranks are contiguous (1 apart), one node of the
    # 2, where unfolded (etp = tp) they are 2 apart over both nodes. Each device still sends its 1/tp of the tokens.
    folded, unfolded = Strategy(dp=8, tp=2, ep=8, etp=1, sp=True), Strategy(dp=8, tp=2, ep=8)
    n = 1 * 2 * 1.0 * OUT / 2
    totals = stage_totals(MOE, 0, {})
    assert ep_comm_s(totals, cluster(2), folded) == pytest.approx(4 * 4 * 7 / 8 * n / NODE_BW)
    # without sp every tp rank holds all tokens: each layer all-reduces its output (forward) and input gradient
    replicated = folded.model_copy(update={"sp": False})
    combine = all_reduce_time(cluster(2), totals.boundary_bytes, group_size=2)
    assert combine > 0 and ep_comm_s(totals, cluster(2), replicated) == pytest.approx(
        ep_comm_s(totals, cluster(2), folded) + 2 * 4 * combine)
    assert ep_comm_s(totals, cluster(2), unfolded) == pytest.approx(4 * 4 * max(3 / 8 * n / NODE_BW, 4 / 8 * n / NET_BW))
    # whole experts (etp=1): each device holds E/ep of them at full width, each shard on dp*tp/(etp*ep) = 2 ranks
    assert local_param_split(totals, folded)[1] == pytest.approx(4 * EXPERT_PARAMS / 8)
    assert local_param_split(totals, unfolded)[1] == pytest.approx(4 * EXPERT_PARAMS / 16)
    assert folded.expert_dp == 2 and expert_group(folded) == ((2, 8),)


def test_capacity_factor_and_full_recompute_scale_the_all_to_all():
    s, c = Strategy(dp=8, ep=8), cluster(1)
    base = ep_comm_s(stage_totals(MOE, 0, {}), c, s)
    busier = [moe_block(i, factor=1.25) for i in range(4)]
    assert ep_comm_s(stage_totals(busier, 0, {}), c, s) == pytest.approx(1.25 * base)
    full = stage_totals(MOE, 0, {b.fqn: "full" for b in MOE})
    assert ep_comm_s(full, c, s) == pytest.approx(6 / 4 * base)  # the forward pair runs again


def test_expert_state_shards_over_the_smaller_group():
    # dp=8, ep=4, ZeRO-1: dense Adam moments over 8 ranks, expert ones over dp/ep = 2 ranks.
    e = estimate(MOE, cluster(1), TRAINING, Strategy.parse("dp=8,ep=4,zero=1,mbs=1"), calibration=FLAT)
    dense, expert = 4 * DENSE_PARAMS, 4 * EXPERT_PARAMS / 4
    # FSDP2 (ZeRO-1) shards the fp32 masters like the moments and keeps the gathered bf16 copy through the backward.
    assert e.memory_by_category_bytes["parameters"] == int((dense / 8 + expert / 2) * 4 + (dense + expert) * 2)
    assert e.memory_by_category_bytes["optimizer"] == int((dense / 8 + expert / 2) * 8)
    assert e.comm_time_by_kind_s["ep_alltoall"] > 0


def test_expert_gradients_reduce_over_fewer_ranks():
    c = cluster(2)
    plain = estimate(MOE, c, TRAINING, Strategy.parse("dp=16,zero=0,mbs=1,recompute=full"), calibration=FLAT)
    expert = estimate(MOE, c, TRAINING, Strategy.parse("dp=16,ep=8,zero=0,mbs=1,recompute=full"), calibration=FLAT)
    # Dense: 16 ranks (8 in a node x 2 nodes); experts: 1/8 of them per device, over edp=2 ranks across nodes.
    dense_bytes, expert_bytes = 4 * DENSE_PARAMS * 4, 4 * EXPERT_PARAMS / 8 * 4
    expected = (group_all_reduce_s(c, dense_bytes, ((8, 1), (2, 8))) + all_reduce_time(c, expert_bytes, group_size=2, stride=8))
    assert expert.comm_time_by_kind_s["dp_allreduce"] == pytest.approx(expected)
    assert expert.comm_time_by_kind_s["dp_allreduce"] < plain.comm_time_by_kind_s["dp_allreduce"]


def test_expert_pairs_share_one_tensor_parallel_reduction():
    totals = stage_totals(MOE[:1], 0, {})
    assert totals.tp_allreduce_count == 2 and totals.tp_allreduce_bytes == 2 * OUT  # attention + experts


def test_ep_needs_experts_it_divides():
    with pytest.raises(ConfigError, match="ep=2 needs a model with routed experts"):
        estimate([dense_block(0)], cluster(1), TRAINING, Strategy.parse("dp=8,ep=2"))
    odd = [moe_block(0, experts=6)]
    with pytest.raises(ConfigError, match="does not divide the experts"):
        estimate(odd, cluster(1), TRAINING, Strategy.parse("dp=8,ep=4"))


# ----------------------------------------------------------------------------------------------- context parallelism


def test_ring_exchange_and_its_overlap_with_attention():
    # cp=4 inside a node (tp=1). K+V per sequence: 2 * OUT * kv_heads/heads = OUT/2; per rank and ring step
    # OUT/2/4 bytes. Forward: 3 steps of p2p(OUT/8); backward: 3 of p2p(OUT/4) (K/V and their gradients).
    # Each step hides behind core/(cp^2 tp) attention FLOPs forward, 2.5x that backward.
    layers = [dense_block(i, core_flops=4e10) for i in range(2)]
    s, c = Strategy(dp=2, cp=4), cluster(1)
    fwd, bwd = OUT / 8 / NODE_BW, OUT / 4 / NODE_BW
    attention = 4e10 / 16 / (989e12 * 0.5)
    total, exposed = cp_comm_s(stage_totals(layers, 0, {}), c, s, flops_per_s=989e12 * 0.5)
    assert total == pytest.approx(2 * 3 * (fwd + bwd))
    assert exposed == pytest.approx(2 * 3 * (max(0, fwd - attention) + max(0, bwd - 2.5 * attention)))
    assert 0 < exposed < total
    # Long enough attention hides the ring entirely.
    long = [dense_block(i, core_flops=1e14) for i in range(2)]
    assert cp_comm_s(stage_totals(long, 0, {}), c, s, flops_per_s=989e12 * 0.5)[1] == 0


def test_pytorch_all_gather_rotation_of_repeated_kv_as_torchtitan_ran_it():
    # torchtitan in 2024: K/V repeated to all 32 query heads (2 * OUT per sequence, OUT/2 per rank of cp=4) and
    # all-gathered per layer into a 2 * OUT buffer, once forward and once backward, each hidden by one block's
    # attention only; the fp32 dK/dV (2 * OUT/2 bytes) go one ring step after each of the 4 blocks, the last one
    # hidden by nothing.
    from tessera.cost_models.profiles import TORCHTITAN, TORCHTITAN_2024
    from tessera.cost_models.sparse import ring_and_dispatch_buffer_bytes
    s, c = Strategy(dp=2, cp=4), cluster(1)
    gather, gradients = all_gather_time(c, 2 * OUT, group_size=4), OUT / NODE_BW
    assert gather == pytest.approx(3 / 4 * 2 * OUT / NODE_BW)
    short = stage_totals([dense_block(i, core_flops=1e3) for i in range(2)], 0, {})
    total, exposed = cp_comm_s(short, c, s, flops_per_s=1e15, profile=TORCHTITAN_2024)
    assert total == pytest.approx(2 * (2 * gather + 4 * gradients)) and exposed == pytest.approx(total)
    long = stage_totals([dense_block(i, core_flops=1e14) for i in range(2)], 0, {})
    assert cp_comm_s(long, c, s, flops_per_s=1e15, profile=TORCHTITAN_2024)[1] == pytest.approx(2 * gradients)
    # Its buffers: the gathered sequence (4 blocks of OUT/2), three fp32 dK/dV-sized ones and the fp32 dQ (a query
    # shard, OUT/4, in fp32); the ring's: K/V blocks of OUT/8 sent and received, their fp32 gradients, the fp32 dQ.
    assert ring_and_dispatch_buffer_bytes(short, s, TORCHTITAN_2024) == pytest.approx((4 + 3 * 2) * OUT / 2 + 2 * OUT / 4)
    assert ring_and_dispatch_buffer_bytes(short, s) == pytest.approx((2 + 2 * 2) * OUT / 8 + 2 * OUT / 4)
    # Today's torchtitan passes the 8 grouped K/V heads (enable_gqa): a quarter of the bytes, gathered the same way.
    grouped = cp_comm_s(short, c, s, flops_per_s=1e15, profile=TORCHTITAN)[0]
    assert grouped == pytest.approx(total / 4)


def test_torchtitans_selective_blocks_keep_the_attention_and_do_not_gather_again():
    from tessera.cost_models.profiles import TORCHTITAN
    layers, s, c = [dense_block(i) for i in range(2)], Strategy(dp=2, cp=4), cluster(1)
    def total(policy):
        return cp_comm_s(stage_totals(layers, 0, {b.fqn: policy for b in layers}), c, s, flops_per_s=1e15,
                         profile=TORCHTITAN)[0]
    gather = all_gather_time(c, 4 * OUT / 8, group_size=4)  # grouped K/V: OUT/8 per rank, gathered from 4
    assert total("selective") == pytest.approx(total("none"))  # op-level: the SDPA output is kept
    assert total("full") - total("none") == pytest.approx(2 * gather)


def test_an_unknown_cp_rotation_is_refused_by_name():
    from tessera.cost_models.profiles import ImplementationProfile
    with pytest.raises(ConfigError, match="cp_rotation='alltoall' is not one of ring, allgather"):
        ImplementationProfile(name="x", cp_rotation="alltoall")


def test_the_ring_hides_behind_its_attention_at_the_slowed_rate():
    # the ring's steps hide behind the attention as it is priced: slower under cp_attention_slowdown, so less shows
    layers = [dense_block(i, core_flops=4e10) for i in range(2)]
    training, s, c = TrainingConfig(global_batch=8, seq_len=4096), Strategy.parse("dp=2,cp=4,mbs=1"), cluster(1)
    stage = stage_totals(layers, 0, {})
    plain = stage_time(stage, c, training, s, calibration=FLAT)
    slowed = stage_time(stage, c, training, s, calibration=replace(FLAT, cp_attention_slowdown=2.0))
    rate = attention_core_rate(c.device, training, 0.0, calibration=FLAT, kernels=TESSERA.kernels_at(s.cp),
                               seq_len=1024)  # unsplit, at each rank's 1024 tokens, on the ring's own kernel
    assert plain.cp_comm == pytest.approx(cp_comm_s(stage, c, s, flops_per_s=rate)[1])
    assert slowed.cp_comm == pytest.approx(cp_comm_s(stage, c, s, flops_per_s=rate / 2)[1])
    assert 0 <= slowed.cp_comm < plain.cp_comm


def test_recomputed_attention_reruns_the_forward_ring():
    layers = [dense_block(i) for i in range(2)]
    s, c = Strategy(dp=2, cp=4), cluster(1)
    plain = cp_comm_s(stage_totals(layers, 0, {}), c, s, flops_per_s=1e15)[0]
    selective = cp_comm_s(stage_totals(layers, 0, {b.fqn: "selective" for b in layers}), c, s, flops_per_s=1e15)[0]
    fwd, bwd = OUT / 8 / NODE_BW, OUT / 4 / NODE_BW
    assert selective - plain == pytest.approx(2 * 3 * fwd)
    assert plain == pytest.approx(2 * 3 * (fwd + bwd))


def test_cp_divides_activations_and_adds_ring_time_to_the_step():
    layers = [dense_block(i) for i in range(2)]
    training = TrainingConfig(global_batch=8, seq_len=4096)
    one = estimate(layers, cluster(1), training, Strategy.parse("dp=8,mbs=1"), calibration=FLAT)
    four = estimate(layers, cluster(1), training, Strategy.parse("dp=2,cp=4,mbs=1"), calibration=FLAT)
    assert four.memory_by_category_bytes["activations"] == pytest.approx(one.memory_by_category_bytes["activations"] / 4, rel=1e-6)
    assert four.comm_time_by_kind_s["cp_ring"] > 0
    t = stage_time(stage_totals(layers, 0, {}), cluster(1), training, Strategy.parse("dp=2,cp=4,mbs=1"), calibration=FLAT)
    assert t.total == pytest.approx(t.forward + t.backward + t.recompute + t.tp_comm + t.pp_comm + t.cp_comm)


def test_cp_gradients_reduce_over_dp_times_cp():
    layers = [dense_block(i) for i in range(2)]
    c, training = cluster(1), TrainingConfig(global_batch=8, seq_len=4096)
    e = estimate(layers, c, training, Strategy.parse("dp=2,cp=4,zero=0,mbs=1"), calibration=FLAT)
    grads = 2 * 10**9 * 4
    assert e.comm_time_by_kind_s["dp_allreduce"] == pytest.approx(group_all_reduce_s(c, grads, ((4, 1), (2, 4))))
    z1 = estimate(layers, c, training, Strategy.parse("dp=2,cp=4,zero=1,mbs=1"), calibration=FLAT)
    assert z1.memory_by_category_bytes["optimizer"] == int(2 * 10**9 * 8 / 8)  # moments over dp*cp = 8 ranks


def test_zigzag_needs_2cp_to_divide_the_sequence():
    with pytest.raises(ConfigError, match="2\\*cp = 8 zig-zag chunks"):
        estimate([dense_block(0)], cluster(1), TrainingConfig(global_batch=2, seq_len=100), Strategy.parse("dp=2,cp=4"))


# ----------------------------------------------------------------------------------------------- search space


def test_space_tries_ep_only_for_moe_models_and_cp_only_for_long_sequences():
    c = cluster(2)
    shapes = set(mesh_shapes(MOE, c, TRAINING, {}))
    assert {ep for *_, ep in shapes} == {1, 2, 4, 8} and {cp for _, _, _, cp, _ in shapes} == {1}
    # ep is carved out of dp, or, folded (etp=1 < tp, planner.space), out of the dp x tp ranks
    assert all(dp % ep == 0 or tp > 1 and (dp * tp) % ep == 0 for dp, tp, _, _, ep in shapes)
    dense = [dense_block(i) for i in range(4)]
    assert {ep for *_, ep in mesh_shapes(dense, c, TRAINING, {})} == {1}
    long = TrainingConfig(global_batch=16, seq_len=LONG_CONTEXT_TOKENS)
    cps = {cp for _, _, _, cp, _ in mesh_shapes(dense, c, long, {})}
    assert cps == {1, 2, 4, 8}  # every rank keeps >= 2048 tokens: 16384 / 8
    assert {(cp, ep) for _, _, _, cp, ep in mesh_shapes(MOE, c, TRAINING, {"ep": 4, "cp": 2})} == {(2, 4)}


def test_zero_shards_over_the_cp_ranks_when_there_is_no_dp():
    """The dp * cp ranks hold the same weights (runtime.mesh.data_mesh), so ZeRO has ranks to shard over with dp=1:
    the space offers every stage there (long context on a few GPUs, torchtitan's FSDP 1 x CP 8), and a pin of zero
    counts as sharding there too."""
    from tessera.planner.space import check_runtime_pins, strategies

    dense = [dense_block(i) for i in range(4)]
    long = TrainingConfig(global_batch=2, seq_len=LONG_CONTEXT_TOKENS)
    zeros = {s.zero for s in strategies(dense, cluster(1), long, {"dp": 1, "cp": 8, "recompute": "full", "micro_batch": 1})}
    assert zeros == {0, 1, 2, 3}
    assert {s.zero for s in strategies(dense, cluster(1), long, {"dp": 1, "cp": 1, "tp": 8, "micro_batch": 1})} == {0}
    with pytest.raises(ConfigError, match="zero"):
        check_runtime_pins({"dp": 1, "cp": 8, "zero": 3}, {"zero": "the model's weights cannot be sharded"})
    # and a baseline none of whose completions fits is shown at its leanest: ZeRO-3 over the cp ranks
    from tessera.planner.compare import leanest_completion

    leanest, _ = leanest_completion(dense, cluster(1), long, {"cp": 8})
    assert (leanest.dp, leanest.cp, leanest.zero) == (1, 8, 3)
    assert leanest_completion(dense, cluster(1), long, {"tp": 8})[0].zero == 0


def test_another_frameworks_run_may_combine_what_tesseras_runtime_does_not():
    """cp with pp and sp (torchtitan's 4D runs): out of Tessera's own space, in the space of a run another framework
    made (``exclusive=()``, how benchmarks/published.py evaluates published runs)."""
    from tessera.planner.space import strategies

    dense = [dense_block(i) for i in range(4)]
    long = TrainingConfig(global_batch=4, seq_len=LONG_CONTEXT_TOKENS)
    pins = {"tp": 2, "pp": 2, "cp": 2, "zero": 3, "micro_batch": 1, "recompute": "full", "schedule": "1f1b"}
    assert list(strategies(dense, cluster(1), long, pins)) == []
    (run,) = strategies(dense, cluster(1), long, pins, exclusive=())
    assert (run.cp, run.pp, run.sp) == (2, 2, True)


def test_plan_explains_its_expert_degree_with_the_best_plan_at_every_other():
    from tessera.planner.layer_graph import LayerGraph
    from tessera.planner.search import search

    graph = LayerGraph(model_name="moe", seq_len=2048, dtype="bf16", front_end="fx", layers=tuple(MOE), edges=())
    plan = search(graph, cluster(2), TRAINING)
    others = {c.strategy.ep: c for c in plan.degree_alternatives}
    # Degrees the bound-ordered search reached are listed; "without expert parallelism" always is.
    assert plan.strategy.ep not in others and set(others) <= {1, 2, 4, 8} and (plan.strategy.ep == 1 or 1 in others)
    for ep, candidate in others.items():
        assert candidate.verdict.startswith(f"ep={ep}: ")
        if candidate.estimate.fits:
            assert candidate.estimate.step_time_s >= plan.estimate.step_time_s


def test_runtime_refusal_names_what_the_runtime_would_refuse():
    """One predicate for the search and for comparing a published configuration on Tessera's runtime."""
    t = TrainingConfig(global_batch=8, seq_len=4096)
    assert runtime_refusal(Strategy.parse("dp=2,tp=4,zero=1,mbs=1,sp=true"), t) is None
    assert runtime_refusal(Strategy.parse("dp=2,tp=2,cp=2,zero=1,mbs=1,sp=true"), t) == "it refuses cp with sp"
    assert runtime_refusal(Strategy.parse("dp=2,tp=4,ep=4,etp=2,mbs=1"), t) == "it cannot fold these experts"
    assert runtime_refusal(Strategy.parse("dp=2,tp=4,mbs=1"), t, {"tp": "no splittable linears"}) == (
        "tp is unavailable for the model")


def test_narrow_experts_run_at_the_curves_rate_for_their_own_width():
    """An expert narrower than the hidden size over tp runs its matmuls at the efficiency curve's rate for its own
    width over etp (the narrow side of its GEMMs), the rest of the block at the hidden width's; a wider expert, or
    FP8 on a curve flat in width, changes nothing."""
    from tessera.cost_models.compute import stage_compute_s

    curve = Calibration(peak_fraction=0.8, half_width=512.0, traffic_factor=0.0, fp8_peak_fraction=0.7)
    device, strategy = cluster(1).device, Strategy.parse("dp=8,ep=8,mbs=1")

    def forward_s(width: int, training: TrainingConfig = TRAINING, s: Strategy = strategy) -> float:
        stage = stage_totals([moe_block(0).model_copy(update={"expert_width": width})], 0, {"blocks.0": "none"})
        return stage_compute_s(stage, device, training, s, calibration=curve, profile=TESSERA)[0]

    dense_rate = device.peak_flops("bf16") * curve.at(4096)
    slower = 5e11 * (curve.at(4096) / curve.at(1024) - 1) / dense_rate  # the experts' forward FLOPs, priced again
    assert forward_s(1024) - forward_s(0) == pytest.approx(slower)
    assert forward_s(8192) == forward_s(0)  # not narrower than the hidden size: the block's rate
    etp2 = Strategy.parse("dp=4,tp=2,ep=4,mbs=1")  # experts split over tp: half as wide on each rank
    assert forward_s(2048, s=etp2) - forward_s(0, s=etp2) == pytest.approx(
        5e11 * (curve.at(2048) / curve.at(1024) - 1) / (device.peak_flops("bf16") * curve.at(2048)) / 2)
    fp8 = TrainingConfig(global_batch=64, seq_len=2048, precision="fp8")
    assert forward_s(1024, fp8) == forward_s(0, fp8)  # this FP8 curve is flat in width


def test_a_moe_estimate_on_a_gpu_says_the_hosts_time_is_not_priced():
    """Routed experts on a GPU: a note says the host's time (the dispatcher's sync, the small expert kernels) is not
    priced; a dense model's estimate, and one on this machine's CPU (whose per-linear host time is profiled), say
    nothing of it."""
    s = Strategy.parse("dp=8,ep=8,zero=1,mbs=1")
    moe = estimate(MOE, cluster(1), TRAINING, s, calibration=FLAT, profile=TESSERA)
    assert any(note.startswith("mixture of experts: the host's (CPU's) time is not priced") for note in moe.notes)
    dense = estimate([dense_block(i) for i in range(4)], cluster(1), TRAINING, Strategy.parse("dp=8,zero=1,mbs=1"),
                     calibration=FLAT, profile=TESSERA)
    assert not any(note.startswith("mixture of experts") for note in dense.notes)
    cpu = estimate(MOE, load_cluster("cpu:ranks=2"), TrainingConfig(global_batch=4, seq_len=64),
                   Strategy.parse("dp=2,ep=2,zero=1,mbs=1"), calibration=FLAT, profile=TESSERA)
    assert not any(note.startswith("mixture of experts") for note in cpu.notes)


def test_pytorchs_multi_chunk_schedules_get_only_micro_batch_counts_they_run():
    """torch's interleaved and zero-bubble schedules run ``m`` micro-batches in ``max(1, m // pp)`` rounds, and
    only a multiple of them: 13 on pp=2 (6 rounds) is refused, so the space of Tessera's runtime leaves it out,
    and a run another framework made keeps it."""
    from tessera.planner.space import schedule_refusal, strategies

    thirteen = TrainingConfig(global_batch=13, seq_len=2048)
    interleaved = Strategy.parse("dp=1,pp=2,mbs=1,schedule=interleaved:2")
    assert schedule_refusal(interleaved, thirteen) == ("its interleaved schedule runs a step's micro-batches in 6 rounds "
                                                       "and needs a multiple of 6; 13 is not")
    assert schedule_refusal(interleaved, TrainingConfig(global_batch=12, seq_len=2048)) is None
    assert schedule_refusal(Strategy.parse("dp=1,pp=2,mbs=1,schedule=1f1b"), thirteen) is None
    dense = [dense_block(i) for i in range(4)]
    pins = {"dp": 1, "pp": 2, "micro_batch": 1, "schedule": "interleaved", "virtual_stages": 2}
    assert not list(strategies(dense, cluster(1), thirteen, pins))
    assert list(strategies(dense, cluster(1), thirteen, pins, exclusive=()))


def test_pinned_expert_parallelism_says_why_it_cannot_apply():
    from tessera.planner.space import check_expert_pins

    with pytest.raises(ConfigError, match="ep=3 must divide the experts of every MoE layer \\(8\\)"):
        check_expert_pins({"ep": 3}, {8})
    with pytest.raises(ConfigError, match="this model has no mixture-of-experts layer"):
        check_expert_pins({"ep": 2}, set())
    with pytest.raises(ConfigError, match="etp splits routed experts"):
        check_expert_pins({"etp": 1}, set())
    check_expert_pins({"ep": 4}, {8})


def test_groups_that_do_not_tile_nodes_are_priced_across_them():
    """Groups of 2 on nodes of 3 (ranks 2 and 3) straddle two nodes; groups of 2 or 4 on nodes of 8 do not, nor
    does one node-sized group."""
    three = load_cluster("dgx-a100:nodes=2,gpus_per_node=3")
    assert three.level_spanned(2).name == three.levels[1].name
    assert three.level_spanned(3).name == three.levels[0].name
    eight = load_cluster("dgx-h100:nodes=4")
    assert eight.level_spanned(2, stride=4).name == eight.level_spanned(8).name == "nvlink"
    assert eight.level_spanned(2, stride=8).name == "infiniband"
    from tessera.planner.plan_facts import mesh_layout

    assert mesh_layout(Strategy.parse("dp=3,pp=2"), devices_per_node=3) == [
        "pp=2 in groups that straddle node boundaries (priced across nodes)", "dp=3 across 2 nodes"]
