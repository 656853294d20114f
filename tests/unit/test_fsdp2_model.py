"""Sharded data parallelism per framework (``cost_models.profiles``) and stragglers, on hand-made LayerStats."""

import itertools
import math
from dataclasses import replace

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.communication import exposed_dp_comm_s, tp_comm_s
from tessera.cost_models.memory import sp_gathered_input_bytes
from tessera.cost_models.partition import stage_totals
from tessera.cost_models.stage_views import as_selective_memory
from tessera.cost_models.compute import Calibration, compute_lower_bound_s, optimizer_step_s
from tessera.cost_models.profiles import (
    DEEPSPEED, MEGATRON, PROFILES, PYTORCH_FSDP_TE, TESSERA, TORCHTITAN, ImplementationProfile, profile,
)
from tessera.cost_models.layer_stats import LayerStats
from tessera.errors import ConfigError
from tessera.topology import load_cluster

GiB = 2**30
FLAT = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0)


def block(i: int, *, flops: float = 1e13) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="b", param_count=10**9, forward_flops=flops, backward_flops=2 * flops,
        saved_bytes_no_recompute=2 * GiB, saved_bytes_full_recompute=GiB // 16, output_bytes=GiB // 16, hidden_size=8192,
        attention_heads=64, kv_heads=8,
    )


def run(strategy: str, *, nodes: int = 2, flops: float = 1e13, calibration=FLAT, framework=TESSERA, batch: int = 32):
    layers = [block(i, flops=flops) for i in range(4)]
    training = TrainingConfig(global_batch=batch, seq_len=4096)
    return estimate(layers, load_cluster(f"dgx-h100:nodes={nodes}"), training, Strategy.parse(strategy),
                    calibration=calibration, profile=framework)


def test_deepspeed_zero3_collectives_take_its_profiles_slowdown():
    fsdp, deepspeed = run("dp=16,zero=3,mbs=2"), run("dp=16,zero=3,mbs=2", framework=DEEPSPEED)
    for kind in ("fsdp_allgather", "fsdp_reducescatter"):
        assert deepspeed.comm_time_by_kind_s[kind] == pytest.approx(DEEPSPEED.zero3_comm_slowdown * fsdp.comm_time_by_kind_s[kind])
    assert deepspeed.step_time_s > fsdp.step_time_s
    # ZeRO-1 is no business of the ZeRO-3 profile
    assert run("dp=16,zero=1,mbs=2", framework=DEEPSPEED).step_time_s == pytest.approx(run("dp=16,zero=1,mbs=2").step_time_s)


def test_hidden_collectives_slow_the_compute_beside_them_at_the_rings_speed():
    contended = replace(FLAT, overlap_contention=0.2)
    for framework in (TESSERA, DEEPSPEED):
        plain = run("dp=16,zero=3,mbs=2", framework=framework)
        slowed = run("dp=16,zero=3,mbs=2", framework=framework, calibration=contended)
        hidden = sum(plain.comm_time_by_kind_s.values()) - plain.exposed_comm_time_s
        assert hidden > 0 and plain.contention_time_s == 0.0
        # DeepSpeed's 2021 slowdown is its kernels waiting, not bandwidth they take from the compute
        at_ring_speed = hidden / (DEEPSPEED.zero3_comm_slowdown if framework is DEEPSPEED else 1.0)
        assert slowed.contention_time_s == pytest.approx(0.2 * at_ring_speed)
        assert slowed.step_time_s == pytest.approx(plain.step_time_s + slowed.contention_time_s)
    # a framework that reduces after the backward hides nothing, so nothing slows its compute
    after = replace(TESSERA, dp_overlap=False)
    assert run("dp=16,zero=1,mbs=2", framework=after, calibration=contended).contention_time_s == 0.0


