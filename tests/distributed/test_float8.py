"""FP8 training (``precision="fp8"``, ``runtime.float8``): the blocks' linears run torchao's ``Float8Linear`` under
every split, on gloo ranks (torch's CPU ``_scaled_mm``: FP8 rounding, products in higher precision).

The reference is one FP8 process on the whole global batch at micro-batch 1. FP8's tensorwise scale comes from each
cast tensor's own maximum, so a split trains exactly like that process only where every cast sees the same tensors:
data parallelism without FSDP and pipelining, at micro-batch 1 (each rank's micro-batch is one of the reference's),
match to fp32 tolerance. FSDP2 at ZeRO-3 gathers FP8 weights cast from their fp32 masters (the reference casts bf16
copies) and tensor parallelism casts each rank's shard of a row-parallel input with its own scale: both change the
scales, so each FP8 rounding lands elsewhere, and they are held to FP8's noise instead -- measured on this model:
losses within 3e-4 (relative; 1.5e-4 when FSDP2 gathered bf16), first gradients within 6.5% (global norm),
parameters within 1% after 5 steps, the same spread as the reference at micro-batch 4 against micro-batch 1; a
gradient summed where it should be averaged over the two ranks would be 100% off.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tessera
from tessera.errors import ConfigError, NotModelledError
from tessera.runtime.apply import apply_plan
from tessera.runtime.float8 import bf16_matrices, check_float8_model

from .harness import (
    FP32_TOL, GPT, GRAD_TOL, LLAMA, MOE, PARAM_TOL, full_tensors, make_batches, make_model, make_plan, merged,
    record_first_gradients, reference, train_case,
)

pytest.importorskip("torchao.float8", reason="fp8 trains through torchao (the test extras install it)")
pytestmark = pytest.mark.distributed

EXACT = ["dp=2,zero=0,mbs=1", "dp=1,pp=2,mbs=1"]
RESCALED = ["dp=2,zero=3,mbs=1", "dp=1,tp=2,mbs=1"]
FP8_LOSS_RTOL, FP8_GRAD_NORM, FP8_PARAM_NORM = 2e-3, 0.15, 0.03


FOUR_RANKS = [(LLAMA, "dp=2,tp=2,sp=true,zero=3,mbs=1"), (LLAMA, "dp=2,cp=2,mbs=1"), (MOE, "dp=4,ep=2,mbs=1")]


@functools.cache
def single_fp8(spec: str = GPT) -> dict:
    return train_case(spec, "dp=1,mbs=1", "fp8")


def run_fp8_cases(cases: list[tuple[str, str]]) -> dict:
    return {(spec, strategy): train_case(spec, strategy, "fp8") for spec, strategy in cases}


@functools.cache
def ranks(world: int) -> list[dict]:
    from tessera.runtime.launch import spawn

    cases = [(GPT, strategy) for strategy in EXACT + RESCALED] if world == 2 else FOUR_RANKS
    return spawn(run_fp8_cases, nprocs=world, args=(cases,), timeout_s=600, crash_retries=1)


def relative_norm(result: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """``|result - expected| / |expected|`` over every tensor at once (one tensor's near-zero gradient, such as an
    attention key bias's, would make a per-tensor ratio meaningless)."""
    assert result.keys() == expected.keys()
    difference = torch.cat([(result[name] - expected[name]).flatten() for name in expected])
    return (difference.norm() / torch.cat([tensor.flatten() for tensor in expected.values()]).norm()).item()


def test_one_process_runs_the_blocks_linears_in_fp8_on_bf16_inputs_and_trains_near_full_precision():
    model = make_model(GPT)
    parallel = apply_plan(model, make_plan(GPT, model, "dp=1,mbs=1", "fp8"))
    converted = {name: module for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    block_linears = {name for name, module in make_model(GPT).named_modules()
                     if isinstance(module, nn.Linear) and name.startswith("blocks.")}
    assert converted.keys() == block_linears and len(converted) == 24  # 4 blocks x (q, k, v, o, up, down); not the head
    seen = set()
    for module in converted.values():  # after the runtime's own pre-hook: what the FP8 cast receives
        module.register_forward_pre_hook(lambda module, args: seen.add(args[0].dtype))
    parallel.train_step(make_batches(GPT)[0])
    assert seen == {torch.bfloat16}  # as under CUDA autocast, not the fp32 a CPU norm hands on
    assert_within_fp8_noise(single_fp8(), fp32_reference())
    assert single_fp8()["losses"] != train_case(GPT, "dp=1,mbs=1", "bf16")["losses"]  # FP8 really ran


def test_rowwise_scaling_trains_one_process_near_full_precision():
    model = make_model(GPT)
    parallel = apply_plan(model, with_scaling(make_plan(GPT, model, "dp=1,mbs=1", "fp8"), "rowwise"))
    grads = record_first_gradients(list(parallel.named_parameters()), parallel.optimizer)
    losses = [parallel.train_step(batch) for batch in make_batches(GPT)]
    rowwise = {"losses": losses, "grads": grads, "params": full_tensors(parallel.named_parameters())}
    assert_within_fp8_noise(rowwise, fp32_reference())
    assert losses != single_fp8()["losses"]  # one scale per row rounds otherwise than one per tensor


def test_plan_refuses_before_its_search_what_apply_plan_would_refuse():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    with pytest.raises(NotModelledError, match=r"100% of the blocks' matrix weights .*c_fc.*train with precision bf16"):
        tessera.plan(transformers.GPT2LMHeadModel(config), "cpu:ranks=1", global_batch=4, seq_len=32, precision="fp8")
    with pytest.raises(NotModelledError, match="dimensions not multiples of 16"):  # a preset too: hidden 72
        tessera.plan("gpt-tiny:hidden=72", "cpu:ranks=1", global_batch=4, seq_len=32, precision="fp8")
    with pytest.raises(NotModelledError, match="fp8_scaling=delayed: torchao removed delayed scaling"):
        tessera.plan(GPT, "cpu:ranks=1", global_batch=4, seq_len=32, precision="fp8", fp8_scaling="delayed")


def test_apply_plan_refuses_blocks_fp8_would_leave_in_bf16_whoever_made_the_plan():
    spec = "gpt-tiny:hidden=72"  # every block matrix has a dimension of 72 or 216, not multiples of 16
    model = make_model(spec)
    with pytest.raises(NotModelledError, match=r"precision fp8: 100% of the blocks' matrix weights"):
        apply_plan(model, make_plan(spec, model, "dp=1", "fp8"))


def test_a_model_whose_blocks_hold_no_linears_fp8_can_run_is_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.MixtralForCausalLM(config)  # experts as stacked 3-D weights, not nn.Linear
    with pytest.raises(NotModelledError, match=r"precision fp8: \d+% of the blocks' matrix weights .*experts\.gate_up_proj"
                                               r".*train with precision bf16"):
        tessera.auto_parallelize(model, "cpu:ranks=1", global_batch=4, seq_len=32, precision="fp8")


def test_a_few_small_matrices_outside_fp8_are_kept_in_bf16_and_named():
    model = make_model(MOE)  # Tessera's MoE: experts are linears (FP8); routers have 4 outputs (not a multiple of 16)
    blocks = make_plan(MOE, model, "dp=1", "fp8").block_fqns
    left, total = bf16_matrices(model, blocks)
    assert set(left) == {f"{block}.moe.router.weight" for block in blocks} and sum(left.values()) < 0.01 * total
    assert check_float8_model(model, blocks) == left


def hf_llama_fp8_losses(world: int, strategy: str) -> list[float]:
    """Three FP8 steps of a tiny Hugging Face Llama through ``auto_parallelize`` (on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
                                         num_attention_heads=4, num_key_value_heads=2))
    parallel = tessera.auto_parallelize(model, f"cpu:ranks={world}", global_batch=4, seq_len=32, precision="fp8",
                                        strategy=strategy)
    tokens = torch.randint(256, (4, 33), generator=torch.Generator().manual_seed(1))
    return [parallel.train_step((tokens[:, :-1], tokens[:, 1:])) for _ in range(3)]


@pytest.mark.parametrize("strategy", ["dp=1,tp=2,mbs=1", "dp=1,pp=2,mbs=1"])
def test_a_hugging_face_llama_trains_fp8_under_tp_and_pp_like_one_fp8_process(strategy):
    # pp cuts the model from a torch.export trace; the FP8 linears run inside each stage's own modules
    pytest.importorskip("transformers")
    from tessera.runtime.launch import spawn

    expected = hf_llama_fp8_losses(1, "dp=1,mbs=1")
    for losses in spawn(hf_llama_fp8_losses, nprocs=2, args=(2, strategy), timeout_s=600, crash_retries=1):
        torch.testing.assert_close(losses, expected, rtol=FP8_LOSS_RTOL, atol=0.0)


def test_an_eager_cast_holds_the_bytes_per_element_tesseras_profile_charges():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from memory_meter import AllocatorMeter
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from tessera.cost_models.profiles import TESSERA

    tensor = torch.randn(1024, 256, dtype=torch.bfloat16)
    with AllocatorMeter(0) as meter:
        hp_tensor_to_float8_dynamic(tensor, torch.float8_e4m3fn, LinearMMConfig())
    assert meter.peak_bytes / tensor.numel() == pytest.approx(TESSERA.fp8_cast_bytes_per_element, rel=0.01)


def fp32_reference() -> dict:
    losses, grads, params = reference(GPT)
    return {"losses": losses, "grads": grads, "params": params}


@pytest.mark.parametrize("strategy", EXACT)
def test_splits_whose_casts_see_the_same_tensors_train_exactly_like_one_fp8_process(strategy):
    result, expected = merged(ranks(2), (GPT, strategy)), single_fp8()
    torch.testing.assert_close(result["losses"][0], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["grads"], expected["grads"], **GRAD_TOL)
    torch.testing.assert_close(result["params"], expected["params"], **PARAM_TOL)


@pytest.mark.parametrize("strategy", RESCALED)
def test_splits_that_change_the_scales_train_like_one_fp8_process_within_fp8_noise(strategy):
    assert_within_fp8_noise(merged(ranks(2), (GPT, strategy)), single_fp8())


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "strategy"), FOUR_RANKS)
def test_sequence_context_and_expert_parallelism_train_fp8_within_its_noise(spec, strategy):
    # sp casts each rank's shard of the sequence with its own scale, cp each rank's tokens; moe-tiny's experts are
    # nn.Linear and run FP8, its routers (4 outputs, not a multiple of 16) stay bf16 (runtime.float8)
    assert_within_fp8_noise(merged(ranks(4), (spec, strategy)), single_fp8(spec))


def with_scaling(plan, scaling: str):
    return plan.model_copy(update={"training": plan.training.model_copy(update={"fp8_scaling": scaling})})


def assert_within_fp8_noise(result: dict, expected: dict) -> None:
    """``result`` (one process's, or ``merged`` over ranks: a list of losses per rank) trains like ``expected``
    within FP8's noise (module docstring)."""
    per_rank = result["losses"] if isinstance(result["losses"][0], list) else [result["losses"]]
    assert all(losses == per_rank[0] for losses in per_rank), "ranks disagree on the loss"
    torch.testing.assert_close(per_rank[0], expected["losses"], rtol=FP8_LOSS_RTOL, atol=0.0)
    assert relative_norm(result["grads"], expected["grads"]) < FP8_GRAD_NORM
    assert relative_norm(result["params"], expected["params"]) < FP8_PARAM_NORM


@pytest.mark.parametrize(("scaling", "fix"), [("delayed", "torchao removed delayed scaling"),
                                              ("mx", "mx scaling needs MX/blockwise FP8 kernels"),
                                              ("block", "block scaling needs MX/blockwise")])
def test_scalings_the_runtime_cannot_run_are_refused_in_one_line(scaling, fix):
    model = make_model(GPT)
    plan = with_scaling(make_plan(GPT, model, "dp=1", "fp8"), scaling)
    with pytest.raises(NotModelledError, match=f"fp8_scaling={scaling}: {fix}.*run fp8_scaling=current") as error:
        apply_plan(model, plan)
    assert "\n" not in str(error.value)


def test_without_torchao_fp8_is_refused_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what a missing package raises
    model = make_model(GPT)
    with pytest.raises(ConfigError, match=r"torchao is not installed .*pip install torchao==0\.18\.0"):
        apply_plan(model, make_plan(GPT, model, "dp=1", "fp8"))


def all_gathered_bytes(precision: str) -> tuple[set[int], set[int]]:
    """(the sizes in bytes of this rank's inputs to FSDP2's all-gathers over one ZeRO-3 step, the sizes of its
    units' shards were every converted linear's weight 1 byte per element and every other parameter bf16's 2), on
    2 ranks."""
    import torch.distributed as dist
    from torchao.float8.float8_linear import Float8Linear

    model = make_model(GPT, 1 + dist.get_rank())
    parallel = apply_plan(model, make_plan(GPT, model, "dp=2,zero=3,mbs=1", precision))
    fp8_weights = {id(module.weight) for module in model.modules() if isinstance(module, Float8Linear)}
    blocks = [model.get_submodule(fqn) for fqn in parallel.plan.block_fqns]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    units = [list(block.parameters()) for block in blocks] + [[p for p in model.parameters() if id(p) not in in_blocks]]
    expected = {sum(p.to_local().numel() * (1 if id(p) in fp8_weights else 2) for p in unit) for unit in units}
    fed, all_gather_single = set(), dist.all_gather_single

    def counted(output, tensor, *args, **kwargs):
        fed.add(tensor.numel() * tensor.element_size())
        return all_gather_single(output, tensor, *args, **kwargs)

    dist.all_gather_single = counted
    try:
        parallel.train_step(make_batches(GPT, 1)[0])
    finally:
        dist.all_gather_single = all_gather_single
    return fed, expected


def scales_around_a_step() -> tuple[int, int, int]:
    """(FP8-gathered weights, how many hold a scale after ``refresh_float8_scales``, how many still do after a
    ``train_step``), on 2 ranks under ZeRO-3."""
    import torch.distributed as dist

    from tessera.runtime.float8 import refresh_float8_scales

    model = make_model(GPT, 1 + dist.get_rank())
    parallel = apply_plan(model, make_plan(GPT, model, "dp=2,zero=3,mbs=1", "fp8"))
    weights = [p._local_tensor for p in model.parameters() if hasattr(p._local_tensor, "_precomputed_scale")]
    refresh_float8_scales(parallel.modules)
    held = sum(w._precomputed_scale is not None for w in weights)
    parallel.train_step(make_batches(GPT, 1)[0])
    return len(weights), held, sum(w._precomputed_scale is not None for w in weights)


def gathered_fp8_bytes() -> tuple[torch.Tensor, str]:
    """(an FP8 tensor gathered over 2 gloo ranks by ``ByteAllGather``, what gloo says to a plain FP8 all-gather)."""
    import torch.distributed as dist

    from tessera.runtime.float8 import ByteAllGather

    shard = torch.full((4,), 1.5 * (dist.get_rank() + 1)).to(torch.float8_e4m3fn)
    gathered = torch.empty(8, dtype=torch.float8_e4m3fn)
    ByteAllGather()(gathered, shard, dist.group.WORLD)
    try:
        dist.all_gather_single(torch.empty_like(gathered), shard)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return gathered.float(), refused


def test_zero3_gathers_the_blocks_fp8_weights_in_fp8_and_the_rest_in_bf16():
    # each unit's gather carries its converted linears' weights at 1 byte per element (gloo: as bytes,
    # runtime.float8.ByteAllGather), as Tessera's profile prices them (TESSERA.gathers_fp8); a bf16 plan gathers 2
    from tessera.runtime.launch import spawn

    runs = {precision: spawn(all_gathered_bytes, nprocs=2, args=(precision,), timeout_s=300,
                             crash_retries=1)
            for precision in ("fp8", "bf16")}
    for fed, expected in runs["fp8"] + runs["bf16"]:
        assert fed == expected


def test_gloo_refuses_fp8_all_gathers_and_byte_views_gather_them():
    from tessera.runtime.launch import spawn

    for gathered, refused in spawn(gathered_fp8_bytes, nprocs=2, timeout_s=120, crash_retries=1):
        assert gathered.tolist() == [1.5] * 4 + [3.0] * 4
        assert "Invalid scalar type" in refused  # why runtime.float8.ByteAllGather exists; gone: drop it


def test_each_step_computes_the_fp8_gathers_scales_first_and_drops_them_after():
    from tessera.runtime.launch import spawn

    for weights, held, left in spawn(scales_around_a_step, nprocs=2, timeout_s=300, crash_retries=1):
        assert weights > 0 and held == weights and left == 0


def fp8_zero3_resumed(root: str) -> tuple[list[float], list[float]]:
    """(losses of steps 3-4 of an FP8 ZeRO-3 run, the same after loading its step-2 checkpoint into a fresh model):
    its weights are torchao's FP8-gathering subclass inside FSDP2's DTensors."""
    import torch.distributed as dist

    batches = make_batches(GPT, 4)
    model = make_model(GPT, 1 + dist.get_rank())
    parallel = apply_plan(model, make_plan(GPT, model, "dp=2,zero=3,mbs=1", "fp8"))
    for batch in batches[:2]:
        parallel.train_step(batch)
    parallel.save(root).wait()
    uninterrupted = [parallel.train_step(batch) for batch in batches[2:]]
    fresh = make_model(GPT, 7 + dist.get_rank())
    resumed = apply_plan(fresh, make_plan(GPT, fresh, "dp=2,zero=3,mbs=1", "fp8"))
    resumed.load(root)
    return uninterrupted, [resumed.train_step(batch) for batch in batches[2:]]


def test_an_fp8_zero3_run_resumes_from_its_checkpoint_exactly(tmp_path):
    from tessera.runtime.launch import spawn

    for uninterrupted, resumed in spawn(fp8_zero3_resumed, nprocs=2, args=(str(tmp_path),), timeout_s=300):
        assert resumed == uninterrupted
