"""Expert parallelism: the MoE model trained with experts split over ``ep`` ranks (alone, with data parallelism
and ZeRO, with tensor parallelism) matches single-process training; the expert-parallel layer equals the
single-process layer where tokens are dropped; each rank holds only its experts; unsupported combinations are
refused by name.

Cases, the capacity-factor reasoning and tolerances: ``harness.py`` (``SPARSE_LONG_CASES``, ``MOE``); all
cases of one world size run in one spawn shared with ``test_context_parallel.py``.
"""

import pytest
import torch

from tessera.cost_models.types import Strategy
from tessera.errors import NotModelledError
from tessera.models import build_model
from tessera.runtime.expert_parallel import check_expert_parallel

from .harness import (
    FP32_TOL, GRAD_TOL, MOE, SPARSE_LONG_CASES, assert_matches_reference, merged, sparse_long_results,
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
        ep_rank = rank // parsed.tp % parsed.ep  # mesh (dp = edp x ep, pp, cp, tp): ep inside dp, tp innermost
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
        # Expert gradients: ep ranks' contributions summed in another order; x ep undoes an exact power of 2.
        torch.testing.assert_close(check["experts"], check["expert_sums"], **GRAD_TOL)
    assert all(check["dropped"] > 0 for check in checks), "capacity factor 1 must drop assignments on every rank"
    assert any(len(set(check["splits"])) > 1 for check in checks), "the all-to-all splits were all even"


def test_unsupported_combinations_are_refused_by_name():
    model = build_model(MOE)
    for strategy, named in [("dp=2,ep=2,pp=2", "pp"), ("dp=2,ep=2,cp=2", "cp"), ("dp=2,ep=2,tp=2,sp=true", "sp")]:
        with pytest.raises(NotModelledError, match=f"together with {named}"):
            check_expert_parallel(model, Strategy.parse(strategy), on_meta=False)
    with pytest.raises(NotModelledError, match="4 experts cannot be split evenly over ep=3"):
        check_expert_parallel(model, Strategy.parse("dp=3,ep=3"), on_meta=False)
    with pytest.raises(NotModelledError, match="no MoE layer"):
        check_expert_parallel(build_model("gpt-tiny"), Strategy.parse("dp=2,ep=2"), on_meta=False)
    with pytest.raises(NotModelledError, match="meta device"):
        check_expert_parallel(model, Strategy.parse("dp=2,ep=2"), on_meta=True)