def test_the_data_parallel_floor_bites_and_stays_below_what_the_estimate_charges():
    """``estimate.dp_lower_bound_s`` (the search's pruning): positive where there is data-parallel traffic, never above
    the step's data-parallel part (exposed plus contention), for every ZeRO stage, pipelined or not, blocks keeping
    their gathered weights, bf16 or fp8, compute- or bandwidth-bound, and frameworks that slow the collectives
    (DeepSpeed) or reduce gradients in 2 bytes (NeMo 2024)."""
    from tessera.cost_models.estimate import dp_lower_bound_s
    from tessera.cost_models.partition import block_policies
    from tessera.cost_models.profiles import NEMO_2024

    contended = replace(FLAT, overlap_contention=0.2, fp8_peak_fraction=0.5)
    cluster = load_cluster("dgx-h100:nodes=2")
    specs = ("dp=16,zero=0,mbs=2", "dp=16,zero=1,mbs=2", "dp=16,zero=2,mbs=2", "dp=16,zero=3,mbs=2",
             "dp=16,zero=3,mbs=2,block_reshard=32xfalse", "dp=8,pp=2,zero=1,mbs=1", "dp=8,pp=2,zero=3,mbs=1",
             "dp=8,pp=2,zero=3,mbs=1,block_reshard=32xfalse")
    for spec, precision, flops in itertools.product(specs, ("bf16", "fp8"), (1e14, 1e10)):
        strategy, training = Strategy.parse(spec), TrainingConfig(global_batch=32, seq_len=4096, precision=precision)
        layers = [block(i, flops=flops) for i in range(32)]  # many blocks: little stays exposed, the floor is tight
        floor = dp_lower_bound_s(stage_totals(layers, 0, block_policies(layers, strategy)), cluster, training, strategy,
                                 calibration=contended)
        assert floor > 0, spec
        for framework in (TESSERA, DEEPSPEED, PYTORCH_FSDP_TE, NEMO_2024):
            e = estimate(layers, cluster, training, strategy, calibration=contended, profile=framework)
            slowest = max(e.stage_time_per_micro_batch_s, key=lambda parts: sum(parts.values()))
            others = e.micro_batches * sum(slowest.get(kind, 0.0) for kind in ("tp_comm", "pp_comm", "ep_comm", "cp_comm"))
            dp_part = e.exposed_comm_time_s - others + e.contention_time_s
            assert floor <= dp_part * (1 + 1e-9), (spec, precision, flops, framework.name)


def test_the_stage_with_the_most_data_parallel_traffic_sets_the_step():
    """Pipelined, each stage reduces its own gradients; the step waits for the stage whose exposed traffic plus
    contention is largest (here the later stage, whose blocks hold four times the parameters)."""
    from tessera.cost_models.communication import dp_comm_s
    from tessera.cost_models.estimate import stage_split
    from tessera.cost_models.profiles import MEGATRON_2021

    layers = [block(i) if i < 2 else block(i).model_copy(update={"param_count": 4 * 10**9}) for i in range(4)]
    training, cluster = TrainingConfig(global_batch=32, seq_len=4096), load_cluster("dgx-h100:nodes=2")
    strategy = Strategy.parse("dp=8,pp=2,zero=1,mbs=1")  # Megatron-LM of 2021 reduces after the backward: all exposed
    e = estimate(layers, cluster, training, strategy, calibration=FLAT, profile=MEGATRON_2021)
    traffic = [sum(dp_comm_s(stage, cluster, training, strategy, micro_batches=e.micro_batches,
                             profile=MEGATRON_2021).values()) for stage in stage_split(layers, strategy).stages]
    assert traffic[1] > traffic[0]
    pipeline_sends = e.micro_batches * max(parts["pp_comm"] for parts in e.stage_time_per_micro_batch_s)
    assert e.exposed_comm_time_s - pipeline_sends == pytest.approx(traffic[1], rel=1e-6)


def test_compute_bound_fsdp_exposes_only_the_first_gather_and_last_reduce_scatter():
    e = run("dp=16,zero=3,mbs=2")
    total = e.comm_time_by_kind_s["fsdp_allgather"] + e.comm_time_by_kind_s["fsdp_reducescatter"]
    assert total < e.compute_time_s  # the bytes fit behind the compute
    assert e.exposed_comm_time_s == pytest.approx(total / 4)  # 4 blocks: one block's worth per pass stays exposed


