"""The cost model on hand-made LayerStats, checked against arithmetic done by hand."""

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import GPU_CALIBRATION, Calibration
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.memory import REPLICATED_ACTIVATION_SHARE
from tessera.cost_models.partition import split_blocks
from tessera.cost_models.pipeline import bubble_micro_batches, in_flight_micro_batches, pipeline_time_s
from tessera.errors import ConfigError
from tessera.topology import load_cluster
from tessera.topology.collectives import all_reduce_time

GiB = 2**30
FLAT = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0)  # makes hand arithmetic exact


def block(i: int, *, params: int = 10**9, flops: float = 1e13, saved: int = 2 * GiB, hidden: int = 8192) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="b", param_count=params, forward_flops=flops,
        backward_flops=2 * flops, saved_bytes_no_recompute=saved, saved_bytes_full_recompute=saved // 32,
        output_bytes=saved // 32, hidden_size=hidden, attention_heads=64, kv_heads=8,
    )


LAYERS = [block(i) for i in range(4)]
H100_NODE = load_cluster("dgx-h100:nodes=1")
TRAINING = TrainingConfig(global_batch=16, seq_len=4096)


def run(strategy: str, layers=LAYERS, cluster=H100_NODE, training=TRAINING, curve=FLAT):
    return estimate(layers, cluster, training, Strategy.parse(strategy), calibration=curve)


def test_compute_time_is_flops_over_achievable_rate():
    e = run("dp=8,zero=3,mbs=2")
    assert e.compute_time_s == pytest.approx(4 * 3e13 * 2 / (989e12 * 0.5))  # 2 sequences per rank, 1 micro-batch
    assert e.recompute_time_s == 0


def test_efficiency_curve_penalises_narrow_matmuls():
    curve = Calibration(peak_fraction=0.6, half_width=100.0)
    assert curve.at(100) == pytest.approx(0.3) and curve.at(0) == 0.6
    wide, narrow = run("dp=8,zero=3,mbs=2", curve=curve), run("dp=1,tp=8,mbs=2", training=TrainingConfig(global_batch=2, seq_len=4096), curve=curve)
    # Same FLOPs per device; tp=8 makes the local width 1024 instead of 8192: lower efficiency.
    assert wide.compute_time_s == pytest.approx(4 * 3e13 * 2 / (989e12 * 0.6 * 8192 / 8292))
    assert narrow.compute_time_s == pytest.approx(4 * 3e13 * 2 / 8 / (989e12 * 0.6 * 1024 / 1124))


def test_full_recompute_adds_one_forward_and_saves_memory():
    plain, full = run("dp=8,zero=3,mbs=2"), run("dp=8,zero=3,mbs=2,recompute=full")
    assert full.recompute_time_s == pytest.approx(plain.compute_time_s / 3)
    assert full.memory_by_category_bytes["activations"] < plain.memory_by_category_bytes["activations"] / 2
    assert full.hfu > full.mfu


