"""FP8 training in the cost model (``cost_models.fp8``): rates, what stays bf16, scaling traffic, memory per framework."""

from dataclasses import replace

import pytest

from tessera.cost_models import Strategy, TrainingConfig, estimate
from tessera.cost_models.compute import Calibration
from tessera.cost_models.fp8 import CAST_PASSES
from tessera.cost_models.layer_sums import LINEAR_INPUT_SHARE
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.profiles import MEGATRON, TESSERA, ImplementationProfile
from tessera.errors import ClusterSpecError, ConfigError
from tessera.topology import load_cluster

GiB = 2**30
# bf16 at half of 989, FP8 at half of 1979 TFLOP/s, any width; no elementwise traffic but the casts'
FLAT = Calibration(peak_fraction=0.5, half_width=0.0, traffic_factor=0.0, fp8_peak_fraction=0.5, fp8_half_width=0.0)
H100 = load_cluster("dgx-h100:nodes=1")
CORE = 2e12  # forward FLOPs of each block's attention core


def block(i: int) -> LayerStats:
    return LayerStats(
        fqn=f"blocks.{i}", kind="block", signature="b", param_count=10**9, forward_flops=1e13, backward_flops=2e13,
        saved_bytes_no_recompute=2 * GiB, saved_bytes_full_recompute=GiB // 16, output_bytes=GiB // 16, hidden_size=8192,
        attention_heads=64, kv_heads=8, selective_recompute_flops=CORE, saved_bytes_selective=GiB,
    )


LAYERS = [block(i) for i in range(4)]


def run(precision: str = "fp8", *, scaling: str = "current", strategy: str = "dp=8,zero=3,mbs=1", cluster=H100,
        framework: ImplementationProfile = TESSERA):
    extra = {"fp8_scaling": scaling} if precision == "fp8" else {}
    training = TrainingConfig(global_batch=8, seq_len=4096, precision=precision, **extra)
    return estimate(LAYERS, cluster, training, Strategy.parse(strategy), calibration=FLAT, profile=framework)


def test_linears_run_at_the_fp8_rate_and_attention_cores_at_the_bf16_rate():
    e = run()
    # the cores (backward: 2.5x the forward, FlopCounterMode's SDPA count) at cuDNN's bf16 rate on H100, the kernel
    # torch 2.13 runs there, at 4K tokens, 474 TFLOP/s on the causal half of the measured FLOPs (topology/catalog.yaml)
    attention, fp8 = 474e12 / 0.5, 1979e12 * 0.5
    arithmetic = 4 * ((1e13 - CORE) / fp8 + CORE / attention + (2e13 - 2.5 * CORE) / fp8 + 2.5 * CORE / attention)
    casts = 4 * 3 * CAST_PASSES["current"] * 0.75 * LINEAR_INPUT_SHARE * 2 * GiB / H100.device.memory_bandwidth_bytes_per_s
    assert e.compute_time_s == pytest.approx(arithmetic + casts)
    assert e.compute_time_s < run("bf16").compute_time_s
    assert any("fp8 (current scaling)" in note for note in e.notes)