def test_bandwidth_bound_fsdp_exposes_what_compute_cannot_cover_and_recompute_hides_more():
    comm = {"fsdp_allgather": 3.0, "fsdp_reducescatter": 3.0}
    zero3 = Strategy.parse("dp=8,zero=3")
    plain = exposed_dp_comm_s(comm, zero3, forward_s=1.0, backward_s=2.0, micro_batches=1, blocks=4)
    recomputed = exposed_dp_comm_s(comm, zero3, forward_s=1.0, backward_s=2.0, micro_batches=1, blocks=4, recompute_s=1.0)
    assert plain == pytest.approx(6.0 - 3.0) and recomputed == pytest.approx(6.0 - 4.0)
    assert exposed_dp_comm_s(comm, zero3, forward_s=1.0, backward_s=2.0, micro_batches=1, blocks=4, overlap=False) == 6.0


def test_backward_post_prefetch_exposes_every_backward_gather():
    pre, post = run("dp=16,zero=3,mbs=2"), run("dp=16,zero=3,mbs=2", framework=PYTORCH_FSDP_TE)
    gathers = pre.comm_time_by_kind_s["fsdp_allgather"]
    backward = post.comm_time_by_kind_s["fsdp_allgather_backward"]  # one of each micro-batch's two gathers
    assert backward == pytest.approx(gathers / 2)
    assert post.comm_time_by_kind_s["fsdp_allgather"] == pytest.approx(gathers / 2)
    hidden = pre.exposed_comm_time_s  # compute-bound: one block's worth of the rest stays exposed
    rest = gathers / 2 + pre.comm_time_by_kind_s["fsdp_reducescatter"]
    assert post.exposed_comm_time_s == pytest.approx(backward + rest / 4)
    assert hidden < post.exposed_comm_time_s


def test_torchtitan_async_tp_hides_the_forward_collectives_only():
    stage = stage_totals([block(i) for i in range(4)], 0, {})
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=8, seq_len=4096)
    plain = tp_comm_s(stage, cluster, training, Strategy.parse("tp=8,mbs=1"))
    overlapped = Strategy.parse("tp=8,mbs=1,tp_overlap=true")
    assert tp_comm_s(stage, cluster, training, overlapped, profile=MEGATRON) == pytest.approx(plain / 8)
    # forward overlapped (1/8 left), backward not: half the passes at full cost
    assert tp_comm_s(stage, cluster, training, overlapped, profile=TORCHTITAN) == pytest.approx(plain / 2 / 8 + plain / 2)
    # under full recomputation the recomputed forward is overlapped as the forward is; the backward is not
    recomputed = stage_totals([block(i) for i in range(4)], 0, {f"blocks.{i}": "full" for i in range(4)})
    plain = tp_comm_s(recomputed, cluster, training, Strategy.parse("tp=8,mbs=1"))  # three passes
    assert tp_comm_s(recomputed, cluster, training, overlapped, profile=MEGATRON) == pytest.approx(plain / 8)
    assert tp_comm_s(recomputed, cluster, training, overlapped, profile=TORCHTITAN) == pytest.approx(
        2 * plain / 3 / 8 + plain / 3)


def test_stragglers_grow_with_the_number_of_ranks():
    jittery = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0, jitter=0.01)
    steps = {}
    for nodes in (1, 16, 256):
        calm = run(f"dp={8 * nodes},zero=1,mbs=1", nodes=nodes, batch=8 * nodes)
        noisy = run(f"dp={8 * nodes},zero=1,mbs=1", nodes=nodes, batch=8 * nodes, calibration=jittery)
        steps[nodes] = noisy.step_time_s - calm.step_time_s
        compute = calm.compute_time_s + calm.recompute_time_s
        assert steps[nodes] == pytest.approx(compute * 0.01 * math.sqrt(2 * math.log(8 * nodes)), rel=1e-6)
        assert any("stragglers" in note for note in noisy.notes)
    assert steps[1] < steps[16] < steps[256]


