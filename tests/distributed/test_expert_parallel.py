"""Expert parallelism: the MoE model trained with experts split over ``ep`` ranks (alone, with data parallelism
and ZeRO, with tensor parallelism, with context parallelism, built on meta, in bf16) matches single-process
training; the expert-parallel layer equals the single-process layer where tokens are dropped; each rank holds
only its experts and the parameter bytes ``Strategy`` counts; unsupported combinations are refused by name.

Cases, the capacity-factor reasoning and tolerances: ``harness.py`` (``SPARSE_LONG_CASES``, ``MOE``); all
cases of one world size run in one spawn shared with ``test_context_parallel.py``.
"""

import pytest
import torch

from tessera.cost_models.types import LinearPair, Strategy
from tessera.errors import NotModelledError
from tessera.models import build_model
from tessera.planner.plan import PlannedLayer
from tessera.runtime.expert_parallel import check_expert_parallel
from tessera.runtime.tensor_parallel import find_linear_pairs, layer_styles

from .harness import (
    FP32_TOL, MOE, SPARSE_LONG_CASES, assert_matches_reference, merged, sparse_long_results,
)

pytestmark = pytest.mark.distributed

CASES = [(world, *case) for world, cases in SPARSE_LONG_CASES.items() for case in cases if case[0] == MOE]


def case_id(world, spec, strategy, precision, meta) -> str:
    return f"{world}ranks-{strategy}"


@pytest.mark.parametrize(("world", "spec", "strategy", "precision", "meta"), CASES, ids=[case_id(*c) for c in CASES])
def test_moe_training_matches_single_process(world, spec, strategy, precision, meta):
    # fp32 tolerances of the other strategies (harness.py): the all-to-alls move rows without arithmetic, the
    # experts run the same rows (in a different batch composition: matmul blocking may round differently), and
    # gradients are summed in a different order.
    result = merged(sparse_long_results(world), (spec, strategy, precision, meta))
    assert_matches_reference(result, spec, precision)


@pytest.mark.parametrize(("world", "spec", "strategy", "precision", "meta"), CASES, ids=[case_id(*c) for c in CASES])
def test_each_rank_holds_only_its_experts(world, spec, strategy, precision, meta):
    parsed = Strategy.parse(strategy)
    experts = build_model(spec, device="meta").config.experts
    per_rank = experts // parsed.ep
    for rank, results in enumerate(sparse_long_results(world)):
        names = results[(spec, strategy, precision, meta)]["params"]
        held = {int(name.split(".")[4]) for name in names if ".moe.experts." in name}
        ep_rank = rank // (parsed.tp * parsed.cp * parsed.pp) % parsed.ep  # mesh (edp, ep, pp, cp, tp): ep inside dp
        assert held == set(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)), (rank, sorted(held))


@pytest.mark.parametrize("world", sorted(SPARSE_LONG_CASES))
def test_expert_parallel_layer_matches_the_layer_on_the_same_tokens_where_tokens_drop(world):
    per_rank = sparse_long_results(world)
    if "spawn_error" in per_rank[0]:
        raise AssertionError(per_rank[0]["spawn_error"])
    checks = [results["expert_layer_check"] for results in per_rank]
    for check in checks:
        assert "error" not in check, check.get("error")
        # Outputs and token gradients: the same arithmetic on the same rows (fp32 rounding of reordered sums).
        torch.testing.assert_close(check["ours"], check["reference"], **FP32_TOL)
        # Expert gradients: the ep ranks' contributions summed in another order (x ep undoes an exact power of 2).
        # Random unit-scale inputs make these gradients ~100x the training ones, so the absolute part of the
        # tolerance scales with the largest: 1e-5 of it is ~100 float32 ulps, far below a wrong route or scale.
        for name, expected in check["expert_sums"].items():
            atol = 1e-5 * expected.abs().max().item()
            torch.testing.assert_close(check["experts"][name], expected, rtol=1e-5, atol=atol,
                                       msg=lambda message, name=name: f"{name}: {message}")
    assert all(check["dropped"] > 0 for check in checks), "capacity factor 1 must drop assignments on every rank"
    assert any(len(set(check["splits"])) > 1 for check in checks), "the all-to-all splits were all even"


def test_unsupported_combinations_are_refused_by_name():
    model = build_model(MOE)
    for strategy, named in [("dp=2,ep=2,pp=2", "pp"), ("dp=2,ep=2,tp=2,sp=true", "sp")]:
        with pytest.raises(NotModelledError, match=f"together with {named}"):
            check_expert_parallel(model, Strategy.parse(strategy))
    with pytest.raises(NotModelledError, match="together with selective recomputation"):
        check_expert_parallel(model, Strategy.parse("dp=2,ep=2"), selective_recompute=True)
    with pytest.raises(NotModelledError, match="4 experts cannot be split evenly over ep=3"):
        check_expert_parallel(model, Strategy.parse("dp=3,ep=3"))
    with pytest.raises(NotModelledError, match="no MoE layer"):
        check_expert_parallel(build_model("gpt-tiny"), Strategy.parse("dp=2,ep=2"))


def test_tensor_parallelism_keeps_the_router_whole_and_splits_experts_like_the_mlp():
    model = build_model(MOE, device="meta")
    pairs = find_linear_pairs(model.blocks[0])
    assert LinearPair(column=("moe.experts.3.gate", "moe.experts.3.up"), row="moe.experts.3.down", role="mlp") in pairs
    assert all("router" not in name for pair in pairs for name in (*pair.column, pair.row))
    block = PlannedLayer(fqn="blocks.0", kind="block", recompute="none")
    styles = layer_styles(model, block, tp=2, sp=False, pairs=None)
    assert "moe.router" not in styles and "moe.experts.0.down" in styles
    with pytest.raises(NotModelledError, match="sequence parallelism through the mixture-of-experts layer"):
        layer_styles(model, block, tp=2, sp=True, pairs=None)


def predicted_parameter_bytes(spec: str, strategy: Strategy) -> float:
    """fp32 bytes of one rank's parameters as ``Strategy`` counts them: experts divided by ``ep``; everything
    tensor parallelism splits (not norms or routers) by ``tp``; under ZeRO-3 dense parameters by ``dp * cp`` and
    expert parameters by ``edp * cp`` (``edp = dp / ep``: the ranks that hold the same experts)."""
    total = 0.0
    for name, param in build_model(spec, device="meta").named_parameters():
        count = param.numel() / (1 if "norm" in name or "router" in name else strategy.tp)
        if ".moe.experts." in name:
            total += count / strategy.ep / (strategy.expert_dp * strategy.cp if strategy.zero == 3 else 1)
        else:
            total += count / (strategy.dp * strategy.cp if strategy.zero == 3 else 1)
    return total * 4


@pytest.mark.parametrize(("world", "spec", "strategy", "precision", "meta"), CASES, ids=[case_id(*c) for c in CASES])
def test_each_rank_holds_the_predicted_parameter_bytes(world, spec, strategy, precision, meta):
    # Measured right after each forward (harness.track_parameter_bytes); FSDP2 pads each shard's dim 0 (2%).
    predicted = predicted_parameter_bytes(spec, Strategy.parse(strategy))
    for rank, results in enumerate(sparse_long_results(world)):
        measured = results[(spec, strategy, precision, meta)]["param_bytes"]
        assert measured == pytest.approx(predicted, rel=0.02), f"rank {rank}: {measured} bytes, predicted {predicted}"