def test_casts_read_what_capture_measured_the_linears_read():
    """A block whose linears' inputs capture measured casts those (a Llama block's are ~0.6 of the GPT share of what
    it saves); the head's input is not cast; a block without the figure falls back to the share (above)."""
    measured = [layer.model_copy(update={"linear_input_bytes": GiB // 4}) for layer in LAYERS]
    head = LayerStats(fqn="head", kind="head", signature="h", param_count=10**8, forward_flops=1e12, backward_flops=2e12,
                      saved_bytes_no_recompute=GiB, saved_bytes_full_recompute=GiB, output_bytes=GiB, linear_input_bytes=GiB)
    training = TrainingConfig(global_batch=8, seq_len=4096, precision="fp8")
    strategy = Strategy.parse("dp=8,zero=3,mbs=1")

    eager = replace(TESSERA, name="per-linear", fp8_casts_per_linear=True)  # torchao's eager Float8Linear: per call
    once = replace(eager, name="once", fp8_casts_per_linear=False)  # Transformer Engine's fused modules: once

    def compute(layers, precision="fp8"):
        config = training if precision == "fp8" else training.model_copy(update={"precision": precision, "fp8_scaling": None})
        return estimate(layers, H100, config, strategy, calibration=FLAT, profile=once).compute_time_s

    casts = 4 * 3 * CAST_PASSES["current"] * 0.75 * GiB / 4 / H100.device.memory_bandwidth_bytes_per_s
    per_call = [layer.model_copy(update={"linear_call_input_bytes": GiB // 2}) for layer in measured]
    assert (estimate(per_call, H100, training, strategy, calibration=FLAT, profile=eager).compute_time_s
            - estimate(per_call, H100, training, strategy, calibration=FLAT, profile=once).compute_time_s
            == pytest.approx(casts))  # casts of GiB / 2 per block, not GiB / 4
    assert compute(measured) - compute(LAYERS) == pytest.approx(casts - 4 * 3 * CAST_PASSES["current"] * 0.75
                                                                 * LINEAR_INPUT_SHARE * 2 * GiB
                                                                 / H100.device.memory_bandwidth_bytes_per_s)
    with_head, without = compute([*measured, head]), compute(measured)
    bf16_head = compute([*measured, head], "bf16") - compute(measured, "bf16")
    assert with_head - without == pytest.approx(bf16_head)  # the head adds its bf16 matmuls, no cast
    # Transformer Engine saves those inputs in FP8: half of what the linears read, not half of the share
    held = {precision: estimate(measured, H100, training if precision == "fp8" else TrainingConfig(
        global_batch=8, seq_len=4096), strategy, calibration=FLAT, profile=MEGATRON).memory_by_category_bytes[
        "activations"] for precision in ("fp8", "bf16")}
    assert held["bf16"] - held["fp8"] == pytest.approx(4 * 0.5 * GiB / 4, abs=4)


def test_delayed_scaling_moves_fewer_bytes_than_current_scaling():
    assert run(scaling="delayed").compute_time_s < run(scaling="current").compute_time_s
    assert any("not calibrated" in note for note in run(scaling="rowwise").notes)


def test_block_and_mx_scaling_cost_what_transformer_engines_gemm_benchmark_measured_beyond_current_scaling():
    """Its per-layer totals (H200 NVL: current 20.285, delayed 18.978, block 22.882 ms; B300: 9.147, 7.802 and MXFP8
    8.984 ms) in units of the one cast pass current and delayed differ by: block costs 1.99 such passes more than
    current on Hopper, MXFP8 0.12 fewer on Blackwell."""
    times = {scaling: run(scaling=scaling).compute_time_s for scaling in ("delayed", "current", "block", "mx")}
    one_pass = times["current"] - times["delayed"]
    assert (times["block"] - times["current"]) / one_pass == pytest.approx((22.882 - 20.285) / (20.285 - 18.978))
    assert (times["mx"] - times["current"]) / one_pass == pytest.approx((8.984 - 9.147) / (9.147 - 7.802))
    assert any("GEMM benchmark" in note for note in run(scaling="block").notes)


def test_selective_recompute_reruns_the_attention_core_in_bf16():
    e = run(strategy="dp=8,zero=3,mbs=1,recompute=selective")
    assert e.recompute_time_s == pytest.approx(4 * CORE / (474e12 / 0.5))  # cuDNN's bf16 rate, as above


def test_fp8_needs_a_device_with_fp8_units_and_scaling_needs_fp8():
    with pytest.raises(ClusterSpecError, match="no peak FLOP/s for dtype 'fp8'"):
        run(cluster=load_cluster("dgx-a100:nodes=1"))
    with pytest.raises(ConfigError, match="fp8_scaling=delayed needs precision=fp8"):
        TrainingConfig(global_batch=8, seq_len=4096, fp8_scaling="delayed")
    assert TrainingConfig(global_batch=8, seq_len=4096, precision="fp8").fp8_scaling == "current"


def test_transformer_engine_keeps_fp8_weights_and_saves_fp8_inputs():
    bf16, tessera, megatron = (run(p, framework=f).memory_by_category_bytes for p, f in
                               (("bf16", TESSERA), ("fp8", TESSERA), ("fp8", MEGATRON)))
    assert tessera["activations"] == bf16["activations"] and tessera["parameters"] == bf16["parameters"]
    saved_less = 4 * 0.5 * LINEAR_INPUT_SHARE * 2 * GiB
    assert megatron["activations"] == pytest.approx(bf16["activations"] - saved_less, abs=4)
    assert megatron["parameters"] == bf16["parameters"] + 2 * 4 * 10**9 // 8 * 8  # weight + transpose, 1 B each, whole
    # with --fp8-param-gather the weights are FP8 tensors, gathered in FP8: no copies beside them
    fp8_params = run(framework=replace(MEGATRON, fp8_params=True)).memory_by_category_bytes
    assert fp8_params["parameters"] == bf16["parameters"]


def test_an_offloaded_block_keeps_no_fp8_inputs_on_the_device_and_te_reloads_into_freed_memory():
    offloaded = "dp=8,zero=1,mbs=1,block_recompute=2xoffload/2xnone"
    bf16, megatron = (run(p, strategy=offloaded, framework=MEGATRON).memory_by_category_bytes for p in ("bf16", "fp8"))
    saved_less = 2 * 0.5 * LINEAR_INPUT_SHARE * 2 * GiB  # the two kept blocks' inputs in FP8, not the offloaded two
    assert megatron["activations"] == pytest.approx(bf16["activations"] - saved_less, abs=4)
    buffered = run(strategy=offloaded, framework=replace(MEGATRON, offload_buffered=True)).memory_by_category_bytes
    assert buffered["activations"] == pytest.approx(megatron["activations"] + 2 * 2 * GiB, abs=4)  # two blocks in transit


def test_fp8_all_gather_halves_the_block_gathers():
    bf16_gathers = replace(TESSERA, name="bf16-gathers", fp8_all_gather=False)
    plain, gathered = run(framework=bf16_gathers), run()  # Tessera's runtime gathers FP8 under ZeRO-3
    assert gathered.comm_time_by_kind_s["fsdp_allgather"] < 0.6 * plain.comm_time_by_kind_s["fsdp_allgather"]
    assert gathered.memory_by_category_bytes["buffers"] == plain.memory_by_category_bytes["buffers"] - 2 * 10**9
    # blocks kept gathered to their backward hold FP8 too (measured on Tessera's runtime at tp 1: memory_truth.py
    # --models wide-short --pins 'ZeRO-3 kept=...')
    plain, gathered = (run(strategy="dp=8,zero=3,mbs=1,block_reshard=4xfalse", framework=framework)
                       for framework in (bf16_gathers, TESSERA))
    assert gathered.memory_by_category_bytes["parameters"] == plain.memory_by_category_bytes["parameters"] - 4 * 10**9


@pytest.mark.parametrize(("scaling", "strategy", "framework", "gathers"), [
    ("current", "dp=8,zero=3,mbs=1", TESSERA, True),
    ("rowwise", "dp=8,zero=3,mbs=1", TESSERA, False),  # torchao gathers FP8 with one scale per tensor only
    ("current", "dp=4,tp=2,zero=3,mbs=1", TESSERA, False),  # Tessera's tensor-parallel styles gather bf16
    ("current", "dp=4,tp=2,zero=3,mbs=1", replace(TESSERA, fp8_all_gather_under_tp=True), True),
    ("current", "dp=8,zero=1,mbs=1", TESSERA, False),
])
def test_the_runtime_gathers_fp8_only_where_torchao_and_its_styles_can(scaling, strategy, framework, gathers):
    training = TrainingConfig(global_batch=8, seq_len=4096, precision="fp8", fp8_scaling=scaling)
    assert framework.gathers_fp8(training, Strategy.parse(strategy)) is gathers
    assert not framework.gathers_fp8(TrainingConfig(global_batch=8, seq_len=4096), Strategy.parse(strategy))


def test_eager_fp8_casts_hold_their_fp32_temporaries_in_the_backward():
    # Tessera's runtime casts with torchao's eager kernels: 9 bytes per element of the widest operand, a micro-batch's
    # tokens times the MLP width split by tp (but never below the hidden size: a column linear's input is whole on
    # every tp rank), or the largest weight split by tp (benchmarks/memory_truth.py --precision fp8)
    wide = [block(i).model_copy(update={"widest_matrix_dim": 28672, "largest_matrix_params": 10**6})
            for i in range(4)]
    training = TrainingConfig(global_batch=8, seq_len=4096, precision="fp8")
    fused = replace(TESSERA, name="fused-casts", fp8_cast_bytes_per_element=0.0)
    for strategy, elements in (("dp=8,zero=3,mbs=1", 4096 * 28672), ("dp=4,tp=2,zero=3,mbs=2", 8192 * 28672 / 2),
                               ("dp=1,tp=8,zero=3,mbs=1", 4096 * 8192)):
        eager, plain = (estimate(wide, H100, training, Strategy.parse(strategy), calibration=FLAT, profile=profile)
                        for profile in (TESSERA, fused))
        extra = eager.memory_by_category_bytes["buffers"] - plain.memory_by_category_bytes["buffers"]
        assert extra == pytest.approx(9 * elements, rel=1e-6), strategy
    weights_wider = [layer.model_copy(update={"largest_matrix_params": 8 * 10**9}) for layer in wide]
    # ZeRO-3 casts shards, then gathers FP8; the fp32 reduce-scatter input FSDP2 keeps until the next unit's
    # backward is there beside the casts either way
    for strategy, cast in (("dp=8,zero=1,mbs=1", 8 * 10**9), ("dp=8,zero=3,mbs=1", 10**9)):
        eager, plain = (estimate(weights_wider, H100, training, Strategy.parse(strategy), calibration=FLAT,
                                 profile=profile) for profile in (TESSERA, fused))
        assert eager.memory_by_category_bytes["buffers"] - plain.memory_by_category_bytes["buffers"] == 9 * cast
    # on CPU ranks gloo's brief copy of the reduce-scatter's input and the casts never coexist: the larger counts
    cpu = load_cluster("cpu:ranks=8")
    eager, plain = (estimate(weights_wider, cpu, training, Strategy.parse("dp=8,zero=1,mbs=1"), calibration=FLAT,
                             profile=profile) for profile in (TESSERA, fused))
    assert eager.memory_by_category_bytes["buffers"] - plain.memory_by_category_bytes["buffers"] == 9 * 8 * 10**9 - 4 * 10**9


def test_plans_say_how_fp8_trains_and_whether_zero3_gathers_it_in_fp8():
    import tessera

    plan = tessera.plan("gpt3-2.7b", "dgx-h100:nodes=1", global_batch=64, seq_len=2048, precision="fp8")
    for strategy, said in (("dp=8,zero=3", "fp8 (current scaling; ZeRO-3 all-gathers FP8 weights)"),
                           ("dp=4,tp=2,zero=3", "fp8 (current scaling)"), ("dp=8,zero=1", "fp8 (current scaling)")):
        assert plan.model_copy(update={"strategy": Strategy.parse(strategy)}).precision_summary() == said
    from rich.console import Console

    from tessera.report import print_plan
    console = Console(record=True, width=200)
    print_plan(plan, console)
    assert f"tokens, {plan.precision_summary()}" in console.export_text()


def test_fp8_weights_are_gathered_in_fp8_after_the_distributed_optimizers_step():
    """Megatron-Core keeps FP8 weights (``--fp8-param-gather``) in a uint8 parameter buffer, so the distributed
    optimizer's all-gather of the updated weights (ZeRO-1) moves 1 byte an element, where bf16 weights move 2."""
    comm = {name: run(strategy="dp=8,zero=1,mbs=1", framework=framework).comm_time_by_kind_s["zero_allgather"]
            for name, framework in (("bf16 weights", MEGATRON), ("fp8 weights", replace(MEGATRON, fp8_params=True)))}
    assert comm["fp8 weights"] < 0.6 * comm["bf16 weights"]
    assert run(strategy="dp=8,zero=1,mbs=1", framework=MEGATRON).comm_time_by_kind_s["zero_allgather"] == \
        run("bf16", strategy="dp=8,zero=1,mbs=1", framework=MEGATRON).comm_time_by_kind_s["zero_allgather"]