def test_single_device_has_no_stragglers():
    jittery = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0, jitter=0.05)
    layers = [block(i) for i in range(2)]
    one = load_cluster("dgx-h100:nodes=1,gpus_per_node=1")
    training = TrainingConfig(global_batch=2, seq_len=4096)
    assert estimate(layers, one, training, Strategy(), calibration=jittery).step_time_s == pytest.approx(
        estimate(layers, one, training, Strategy(), calibration=FLAT).step_time_s)


def test_profiles_by_name_and_a_clear_error_for_an_unknown_one():
    assert profile("deepspeed") is DEEPSPEED and profile("megatron") is MEGATRON and set(PROFILES) >= {"tessera", "torchtitan"}
    with pytest.raises(ConfigError, match="unknown implementation profile 'colossal'; known: tessera"):
        profile("colossal")


def test_zero_collectives_are_priced_per_fully_shard_unit():
    """Each block and the root gather and scatter on their own (``apply_fsdp``): the stage's bytes cost
    ``units`` collectives of ``bytes / units`` each, so their latency counts once per unit."""
    from tessera.cost_models.communication import dp_comm_s, sharded_units
    from tessera.topology.collectives import all_gather_time, reduce_scatter_time

    embedding = LayerStats(fqn="embed", kind="embedding", signature="e", param_count=10**8, forward_flops=0.0,
                           backward_flops=0.0, saved_bytes_no_recompute=0, saved_bytes_full_recompute=0,
                           output_bytes=GiB // 16, hidden_size=8192)
    blocks_only = stage_totals([block(i) for i in range(4)], 0, {})
    with_root = stage_totals([embedding, *(block(i) for i in range(4))], 0, {})
    assert sharded_units(blocks_only) == 4 and sharded_units(with_root) == 5

    cluster, training = load_cluster("dgx-h100:nodes=2"), TrainingConfig(global_batch=32, seq_len=4096)
    strategy = Strategy.parse("dp=16,zero=3,mbs=2")
    comm = dp_comm_s(with_root, cluster, training, strategy, micro_batches=1)
    params, group = with_root.sharded_params + with_root.replicated_params, {"group_size": 16}
    gather = 5 * all_gather_time(cluster, params * 2 / 5, **group)  # bf16 weights, one gather per unit
    scatter = 5 * reduce_scatter_time(cluster, params * 4 / 5, **group)  # fp32 gradients
    assert comm["fsdp_allgather"] == pytest.approx(2 * gather)  # forward and backward gathers of 1 micro-batch
    assert comm["fsdp_reducescatter"] == pytest.approx(scatter)
    assert gather > all_gather_time(cluster, params * 2, **group)  # five latencies, not one


def test_gradients_reduced_in_bf16_hold_and_move_half_the_bytes():
    # NeMo's 2024 recipes reduce gradients in bf16 (profiles.NEMO_2024): the held gradients and the data-parallel
    # gradient collectives are half of fp32's; the parameter all-gathers and everything else are unchanged.
    from dataclasses import replace

    half = replace(MEGATRON, gradient_bytes=2)
    for strategy, collective in (("dp=16,zero=1,mbs=2", "zero_reducescatter"), ("dp=16,zero=0,mbs=2", "dp_allreduce")):
        fp32, bf16 = run(strategy, framework=MEGATRON), run(strategy, framework=half)
        assert bf16.memory_by_category_bytes["gradients"] == pytest.approx(fp32.memory_by_category_bytes["gradients"] / 2, rel=1e-6)
        assert bf16.memory_by_category_bytes["optimizer"] == fp32.memory_by_category_bytes["optimizer"]
        assert bf16.comm_time_by_kind_s[collective] < fp32.comm_time_by_kind_s[collective]
    assert profile("nemo-2024").gradient_bytes == 2 and TESSERA.gradient_bytes == 4


def test_a_bf16_model_trained_as_it_is_holds_half_the_masters_and_moments():
    # NeMo AutoModel's MoE benchmarks train the bf16 model itself with torch.optim.Adam (profiles.AUTOMODEL_MOE): no
    # fp32 master copy, bf16 moments; the gradients and the gathered copies are unchanged.
    bf16_state = replace(TESSERA, master_bytes=2, moment_bytes=2)
    masters = 4 * 10**9 / 16  # four blocks of 1e9 parameters, FSDP2's 1/dp shard
    for strategy in ("dp=16,zero=1,mbs=2", "dp=16,zero=3,mbs=2"):  # both peak as the backward starts
        fp32, bf16 = run(strategy, framework=TESSERA), run(strategy, framework=bf16_state)
        got, want = bf16.memory_by_category_bytes, fp32.memory_by_category_bytes
        assert want["optimizer"] == pytest.approx(masters * 8, rel=1e-6)
        assert got["optimizer"] == pytest.approx(masters * 4, rel=1e-6)
        assert want["parameters"] - got["parameters"] == pytest.approx(masters * 2, rel=1e-6)
        assert got["gradients"] == want["gradients"] and got["activations"] == want["activations"]
    h100 = load_cluster("dgx-h100:nodes=1").device  # the optimizer step reads and writes half the bytes
    assert optimizer_step_s(1e9, h100, master_bytes=2, moment_bytes=2) == pytest.approx(optimizer_step_s(1e9, h100) / 2)
    with pytest.raises(ConfigError, match="master_bytes=3"):
        replace(TESSERA, master_bytes=3)
    assert profile("automodel-moe").master_bytes == profile("automodel-moe").moment_bytes == 2
    assert (profile("automodel").master_bytes, profile("automodel").moment_bytes) == (2, 4)  # FusedAdam's fp32 moments


def test_torchtitan_selective_reruns_every_second_matmul_not_the_attention_core():
    """``recompute=selective`` as torchtitan's op-level policy runs it: the block's every-second-matmul FLOPs at the
    linears' rate (attention kept); Tessera's runtime re-runs the attention core; an old graph without the figure
    keeps the attention-core policy."""
    core, op = 1e12, 3e12

    def layers(measured=True):
        return [block(i).model_copy(update={"selective_recompute_flops": core, "saved_bytes_selective": 2 * GiB,
                                            "op_selective_recompute_flops": op if measured else 0.0,
                                            "saved_bytes_op_selective": GiB // 2 if measured else None})
                for i in range(4)]

    training, strategy = TrainingConfig(global_batch=16, seq_len=4096), Strategy.parse("dp=16,zero=3,mbs=1,recompute=selective")

    def selective(framework, measured=True, calibration=FLAT):
        return estimate(layers(measured), load_cluster("dgx-h100:nodes=2"), training, strategy,
                        calibration=calibration, profile=framework)

    # torchtitan's attention-core rule before op-level measurements, on Tessera's runtime's kernel (cuDNN)
    titan, tessera = selective(TORCHTITAN), selective(TESSERA)
    old = selective(replace(TORCHTITAN, attention_kernels=TESSERA.attention_kernels), measured=False)
    linear_rate = 0.5 * load_cluster("dgx-h100:nodes=1").device.peak_flops("bf16")
    assert titan.recompute_time_s == pytest.approx(4 * op / linear_rate)
    assert old.recompute_time_s == pytest.approx(tessera.recompute_time_s)
    assert tessera.recompute_time_s < titan.recompute_time_s
    assert titan.hardware_flops_per_step - titan.model_flops_per_step == pytest.approx(16 * 4 * op)
    assert tessera.hardware_flops_per_step - tessera.model_flops_per_step == pytest.approx(16 * 4 * core)
    # every block's elementwise work re-runs whole: traffic_factor passes over what it saves unrecomputed
    device = load_cluster("dgx-h100:nodes=1").device
    passes = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=4.0)
    elementwise = 4 * 4.0 * 2 * GiB / device.memory_bandwidth_bytes_per_s
    assert selective(TORCHTITAN, calibration=passes).recompute_time_s == pytest.approx(titan.recompute_time_s + elementwise)
    whole = stage_totals(layers(), 0, {f"blocks.{i}": "selective" for i in range(4)})
    assert compute_lower_bound_s(whole, device, training, strategy, calibration=FLAT) <= titan.compute_time_s + titan.recompute_time_s
    # each block keeps 0.5 of its 2 GiB; the one recomputed at a time holds its 1.5 GiB again
    assert tessera.peak_memory_bytes - titan.peak_memory_bytes == 4 * (2 * GiB - GiB // 2) - (2 * GiB - GiB // 2)
    with pytest.raises(ConfigError, match="selective_policy='layer' is not one of attention, op"):
        ImplementationProfile(name="x", selective_policy="layer")


def test_torchtitan_selective_under_tensor_parallelism_gathers_again_and_keeps_no_gathered_input():
    """torchtitan's op-level save list keeps reduce-scatters and no other collective: under sequence parallelism each
    selective block all-gathers its pairs' inputs again in the backward (half of each pair's collectives; without
    sequence parallelism its all-reduces, whole) and keeps none of the gathered inputs; Tessera's runtime keeps them."""
    layers = [block(i).model_copy(update={"op_selective_recompute_flops": 3e12, "saved_bytes_op_selective": GiB // 2})
              for i in range(4)]
    cluster, training = load_cluster("dgx-h100:nodes=2"), TrainingConfig(global_batch=16, seq_len=4096)
    stage = stage_totals(layers, 0, {f"blocks.{i}": "selective" for i in range(4)})
    for sp, rerun in ((True, 0.5), (False, 1.0)):
        strategy = Strategy.parse(f"dp=2,tp=8,zero=3,mbs=1,recompute=selective,sp={str(sp).lower()}")
        plain = tp_comm_s(stage, cluster, training, strategy, profile=TESSERA)  # a forward and a backward
        assert tp_comm_s(stage, cluster, training, strategy, profile=TORCHTITAN) == pytest.approx(plain * (2 + rerun) / 2)
    sp = Strategy.parse("dp=2,tp=8,zero=3,mbs=1,recompute=selective,sp=true")
    kept = sp_gathered_input_bytes(as_selective_memory(stage, "attention", tp=8, sp=True), sp)
    assert kept == pytest.approx(stage.sp_gathered_bytes * (1 - 1 / 8)) and stage.op_selective_gathered_bytes > 0
    assert sp_gathered_input_bytes(as_selective_memory(stage, "op", tp=8, sp=True), sp) == 0
    # a mixed stage: only the selective blocks re-gather; the unrecomputed one keeps its gathered inputs, the full one
    # keeps only its input (and re-runs a whole forward's collectives, as before)
    mixed = stage_totals(layers, 0, {"blocks.0": "selective", "blocks.1": "selective", "blocks.2": "full"})
    one_block = stage.sp_gathered_bytes / 4
    assert mixed.sp_gathered_bytes == pytest.approx(3 * one_block)
    assert sp_gathered_input_bytes(as_selective_memory(mixed, "op", tp=8, sp=True), sp) == pytest.approx(
        one_block * (1 - 1 / 8))
    plain = tp_comm_s(mixed, cluster, training, sp, profile=TESSERA)  # forward, a quarter's recomputation, backward
    assert tp_comm_s(mixed, cluster, training, sp, profile=TORCHTITAN) == pytest.approx(plain * (2.25 + 0.25) / 2.25)
    # under async TP the re-gathers run in the backward's compiled graph with the recomputation, overlapped as it is
    overlapped = sp.model_copy(update={"tp_overlap": True})
    per_pass = plain / 2.25
    assert tp_comm_s(mixed, cluster, training, overlapped, profile=TORCHTITAN) == pytest.approx(
        1.5 * per_pass / 8 + per_pass)


@pytest.mark.parametrize("zero, kinds", [(0, ("dp_allreduce",)), (1, ("zero_reducescatter", "zero_allgather"))])
def test_a_framework_that_reduces_after_the_backward_hides_none_of_it(zero, kinds):
    # Megatron-LM's local DDP of 2021-2022 all-reduces after forward_backward_func (profiles.dp_overlap False): none
    # of ZeRO-0..2's collectives hides; ZeRO-3's gathers are prefetched whatever the gradient reduction does
    from dataclasses import replace

    from tessera.cost_models.profiles import MEGATRON_2021

    after_backward = replace(MEGATRON, dp_overlap=False)
    strategy = f"dp=16,zero={zero},mbs=2"
    overlapped, after = run(strategy, framework=MEGATRON), run(strategy, framework=after_backward)
    total = sum(after.comm_time_by_kind_s[kind] for kind in kinds)
    assert sum(overlapped.comm_time_by_kind_s[kind] for kind in kinds) == pytest.approx(total)
    assert overlapped.exposed_comm_time_s < total and after.exposed_comm_time_s == pytest.approx(total)
    zero3 = "dp=16,zero=3,mbs=2"
    assert run(zero3, framework=after_backward).exposed_comm_time_s == pytest.approx(run(zero3, framework=MEGATRON).exposed_comm_time_s)
    assert not MEGATRON_2021.dp_overlap and MEGATRON.dp_overlap and TESSERA.dp_overlap


def test_megatron_2021_scatters_pipeline_sends_over_the_tensor_parallel_ranks():
    # SC'21 Sec. 4.1: each tp rank sends 1/tp of the (replicated) boundary activation, the receiver all-gathers it
    # over NVLink, in both directions and for every chunk; with sequence parallelism the activation is already split
    from dataclasses import replace

    from tessera.cost_models.communication import pp_comm_s
    from tessera.cost_models.profiles import MEGATRON_2021
    from tessera.topology.collectives import all_gather_time, p2p_time

    cluster = load_cluster("dgx-h100:nodes=8")
    stage = stage_totals([block(i) for i in range(4)], 0, {})
    nbytes = stage.boundary_bytes
    for text, chunks, cp in (("tp=8,pp=4,mbs=1", 1, 1), ("tp=8,pp=4,mbs=1,schedule=interleaved:2", 2, 1),
                             ("tp=8,cp=2,pp=4,mbs=1", 1, 2)):
        strategy = Strategy.parse(text)
        share = nbytes / cp
        whole = 2 * chunks * p2p_time(cluster, share, distance=8 * cp)
        scattered = 2 * chunks * (p2p_time(cluster, share / 8, distance=8 * cp) + all_gather_time(cluster, share, group_size=8))
        assert pp_comm_s(stage, cluster, strategy) == pytest.approx(whole)
        assert pp_comm_s(stage, cluster, strategy, profile=MEGATRON_2021) == pytest.approx(scattered)
        assert scattered < whole
    sp = Strategy.parse("tp=8,pp=4,mbs=1,sp=true")
    assert pp_comm_s(stage, cluster, sp, profile=MEGATRON_2021) == pytest.approx(pp_comm_s(stage, cluster, sp))
    assert not MEGATRON.pp_scatter_gather and not TESSERA.pp_scatter_gather
    # and estimate() prices a step's pipeline sends so
    layers = [block(i) for i in range(8)]
    training, strategy = TrainingConfig(global_batch=32, seq_len=4096), Strategy.parse("dp=2,tp=8,pp=4,mbs=1,schedule=interleaved:2")
    sends = {p.name: estimate(layers, cluster, training, strategy, profile=p).comm_time_by_kind_s["pp_p2p"]
             for p in (MEGATRON, replace(MEGATRON, name="scattered", pp_scatter_gather=True))}
    assert sends["scattered"] < 0.5 * sends["megatron"]
