"""Expert parallelism: the MoE model trained with experts split over ``ep`` ranks (alone, with data parallelism
and ZeRO, with tensor parallelism, with context parallelism, with pipeline parallelism, built on meta, in bf16)
matches single-process training; the expert-parallel layer equals the single-process layer where tokens are
dropped; each rank holds only its experts and the parameter bytes ``Strategy`` counts; the runtime's mesh puts
every rank where ``Strategy``'s layout formula says; unsupported combinations are refused by name.

Cases, the capacity-factor reasoning and tolerances: ``harness.py`` (``SPARSE_LONG_CASES``, ``MOE``); all
cases of one world size run in one spawn shared with ``test_context_parallel.py``.
"""

import itertools
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from tessera.cost_models.layer_stats import LinearPair
from tessera.cost_models.types import Strategy
from tessera.errors import NotModelledError
from tessera.models import build_model
from tessera.planner.plan import PlannedLayer
from tessera.runtime.expert_parallel import check_expert_parallel
from tessera.runtime.mesh import AXES, DP, build_mesh, data_mesh, expert_data_mesh
from tessera.runtime.tensor_parallel import find_linear_pairs, layer_styles

from .harness import (
    FP32_TOL, MOE, SPARSE_LONG_CASES, assert_matches_reference, make_plan, merged, sparse_long_results,
)

pytestmark = pytest.mark.distributed

CASES = [(world, *case) for world, cases in SPARSE_LONG_CASES.items() for case in cases if case[0] == MOE]


def case_id(world, spec, strategy, precision, meta) -> str:
    return f"{world}ranks-{strategy}"


def layout_rank(strategy: Strategy, edp: int, pp: int, ep: int, cp: int, tp: int) -> int:
    """``Strategy``'s mesh convention (cost_models/types.py), written out independently of the runtime."""
    return (((edp * strategy.pp + pp) * strategy.ep + ep) * strategy.cp + cp) * strategy.tp + tp


def layout_coordinates(strategy: Strategy, rank: int) -> dict[str, int]:
    """``(edp, pp, ep, cp, tp)`` indices of ``rank`` under ``Strategy``'s convention."""
    sizes = dict(zip(AXES, (strategy.expert_dp, strategy.pp, strategy.ep, strategy.cp, strategy.tp)))
    for index in itertools.product(*(range(size) for size in sizes.values())):
        if layout_rank(strategy, *index) == rank:
            return dict(zip(AXES, index))
    raise AssertionError(f"rank {rank} is outside {strategy.to_string()}")


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
        ep_rank = layout_coordinates(parsed, rank)["ep"]
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
    with pytest.raises(NotModelledError, match="together with sp"):
        check_expert_parallel(model, Strategy.parse("dp=2,ep=2,tp=2,sp=true"))
    check_expert_parallel(model, Strategy.parse("dp=2,ep=2,pp=2"))  # pipelining composes (trained above)
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


def predicted_parameter_bytes(spec: str, strategy: Strategy, pp_rank: int = 0) -> float:
    """fp32 bytes of one rank's parameters as ``Strategy`` counts them: the layers of its pipeline stage only;
    experts divided by ``ep``; everything tensor parallelism splits (not norms or routers) by ``tp``; under
    ZeRO-3 dense parameters by ``dp * cp`` and expert parameters by ``edp * cp`` (``edp = dp / ep``: the ranks
    that hold the same experts)."""
    model = build_model(spec, device="meta")
    plan = make_plan(spec, model, strategy.to_string())
    stage = tuple(f"{layer.fqn}." for layer in plan.layers if layer.chunk % strategy.pp == pp_rank)
    total = 0.0
    for name, param in model.named_parameters():
        if not name.startswith(stage):
            continue
        count = param.numel() / (1 if "norm" in name or "router" in name else strategy.tp)
        if ".moe.experts." in name:
            total += count / strategy.ep / (strategy.expert_dp * strategy.cp if strategy.zero == 3 else 1)
        else:
            total += count / (strategy.dp * strategy.cp if strategy.zero == 3 else 1)
    return total * 4


@pytest.mark.parametrize(("world", "spec", "strategy", "precision", "meta"), CASES, ids=[case_id(*c) for c in CASES])
def test_each_rank_holds_the_predicted_parameter_bytes(world, spec, strategy, precision, meta):
    # Measured right after each forward (harness.track_parameter_bytes); FSDP2 pads each shard's dim 0 (2%).
    parsed = Strategy.parse(strategy)
    for rank, results in enumerate(sparse_long_results(world)):
        predicted = predicted_parameter_bytes(spec, parsed, layout_coordinates(parsed, rank)["pp"])
        measured = results[(spec, strategy, precision, meta)]["param_bytes"]
        assert measured == pytest.approx(predicted, rel=0.02), f"rank {rank}: {measured} bytes, predicted {predicted}"


@contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as ``rank`` of a ``world_size`` world of torch's fake backend (no peers, collectives no-ops)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# dp=2,ep=2,pp=2: the trained case above; dp=8,ep=8,pp=4: the planner's mixtral-8x7b plan on 4 DGX-H100 nodes
# (32 ranks; pipeline neighbours 8 apart, each ep group one node); every axis > 1 at once; pp=1 (the old layout).
LAYOUTS = ["dp=2,ep=2,pp=2", "dp=8,ep=8,pp=4", "dp=4,ep=2,pp=2,cp=2,tp=2", "dp=4,ep=2,cp=2,tp=2", "dp=2,pp=2,tp=2"]


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_mesh_puts_every_rank_where_the_cost_models_layout_says(strategy):
    # Built for each rank of a fake world in this process: every axis group, the data-parallel group (edp x ep),
    # the dense (dp x cp) and expert (edp x cp) data groups, in rank order, and each rank's index on each axis.
    parsed = Strategy.parse(strategy)
    sizes = dict(zip(AXES, (parsed.expert_dp, parsed.pp, parsed.ep, parsed.cp, parsed.tp)))
    varying = {**{axis: (axis,) for axis in AXES}, DP: ("edp", "ep"), "data": ("edp", "ep", "cp"),
               "expert_data": ("edp", "cp")}
    for rank in range(parsed.world_size):
        mine = layout_coordinates(parsed, rank)
        expected = {
            name: [layout_rank(parsed, **{**mine, **dict(zip(axes, index))})
                   for index in itertools.product(*(range(sizes[axis]) for axis in axes))]
            for name, axes in varying.items()
        }
        with fake_rank(rank, parsed.world_size):
            mesh = build_mesh(parsed)
            groups = {name: mesh.get_group(name) for name in (*AXES, DP)}
            groups |= {"data": data_mesh(mesh).get_group(), "expert_data": expert_data_mesh(mesh).get_group()}
            found = {name: dist.get_process_group_ranks(group) for name, group in groups.items()}
            local = {axis: mesh.get_local_rank(axis) for axis in AXES}
            dp_rank = mesh.get_local_rank(DP)
        assert found == expected, f"rank {rank} of {strategy}"
        assert local == mine, f"rank {rank} of {strategy}"
        assert dp_rank == mine["edp"] * parsed.ep + mine["ep"]  # the rows of the batch it trains on
