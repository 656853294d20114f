"""Tensor (+ sequence), pipeline (every schedule) and their compositions with data parallelism, recomputation,
meta materialisation and ``torch.compile`` match single-process training; each rank holds only its share
of the parameters.

Cases and tolerances: ``harness.py``; all cases of one world size run in one spawn shared with
``test_data_parallel.py``.
"""

import pytest
import torch

from tessera.cost_models.types import Strategy
from tessera.models import build_model
from tessera.planner.plan import Plan

from .extras import COMPILE_MODEL, COMPILE_STEPS, PINNED
from .harness import (
    DATA_PARALLEL_CASES, FP32_TOL, LLAMA, MODEL_PARALLEL_CASES, assert_matches_reference, extra_results, make_plan,
    merged, reference, world_results,
)

pytestmark = pytest.mark.distributed

CASES = [(world, *case) for world, cases in MODEL_PARALLEL_CASES.items() for case in cases]
ALL_CASES = CASES + [(world, *case) for world, cases in DATA_PARALLEL_CASES.items() for case in cases]
FP32 = 4
SHARDED_KINDS = ("embedding", "block", "head")  # what the cost model divides by tp (cost_models.partition)


def case_id(world, spec, strategy, precision, meta) -> str:
    return f"{spec.split('-')[0]}-{strategy}-{precision}{'-meta' if meta else ''}"


@pytest.mark.parametrize(("world", "spec", "strategy", "precision", "meta"), CASES, ids=[case_id(*c) for c in CASES])
def test_matches_single_process_training(world, spec, strategy, precision, meta):
    result = merged(world_results(world), (spec, strategy, precision, meta))
    assert_matches_reference(result, spec, precision)


def predicted_parameter_bytes(plan: Plan, model: torch.nn.Module, pp_rank: int) -> float:
    """The cost model's arithmetic (cost_models/memory.py): fp32 parameters of the rank's chunks, blocks,
    embeddings and head divided by tp, everything divided by dp under ZeRO-3."""
    strategy = plan.strategy
    total = 0.0
    for layer in plan.layers:
        if layer.kind == "loss" or layer.chunk % strategy.pp != pp_rank:
            continue
        count = sum(p.numel() for p in model.get_submodule(layer.fqn).parameters())
        total += count / (strategy.tp if layer.kind in SHARDED_KINDS else 1)
    return total * FP32 / (strategy.dp if strategy.zero == 3 else 1)


@pytest.mark.parametrize(("world", "spec", "strategy", "precision", "meta"), ALL_CASES,
                         ids=[case_id(*c) for c in ALL_CASES])
def test_each_rank_holds_the_predicted_parameter_bytes(world, spec, strategy, precision, meta):
    # Measured right after each forward: FSDP2 keeps ZeRO-1/2 parameters gathered (unsharded) from forward
    # to backward, and ZeRO-3 parameters sharded. The runtime keeps norms and row-parallel biases whole where
    # the cost model divides every block parameter by tp (<1% of a block here), and FSDP2 rounds each
    # parameter's shard up (dim 0 split in dp pieces), hence 2%.
    result = merged(world_results(world), (spec, strategy, precision, meta))
    model = build_model(spec, device="meta")
    plan = make_plan(spec, model, strategy, precision)
    parsed = Strategy.parse(strategy)
    for rank, measured in enumerate(result["param_bytes"]):
        pp_rank = rank // parsed.tp % parsed.pp  # mesh ("dp", "pp", "tp"), tp innermost
        predicted = predicted_parameter_bytes(plan, model, pp_rank)
        assert measured == pytest.approx(predicted, rel=0.02), f"rank {rank}: {measured} bytes, predicted {predicted}"


def test_auto_parallelize_pinned_strategy_matches_reference_and_the_plans_memory_estimate():
    # auto_parallelize with a full strategy string: the planner's Plan applied as is (FSDP x TP x SP,
    # selective recomputation), the preset built on meta; each rank's parameters equal the estimate's.
    per_rank = extra_results(4, "auto_pinned")
    for result in per_rank:
        torch.testing.assert_close(result["losses"], reference(LLAMA)[0], **FP32_TOL)
        predicted = result["estimate"]["parameters"]
        assert result["param_bytes"] == pytest.approx(predicted, rel=0.02), (PINNED, result["param_bytes"], predicted)


def test_compiled_blocks_match_eager_training():
    per_rank = extra_results(2, "compiled_blocks")
    for losses in per_rank:
        torch.testing.assert_close(losses, reference(COMPILE_MODEL, COMPILE_STEPS)[0], **FP32_TOL)


def test_hugging_face_llama_splits_from_its_module_tree_and_matches_reference():
    # transformers' LlamaForCausalLM (q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj, LlamaRMSNorm,
    # attention called with hidden_states= keyword) under tp=2 with sequence parallelism.
    pytest.importorskip("transformers")
    from .extras import HF_STEPS, hf_llama, hf_loss
    from .harness import LR, make_batches

    model = hf_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    expected = []
    for inputs, targets in make_batches(LLAMA, HF_STEPS):
        loss = hf_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for losses in extra_results(2, "hf_llama_tensor_parallel"):
        torch.testing.assert_close(losses, expected, **FP32_TOL)