# 4e9 parameters, dp=8, one micro-batch of 2 x 2 GiB x 4 blocks of activations, bf16 compute on GPUs.
P = 4 * 10**9
ZERO_PEAKS = {
    # ZeRO-0 (DDP) peaks after the backward: fp32 params, full gradients, Adam moments, DDP's buckets (a second
    # gradient copy) and AdamW-foreach's sqrt temporaries (one fp32 copy); activations are freed by then.
    0: {"parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P, "activations": 0, "buffers": 4 * P + 4 * P},
    # ZeRO-1/2 (FSDP2, reshard_after_forward=False) peak at the backward's start: 1/8 fp32 masters plus the
    # whole bf16 gathered copy; no gradient yet (one micro-batch); 1/8 of the moments; a block's fp32
    # reduce-scatter input (1e9 parameters) soon after.
    1: {"parameters": 4 * P // 8 + 2 * P, "gradients": 0, "optimizer": 8 * P // 8, "activations": 16 * GiB,
        "buffers": 4 * 10**9},
    2: {"parameters": 4 * P // 8 + 2 * P, "gradients": 0, "optimizer": 8 * P // 8, "activations": 16 * GiB,
        "buffers": 4 * 10**9},
    # ZeRO-3: 1/8 of everything; at a middle block's backward end, two gathered bf16 blocks (1e9 each), the block's
    # bf16 gradient and the block after's fp32 reduce-scatter input and output shard; no root layers.
    3: {"parameters": 4 * P // 8, "gradients": 0, "optimizer": 8 * P // 8, "activations": 16 * GiB,
        "buffers": 2 * 2 * 10**9 + 2 * 10**9 + 4 * 10**9 * (1 + 1 / 8)},
}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_shard_model_state_over_dp(zero):
    e = run(f"dp=8,zero={zero},mbs=2")
    assert {k: v for k, v in e.memory_by_category_bytes.items() if k != "reserve"} == ZERO_PEAKS[zero]


def test_dp_collectives_per_zero_stage():
    assert set(run("dp=8,zero=0,mbs=2").comm_time_by_kind_s) == {"dp_allreduce"}
    assert set(run("dp=8,zero=1,mbs=2").comm_time_by_kind_s) == {"zero_reducescatter", "zero_allgather"}
    assert set(run("dp=8,zero=3,mbs=2").comm_time_by_kind_s) == {"fsdp_allgather", "fsdp_reducescatter"}
    # ZeRO-0 all-reduces the fp32 gradients of all 4e9 parameters once per step.
    assert run("dp=8,zero=0,mbs=2").comm_time_by_kind_s["dp_allreduce"] == pytest.approx(all_reduce_time(H100_NODE, 4e9 * 4, group_size=8))


def test_micro_batches_repeat_compute_and_fsdp_gathers():
    one, two = run("dp=8,zero=3,mbs=2"), run("dp=8,zero=3,mbs=1")
    assert two.compute_time_s == pytest.approx(one.compute_time_s)
    assert two.comm_time_by_kind_s["fsdp_allgather"] == pytest.approx(2 * one.comm_time_by_kind_s["fsdp_allgather"])
    assert two.memory_by_category_bytes["activations"] == one.memory_by_category_bytes["activations"] // 2


def test_tensor_parallel_all_reduces_two_pairs_per_block_forward_and_backward():
    training = TrainingConfig(global_batch=1, seq_len=4096)
    e = run("dp=1,tp=8,mbs=1", training=training)
    per_block = 2 * 2 * all_reduce_time(H100_NODE, LAYERS[0].output_bytes, group_size=8)  # 2 pairs x (fwd + bwd)
    assert e.comm_time_by_kind_s["tp_allreduce"] == pytest.approx(4 * per_block)
    assert run("dp=1,tp=8,mbs=1,recompute=full", training=training).comm_time_by_kind_s["tp_allreduce"] == pytest.approx(4 * per_block * 1.5)


def test_overlapped_tensor_parallelism_exposes_one_ring_step_in_tp():
    training = TrainingConfig(global_batch=1, seq_len=4096)
    plain = run("dp=1,tp=8,mbs=1", training=training)
    overlapped = run("dp=1,tp=8,mbs=1,tp_overlap=true", training=training)
    assert overlapped.comm_time_by_kind_s["tp_allreduce"] == pytest.approx(plain.comm_time_by_kind_s["tp_allreduce"] / 8)
    assert overlapped.step_time_s < plain.step_time_s
    assert Strategy.parse("dp=1,tp=8,tp_overlap=true").to_string().endswith("tp_overlap=true")


def test_korthikanti_activation_share_with_and_without_sequence_parallelism():
    # Korthikanti et al. eq. 2 and 4: sbh(10 + 24/t) without SP, sbh*34/t with SP (of sbh*34 unsplit).
    # Small blocks (1e6 parameters) so that the step peaks where the backward starts, with all activations alive.
    layers = [block(i, params=10**6) for i in range(4)]
    training = TrainingConfig(global_batch=1, seq_len=4096)
    plain = run("dp=8,mbs=1", layers=layers, training=TrainingConfig(global_batch=8, seq_len=4096))
    no_sp = run("dp=1,tp=8,mbs=1", layers=layers, training=training)
    sp = run("dp=1,tp=8,mbs=1,sp=true", layers=layers, training=training)
    whole = plain.memory_by_category_bytes["activations"]
    assert whole == 4 * 2 * GiB
    assert no_sp.memory_by_category_bytes["activations"] == pytest.approx(whole * (10 + 24 / 8) / 34, rel=1e-6)
    # PyTorch's sequence parallelism also keeps each pair's all-gathered input whole (2 pairs x 4 blocks).
    gathered = 4 * 2 * layers[0].output_bytes * (1 - 1 / 8)
    assert sp.memory_by_category_bytes["activations"] == pytest.approx(whole / 8 + gathered, rel=1e-6)
    assert REPLICATED_ACTIVATION_SHARE == pytest.approx(10 / 34)


def test_named_pieces_to_recompute_read_back_and_are_refused_where_nothing_keeps_them():
    # Megatron-Core's --recompute-modules beyond core_attn (cost_models.module_recompute)
    pieces = Strategy.parse("dp=2,recompute=selective,recompute_modules=mla_up_proj/mlp")
    assert pieces.recompute_modules == ("mla_up_proj", "mlp") and Strategy.parse(pieces.to_string()) == pieces
    with pytest.raises(ConfigError, match="'moe_act' or 'moe', got 'attention'"):
        Strategy.parse("dp=2,recompute_modules=attention")
    with pytest.raises(ConfigError, match="names a module twice"):
        Strategy.parse("dp=2,recompute_modules=mlp/mlp")
    with pytest.raises(ConfigError, match="recompute_modules with recompute=full"):
        Strategy.parse("dp=2,recompute=full,recompute_modules=mlp")


def test_a_step_in_two_pipeline_passes_has_two_bubbles_and_holds_one_passs_micro_batches():
    # NeMo AutoModel accumulates gradients over local batches, one schedule call each (Strategy.pipeline_passes)
    one, two = Strategy.parse("dp=1,pp=4,schedule=gpipe"), Strategy.parse("dp=1,pp=4,schedule=gpipe,pipeline_passes=2")
    assert bubble_micro_batches(two) == 2 * bubble_micro_batches(one) == 6
    assert in_flight_micro_batches(two, stage=0, micro_batches=8) == 4  # GPipe holds a pass's 4, not the step's 8
    assert pipeline_time_s(two, micro_batches=8, stage_times_s=[1.0] * 4) == 8 + 6
    assert Strategy.parse(two.to_string()) == two
    with pytest.raises(ConfigError, match="pipeline_passes=2 needs pp > 1"):
        Strategy.parse("dp=2,pipeline_passes=2")
    with pytest.raises(ConfigError, match="6 micro-batches a step do not split into pipeline_passes=4"):
        Strategy.parse("dp=1,pp=2,pipeline_passes=4").gradient_accumulation(6)


def test_pipeline_bubble_and_in_flight_micro_batches():
    s = Strategy.parse("dp=1,pp=4,mbs=1")
    assert bubble_micro_batches(s) == 3
    assert bubble_micro_batches(Strategy.parse("dp=1,pp=4,schedule=interleaved:2")) == 1.5
    assert in_flight_micro_batches(s, stage=0, micro_batches=8) == 4
    assert in_flight_micro_batches(s, stage=3, micro_batches=8) == 1
    assert in_flight_micro_batches(Strategy.parse("dp=1,pp=4,schedule=gpipe"), stage=3, micro_batches=8) == 8
    # ZB1P: stage r's weight halves run r micro-batches late, so every stage holds p; under ZeRO-3 as 1F1B
    zero_bubble = Strategy.parse("dp=1,pp=4,schedule=zero-bubble")
    assert [in_flight_micro_batches(zero_bubble, stage=r, micro_batches=8) for r in range(4)] == [4, 4, 4, 4]
    assert in_flight_micro_batches(zero_bubble, stage=3, micro_batches=2) == 2
    zero3 = Strategy.parse("dp=2,pp=2,zero=3,schedule=zero-bubble")
    assert [in_flight_micro_batches(zero3, stage=r, micro_batches=8) for r in range(2)] == [2, 1]
    two_nodes = load_cluster("dgx-h100:nodes=2")
    layers = [block(i) for i in range(8)]
    e = estimate(layers, two_nodes, TrainingConfig(global_batch=16, seq_len=4096), Strategy.parse("dp=4,pp=4,mbs=1"), calibration=FLAT)
    per_micro_batch = 2 * 3e13 / (989e12 * 0.5)  # two blocks per stage, forward + backward
    assert e.bubble_time_s == pytest.approx(3 * (per_micro_batch + e.comm_time_by_kind_s["pp_p2p"] / 4))
    assert len(e.stage_peak_memory_bytes) == 4 and e.stage_peak_memory_bytes[0] > e.stage_peak_memory_bytes[3]


def test_stages_split_blocks_evenly_with_embedding_first_and_head_last():
    emb = LayerStats(fqn="tok_emb", kind="embedding", signature="e", param_count=10, forward_flops=0, backward_flops=0,
                     saved_bytes_no_recompute=0, saved_bytes_full_recompute=0, output_bytes=0)
    head = emb.model_copy(update={"fqn": "head", "kind": "head"})
    stages = split_blocks([emb, *[block(i) for i in range(5)], head], Strategy.parse("dp=1,pp=2"))
    assert [[l.fqn for l in s] for s in stages] == [["tok_emb", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4", "head"]]


def test_fsdp_fits_where_ddp_does_not():
    layers = [block(i, params=2 * 10**9) for i in range(4)]
    assert not run("dp=8,zero=0,mbs=2", layers=layers).fits and run("dp=8,zero=3,mbs=2", layers=layers).fits


@pytest.mark.parametrize("cluster", ["dgx-h100:nodes=1", "cpu:ranks=2"])
def test_mfu_under_fp8_is_against_the_larger_peak_and_at_most_one(cluster):
    # a CPU rank's FP8 matmul (torch's reference loop) is far slower than its bf16 one: MFU against the FP8 peak
    # alone came out above 100%
    spec = load_cluster(cluster)
    training = TrainingConfig(global_batch=16, seq_len=4096, precision="fp8")
    e = estimate(LAYERS, spec, training, Strategy.parse(f"dp={spec.num_devices},zero=3,mbs=2"))
    peak = max(spec.device.peak_flops("fp8"), spec.device.peak_flops("bf16"))
    assert e.mfu == pytest.approx(e.model_flops_per_step / (e.step_time_s * spec.num_devices * peak))
    assert 0 < e.mfu < 1


def test_mfu_and_throughput_are_consistent():
    e = estimate(LAYERS, H100_NODE, TRAINING, Strategy.parse("dp=8,zero=3,mbs=2"))
    assert e.tokens_per_s == pytest.approx(16 * 4096 / e.step_time_s)
    assert e.mfu == pytest.approx(e.model_flops_per_step / (e.step_time_s * 8 * 989e12))
    assert 0 < e.mfu < GPU_CALIBRATION.peak_fraction
    assert e.model_tflops_per_device == pytest.approx(e.mfu * 989)


def test_wrong_shapes_are_refused():
    with pytest.raises(ConfigError, match="ep=2 needs a model with routed experts"):
        run("dp=8,ep=2")  # expert and context parallelism: tests/unit/test_cost_model_sparse.py
    with pytest.raises(ConfigError, match="dp\\*tp\\*pp\\*cp = 8"):
        run("dp=4")
    with pytest.raises(ConfigError, match="not divisible"):
        run("dp=8", training=TrainingConfig(global_batch=12, seq_len=8))
    with pytest.raises(ConfigError, match="does not divide the attention heads"):
        estimate(LAYERS, load_cluster("cpu:ranks=3"), TrainingConfig(global_batch=3, seq_len=8), Strategy.parse("dp=1,tp=3"))
    with pytest.raises(ConfigError, match="at least 8 blocks"):
        run("dp=1,pp=8", training=TrainingConfig(global_batch=8, seq_len=8))


def test_strategy_string_round_trip_and_errors():
    s = Strategy.parse("dp=4,tp=2,pp=2,zero=1,mbs=2,recompute=full,sp=true,schedule=interleaved:2")
    assert (s.dp, s.zero, s.micro_batch, s.recompute, s.schedule, s.virtual_stages) == (4, 1, 2, "full", "interleaved", 2)
    assert Strategy.parse(s.to_string()) == s
    assert Strategy.parse_fields("tp=8,pp=4") == {"tp": 8, "pp": 4}
    with pytest.raises(ConfigError, match="bad strategy item 'tensor=2'"):
        Strategy.parse("tensor=2")
    with pytest.raises(ConfigError, match="zero"):
        Strategy.parse("zero=7")


# ------------------------------------------------------------------- memory terms of the runtime's mechanisms
def _layer(fqn: str, kind: str, *, params: int = 0, saved: int = 0, out: int = 0, head_in: int = 0) -> LayerStats:
    return LayerStats(fqn=fqn, kind=kind, signature=fqn, param_count=params, forward_flops=0, backward_flops=0,
                      saved_bytes_no_recompute=saved, saved_bytes_full_recompute=head_in or saved, output_bytes=out)


# Embedding 100 params, two blocks of 1000 (saved 64 B, output 8 B per sequence), norm 10, head 200 whose input is
# 8 B and output (the logits) 50 B, and a loss saving 40 B of log-probabilities per sequence.
MODEL = [_layer("emb", "embedding", params=100, out=8), _layer("blocks.0", "block", params=1000, saved=64, out=8),
         _layer("blocks.1", "block", params=1000, saved=64, out=8), _layer("norm", "norm", params=10, out=8),
         _layer("head", "head", params=200, saved=8, out=50, head_in=8), _layer("loss", "loss", saved=40)]


def _totals(strategy: str):
    from tessera.cost_models.partition import stage_totals
    s = Strategy.parse(strategy)
    return stage_totals(MODEL, 0, {}), s


def test_root_loss_and_gathered_totals_of_a_stage():
    totals, _ = _totals("dp=1")
    assert (totals.root_sharded_params, totals.root_replicated_params, totals.embedding_params) == (300, 10, 100)
    assert (totals.loss_saved_bytes, totals.logits_bytes, totals.largest_block_params) == (40, 50, 1000)
    assert totals.sp_gathered_bytes == 2 * 2 * 8 + 8  # two pairs per block, and the head's input


def test_loss_temporaries_plain_and_vocabulary_parallel():
    from tessera.cost_models.memory_state import loss_gradient_bytes
    totals, s = _totals("dp=1,mbs=2")
    assert loss_gradient_bytes(totals, s) == 2 * 40 * 2
    totals, s = _totals("dp=1,tp=2,mbs=2")
    assert loss_gradient_bytes(totals, s) == 3 * 40 * 2 / 2


def test_loss_kernels_keep_and_allocate_what_their_code_does():
    from dataclasses import replace

    from tessera.cost_models.memory import loss_as_run
    from tessera.cost_models.memory_state import logits_gradient_bytes, loss_backward_released_bytes, loss_gradient_bytes
    from tessera.cost_models.profiles import MEGATRON, PYTORCH_FSDP_TE, TESSERA
    totals, s = _totals("dp=1,mbs=2")  # the loss saves 40 B per sequence, the logits are 50 B
    assert loss_as_run(totals, s, TESSERA) is totals
    fused = loss_as_run(totals, s, PYTORCH_FSDP_TE)  # flash-attn's xentropy saves the logits, not log-probabilities
    assert (fused.loss_saved_bytes, fused.saved_bytes, fused.activation_traffic_bytes) == (
        50, totals.saved_bytes + 10, totals.activation_traffic_bytes)  # what the FP8 terms read stays
    assert fused.loss_traffic_saving_bytes == 40 - 50  # read by the elementwise time alone
    assert loss_gradient_bytes(fused, s) == logits_gradient_bytes(fused, s) == 50 * 2  # one gradient, logits-sized
    assert loss_backward_released_bytes(fused, s) == 2 * 50 * 2
    megatron = loss_as_run(totals, s, MEGATRON)  # an fp32 softmax as large as the log-probabilities, used in place
    assert (megatron.loss_saved_bytes, megatron.saved_bytes) == (40, totals.saved_bytes)
    assert loss_gradient_bytes(megatron, s) == 50 * 2  # only the cast of the gradient to the logits' dtype
    assert logits_gradient_bytes(totals, s) == 40 * 2  # torch's: loss-sized, as measured
    tp_totals, tp = _totals("dp=1,tp=2,mbs=2")
    assert loss_as_run(tp_totals, tp, PYTORCH_FSDP_TE) is tp_totals  # under tp: torch's loss_parallel
    assert loss_gradient_bytes(loss_as_run(tp_totals, tp, MEGATRON), tp) == 50 * 2 / 2  # vocabulary-parallel
    compiled = loss_as_run(totals, s, replace(TESSERA, cross_entropy="compiled"))  # torch.compile fuses it alike
    assert (compiled.loss_saved_bytes, compiled.saved_bytes) == (fused.loss_saved_bytes, fused.saved_bytes)
    assert loss_gradient_bytes(compiled, s) == 50 * 2
    assert loss_as_run(tp_totals, tp, replace(TESSERA, cross_entropy="compiled")) is tp_totals
    with pytest.raises(ConfigError, match="cross_entropy='apex' is not one of torch, flash-attn, compiled, megatron"):
        replace(TESSERA, cross_entropy="apex")


def test_deepspeed_zero3_holds_its_live_parameters_and_buckets_not_whole_blocks():
    from tessera.cost_models.memory import backward_memory
    from tessera.cost_models.memory_state import loss_backward_released_bytes
    from tessera.cost_models.memory_transients import parameter_gathered_bytes, zero3_gathered_bytes
    from dataclasses import replace

    from tessera.cost_models.profiles import DEEPSPEED, TESSERA, ParameterGathering
    training = TrainingConfig(global_batch=8, seq_len=16)  # bf16
    totals, s = _totals("dp=4,zero=3")
    released = loss_backward_released_bytes(totals, s)
    small = ParameterGathering(live_params=100, prefetch_params=10, reduce_bucket_params=50)
    assert parameter_gathered_bytes(totals, training, s, small) == (totals.largest_tensor_params + 10 + 50) * 2 - released
    large = ParameterGathering(live_params=5000, prefetch_params=10, reduce_bucket_params=50)
    assert parameter_gathered_bytes(totals, training, s, large) == (5000 + 10 + 50) * 2 - released
    assert DEEPSPEED.zero3_by_parameter == ParameterGathering(1e9, 5e7, 5e8)  # its 2021 defaults
    by_unit = backward_memory(totals, training, s, micro_batches=1)["buffers"]
    by_parameter = backward_memory(totals, training, s, micro_batches=1,
                                   profile=replace(TESSERA, zero3_by_parameter=small))["buffers"]
    assert by_unit == zero3_gathered_bytes(totals, training, s)
    assert by_parameter == parameter_gathered_bytes(totals, training, s, small)


def test_ddp_buckets_only_on_the_ddp_path():
    from tessera.cost_models.memory_transients import ddp_bucket_bytes
    totals, s = _totals("dp=4,zero=0")
    assert ddp_bucket_bytes(totals, s) == 2310 * 4  # a second fp32 copy of every gradient
    for other in ("dp=4,zero=1", "dp=2,tp=2,zero=0", "dp=2,pp=2,zero=0", "dp=1"):
        assert ddp_bucket_bytes(*_totals(other)) == 0


def test_held_gradients_only_after_an_earlier_backward():
    from tessera.cost_models.memory_state import held_gradient_bytes
    totals, s = _totals("dp=4,zero=2,mbs=1")
    assert held_gradient_bytes(totals, s, micro_batches=1) == 0
    assert held_gradient_bytes(totals, s, micro_batches=2) == 2310 * 4 / 4  # ZeRO-2 accumulates its shard
    totals, s = _totals("dp=4,zero=1,mbs=1")
    assert held_gradient_bytes(totals, s, micro_batches=2) == 2310 * 4  # FSDP2 without sync: unsharded fp32
    # two schedule calls of 2 micro-batches, 2 in flight on the first of 2 stages: the peak holds only the
    # first call's reduced shard, where one call of 4 accumulates unsharded fp32 gradients
    totals, _ = _totals("dp=4,pp=2,zero=3,mbs=1")
    assert held_gradient_bytes(totals, Strategy.parse("dp=4,pp=2,zero=3,mbs=1,pipeline_passes=2"),
                               micro_batches=4) == 2310 * 4 / 4
    assert held_gradient_bytes(totals, Strategy.parse("dp=4,pp=2,zero=3,mbs=1"), micro_batches=4) == 2310 * 4
    totals, s = _totals("dp=1,tp=2,zero=0,mbs=1")  # DTensor gives the row-sharded embedding a Replicate gradient
    assert held_gradient_bytes(totals, s, micro_batches=2) == (2300 / 2 + 10 + 100 / 2) * 4


def test_zero12_keep_gathered_parameters():
    from tessera.cost_models.memory import parameter_bytes
    training = TrainingConfig(global_batch=8, seq_len=16)  # bf16
    totals, s = _totals("dp=4,zero=1")
    assert parameter_bytes(totals, training, s, in_backward=True) == 2310 * 4 / 4 + 2310 * 2
    assert parameter_bytes(totals, training, s, in_backward=False) == 2310 * 4 / 4


def test_zero3_gathers_at_the_highest_of_three_backward_moments():
    from dataclasses import replace

    from tessera.cost_models.memory_state import loss_backward_released_bytes
    from tessera.cost_models.memory_transients import zero3_gathered_bytes
    training = TrainingConfig(global_batch=8, seq_len=16)  # bf16
    totals, s = _totals("dp=4,zero=3")
    # Once the loss's backward has run: its two 40 B temporaries and its 40 B of saved log-probabilities are freed.
    assert loss_backward_released_bytes(totals, s) == 3 * 40
    # A middle block's backward end binds: root (310) and two blocks (1000) in bf16, the block's bf16 gradient and
    # the block after's fp32 reduce-scatter input and output shard (1/4), less the loss.
    previous = 1000 * 4 * (1 + 1 / 4)
    assert zero3_gathered_bytes(totals, training, s) == 310 * 2 + 2 * 1000 * 2 + 1000 * 2 + previous - 3 * 40
    # With small blocks, the root's re-gather binds: twice the root in bf16 (all-gather output and the copy-out
    # storages) beside the logits' 40 B gradient, less what the loss freed.
    small_blocks = replace(totals, largest_block_params=10)
    assert zero3_gathered_bytes(small_blocks, training, s) == 2 * 310 * 2 + 40 - 3 * 40
    # With a loss larger than both, the backward's start binds, where every unit is resharded: nothing gathered.
    large_loss = replace(small_blocks, loss_saved_bytes=1000)
    assert zero3_gathered_bytes(large_loss, training, s) == 0
    # Every block keeping its gathered weights (parameter_bytes holds them): none gathered on top at a block's backward
    all_kept = replace(totals, kept_blocks=totals.blocks, kept_params=totals.blocks * 1000)
    assert zero3_gathered_bytes(all_kept, training, s) == 310 * 2 + 1000 * 2 + previous - 3 * 40
    # On CPU ranks gloo's staged copy of that reduce-scatter's fp32 input may still be alive: it counts where larger
    # than the gradient (benchmarks/memory_truth.py wide-short)
    assert zero3_gathered_bytes(totals, training, s, on_cpu=True) == 310 * 2 + 2 * 1000 * 2 + previous + 1000 * 4 - 3 * 40


def test_zero12_reduce_scatter_their_largest_unit_through_an_fp32_copy_after_the_loss_backward():
    from dataclasses import replace

    from tessera.cost_models.memory_transients import zero12_reduce_scatter_bytes
    totals, s = _totals("dp=4,zero=1")
    # the largest unit is a block (1000 parameters): its fp32 reduce-scatter input, less what the loss freed
    assert zero12_reduce_scatter_bytes(totals, s, on_cpu=False) == 1000 * 4 - 3 * 40
    assert zero12_reduce_scatter_bytes(totals, s, on_cpu=True) == 2 * 1000 * 4 - 3 * 40  # gloo's staged copy
    assert zero12_reduce_scatter_bytes(replace(totals, largest_block_params=10), s, on_cpu=False) == 310 * 4 - 3 * 40
    for other in ("dp=4,zero=0", "dp=4,zero=3"):  # DDP's buckets; ZeRO-3's input is in its gathered blocks
        assert zero12_reduce_scatter_bytes(totals, Strategy.parse(other), on_cpu=True) == 0


def test_cpu_adamw_holds_two_temporaries_of_its_largest_local_tensor_and_gpu_foreach_a_whole_shard():
    from tessera.cost_models.memory_transients import optimizer_temporary_bytes
    totals, s = _totals("dp=4,zero=0")
    assert totals.largest_tensor_params == 200  # the head: no block matrix is declared in MODEL
    assert optimizer_temporary_bytes(totals, s, on_cpu=True) == 2 * 200 * 4  # sqrt, then its division
    assert optimizer_temporary_bytes(*_totals("dp=4,zero=1"), on_cpu=True) == 2 * 200 / 4 * 4  # FSDP2's dim-0 shard
    assert optimizer_temporary_bytes(*_totals("dp=2,tp=2,zero=0"), on_cpu=True) == 2 * 200 / 2 * 4
    assert optimizer_temporary_bytes(totals, s, on_cpu=False) == 2310 * 4  # foreach: one fp32 tensor per parameter


def test_fsdp2_replicate_holds_its_reduction_or_its_unit_end_beyond_the_step_end_gradients():
    from tessera.cost_models.memory_transients import replicate_reduction_bytes
    totals, s = _totals("dp=2,tp=2,zero=0,mbs=2")
    bf16 = TrainingConfig(global_batch=4, seq_len=16, precision="bf16")
    local, gradients = 2300 / 2 + 10, 2300 / 2 + 10 + 100 / 2  # a vocabulary-parallel embedding's gradient is whole
    # one micro-batch: the reduction's second fp32 copy of the unit (its input and the output it all-reduces)
    assert replicate_reduction_bytes(totals, bf16, s, micro_batches=1) == gradients * 4
    # accumulating: gathered parameters and the new bf16 gradients beside the accumulated fp32 one, and an fp32
    # copy of the largest tensor's new gradient as it is added
    unit_end = local * 2 + gradients * 2 + gradients * 4 + 200 / 2 * 4
    assert replicate_reduction_bytes(totals, bf16, s, micro_batches=2) == unit_end - gradients * 4
    # fp32: the gathered parameters' own gradients accumulate, one new gradient at a time
    fp32 = TrainingConfig(global_batch=4, seq_len=16, precision="fp32")
    unit_end = local * 4 + gradients * 4 + 200 / 2 * 4
    assert replicate_reduction_bytes(totals, fp32, s, micro_batches=2) == unit_end - gradients * 4
    for other in ("dp=4,zero=0", "dp=4,zero=1", "dp=2,tp=2,zero=3", "dp=1,tp=4"):  # DDP, FSDP2's shards, no dp
        assert replicate_reduction_bytes(totals, bf16, Strategy.parse(other), micro_batches=2) == 0


def test_autograd_accumulation_holds_the_copies_not_yet_used_and_one_fp32_gradient_being_added():
    from tessera.cost_models.memory_transients import accumulation_bytes
    bf16 = TrainingConfig(global_batch=8, seq_len=16, precision="bf16")
    ddp, copies = Strategy.parse("dp=4,zero=0,mbs=2"), 2310 * 2
    assert accumulation_bytes(*_totals("dp=4,zero=0,mbs=2")[:1], bf16, ddp, micro_batches=1, copies=copies) == 0
    totals, _ = _totals("dp=1")
    # autocast around the forward: the copies of blocks not yet reached, and the largest weight's fp32 gradient
    assert accumulation_bytes(totals, bf16, ddp, micro_batches=2, copies=copies) == copies + 200 * 4
    assert accumulation_bytes(totals, bf16, ddp, micro_batches=2, copies=0) == 200 * 4  # fp32: that gradient alone
    pipeline = Strategy.parse("dp=1,pp=2,mbs=2")  # autocast's cache keeps every copy; a block's gradients wait
    assert accumulation_bytes(totals, bf16, pipeline, micro_batches=4, copies=copies) == copies + 1000 * 2 + 200 * 4
    assert accumulation_bytes(totals, bf16, pipeline, micro_batches=1, copies=copies) == copies
    for fsdp2 in ("dp=4,zero=1,mbs=2", "dp=2,pp=2,zero=0,mbs=2"):  # FSDP2 accumulates (``replicate_reduction_bytes``)
        assert accumulation_bytes(totals, bf16, Strategy.parse(fsdp2), micro_batches=4, copies=copies) == 0


def test_pipeline_last_stage_keeps_one_output_unless_the_framework_merges_them():
    from tessera.cost_models import memory
    totals, s = _totals("dp=1,pp=4,mbs=2")
    assert memory.pipeline_output_bytes(totals, s, micro_batches=8) == 50 * 2  # return_outputs=False: one in flight
    # pipelining's default keeps every micro-batch's of a schedule call
    assert memory.pipeline_output_bytes(totals, s, micro_batches=8, keeps_outputs=True) == 50 * 2 * 8
    two_calls = Strategy.parse("dp=1,pp=4,mbs=2,pipeline_passes=2")
    assert memory.pipeline_output_bytes(totals, two_calls, micro_batches=8, keeps_outputs=True) == 50 * 2 * 4
    assert memory.pipeline_output_bytes(*_totals("dp=1,mbs=2"), micro_batches=8) == 0


def test_sequence_parallel_keeps_gathered_linear_inputs():
    from tessera.cost_models.memory import sp_gathered_input_bytes
    totals, s = _totals("dp=1,tp=4,sp=true,mbs=2")
    assert sp_gathered_input_bytes(totals, s) == 40 * 2 * (1 - 1 / 4)
    assert sp_gathered_input_bytes(*_totals("dp=1,tp=4,mbs=2")) == 0
    # Megatron-LM's sequence parallelism keeps only the shard and gathers it again in the backward.
    regather = Strategy.parse("dp=1,tp=4,sp=true,mbs=2,sp_regather=true")
    assert sp_gathered_input_bytes(totals, regather) == 0
    assert regather.to_string().endswith("sp_regather=true") and Strategy.parse(regather.to_string()) == regather


def test_inner_pipeline_stages_keep_their_in_flight_outputs_and_the_last_merges():
    from tessera.cost_models.memory import merged_pipeline_output_bytes, pipeline_output_bytes
    from tessera.cost_models.partition import stage_totals
    s = Strategy.parse("dp=1,pp=4,mbs=2")
    first = stage_totals(MODEL[:2], 0, {})  # no loss: its boundary output (8 B) for each of 4 in-flight micro-batches
    assert pipeline_output_bytes(first, s, micro_batches=8) == 8 * 2 * 4
    assert merged_pipeline_output_bytes(first, s, micro_batches=8) == 0
    last, _ = _totals("dp=1,pp=4,mbs=2")
    assert merged_pipeline_output_bytes(last, s, micro_batches=8) == 0  # the runtime asks for no merged output
    assert merged_pipeline_output_bytes(last, s, micro_batches=8, keeps_outputs=True) == 2 * 50 * 2 * 8  # chunks, cat


def test_sharded_collectives_per_step_follow_the_runtime():
    from tessera.cost_models.communication import sharded_collective_counts

    def counts(text: str) -> tuple[int, int]:
        return sharded_collective_counts(Strategy.parse(text), micro_batches=8)

    assert counts("dp=4,zero=1") == (1, 1)  # one gather, one reduce-scatter on the last micro-batch
    assert counts("dp=4,zero=2") == (1, 8)  # reduce-scatter after every micro-batch
    assert counts("dp=4,zero=3") == (16, 8)  # gathered for each forward and each backward
    # under pipelining, PipelineStage defers FSDP2's gradient sync and resharding to the last micro-batch
    assert counts("dp=2,pp=2,zero=2") == (1, 1)
    assert counts("dp=2,pp=2,zero=3") == (9, 1)
    # each of two schedule calls ends in its own sync and reshard
    assert counts("dp=2,pp=2,zero=2,pipeline_passes=2") == (2, 2)
    assert counts("dp=2,pp=2,zero=3,pipeline_passes=2") == (10, 2)


def test_a_fused_loss_kernel_holds_less_and_runs_faster_on_a_captured_model():
    from dataclasses import replace

    from tessera.cost_models.partition import stage_totals
    from tessera.cost_models.profiles import TESSERA
    from tessera.planner.capture import capture_preset
    layers = capture_preset("gpt:layers=2,hidden=64,heads=4,vocab=4096,seq=128", seq_len=128).layers
    cluster, training = load_cluster("dgx-a100:nodes=1"), TrainingConfig(global_batch=32, seq_len=128)
    fused_profile = replace(TESSERA, cross_entropy="flash-attn")
    totals = stage_totals(layers, 0, {})
    loss, logits = totals.loss_saved_bytes, totals.logits_bytes
    assert loss == pytest.approx(2 * logits, rel=1e-4)  # fp32 log-probabilities against bf16 logits
    strategy = Strategy.parse("dp=8,zero=3,mbs=4,recompute=none")
    plain = estimate(layers, cluster, training, strategy)
    fused = estimate(layers, cluster, training, strategy, profile=fused_profile)
    held = plain.memory_by_category_bytes["activations"] - fused.memory_by_category_bytes["activations"]
    assert held == pytest.approx(4 * (3 * loss - 2 * logits), abs=4)  # saved + two temporaries against two logits
    assert fused.step_time_s < plain.step_time_s
    tp = Strategy.parse("dp=4,tp=2,zero=3,mbs=4,recompute=none")  # torch's loss_parallel either way
    assert estimate(layers, cluster, training, tp, profile=fused_profile).step_time_s == pytest.approx(
        estimate(layers, cluster, training, tp).step_time_s)


def test_layers_between_blocks_join_the_next_blocks_chunk_and_none_is_dropped():
    # An encoder-decoder's decoder embeddings sit between the encoder's blocks and the decoder's: the split counted
    # layers as blocks from the first block on, so BART lost its decoder blocks from every chunk (and the estimate).
    from tessera.cost_models.partition import split_chunks

    layers = [_layer("enc.emb", "embedding"), _layer("enc.0", "block"), _layer("enc.1", "block"),
              _layer("dec.emb", "embedding"), _layer("dec.norm", "norm"), _layer("dec.0", "block"),
              _layer("dec.1", "block"), _layer("head", "head"), _layer("loss", "loss")]
    for pp, expected in ((1, [[layer.fqn for layer in layers]]),
                         (2, [["enc.emb", "enc.0", "enc.1"], ["dec.emb", "dec.norm", "dec.0", "dec.1", "head", "loss"]]),
                         (4, [["enc.emb", "enc.0"], ["enc.1"], ["dec.emb", "dec.norm", "dec.0"], ["dec.1", "head", "loss"]])):
        chunks = split_chunks(layers, Strategy(dp=1, pp=pp, micro_batch=1))
        assert [[layer.fqn for layer in chunk] for chunk in chunks] == expected
