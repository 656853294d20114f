"""The integer program against brute force, and its use inside the search."""

import itertools

import pytest

from tessera.cost_models import Strategy
from tessera.planner.ilp import StageCoefficients, optimal_pace_s, solve
from tessera.planner.refine import materialise

GiB = 2**30


def brute_force(stages, *, blocks, budget):
    """Smallest pace over every assignment of (policy counts) per stage: exhaustive, tiny cases only."""
    policies = list(stages[0].time_per_block_s)
    best = None
    per_stage = [c for c in itertools.product(range(blocks + 1), repeat=len(policies))]
    for choice in itertools.product(per_stage, repeat=len(stages)):
        if sum(map(sum, choice)) != blocks or any(sum(c) == 0 for c in choice):
            continue
        memory_ok = all(
            st.base_memory_bytes + sum(st.memory_per_block_bytes[p] * n for p, n in zip(policies, c)) <= budget
            for st, c in zip(stages, choice)
        )
        if memory_ok:
            pace = max(st.base_time_s + sum(st.time_per_block_s[p] * n for p, n in zip(policies, c)) for st, c in zip(stages, choice))
            best = pace if best is None else min(best, pace)
    return best


def stage(base_time, base_memory, *, none=(1.0, 10.0), full=(1.35, 2.0)):
    return StageCoefficients(
        base_time_s=base_time, base_memory_bytes=base_memory * GiB,
        time_per_block_s={"none": none[0], "full": full[0]}, memory_per_block_bytes={"none": none[1] * GiB, "full": full[1] * GiB},
    )


@pytest.mark.parametrize(
    ("stages", "blocks", "budget"),
    [
        ([stage(0.5, 10), stage(0.0, 5), stage(1.5, 20)], 6, 40),
        ([stage(0.2, 30), stage(0.9, 8)], 7, 45),
        ([stage(0.0, 0), stage(0.0, 0), stage(0.0, 0)], 8, 25),
        ([stage(2.0, 60), stage(0.0, 1)], 5, 70),
    ],
)
def test_ilp_matches_brute_force(stages, blocks, budget):
    expected = brute_force(stages, blocks=blocks, budget=budget * GiB)
    result = solve(stages, blocks=blocks, budget_bytes=budget * GiB)
    assert result is not None and expected is not None
    assert result.pace_s == pytest.approx(expected, abs=2e-6)  # time is solved in integer microseconds
    assert result.status == "OPTIMAL" and result.gap == 0
    assert optimal_pace_s(stages, blocks=blocks, budget_bytes=budget * GiB) == pytest.approx(expected, abs=2e-6)


def three_policy_stage(base_time, base_memory):
    return StageCoefficients(
        base_time_s=base_time, base_memory_bytes=base_memory * GiB,
        time_per_block_s={"none": 1.0, "selective": 1.08, "full": 1.35},
        memory_per_block_bytes={"none": 10.0 * GiB, "selective": 5.5 * GiB, "full": 2.0 * GiB},
    )


@pytest.mark.parametrize(
    ("stages", "blocks", "budget"),
    [
        ([three_policy_stage(0.5, 10), three_policy_stage(0.0, 5), three_policy_stage(1.5, 20)], 5, 38),
        ([three_policy_stage(0.2, 30), three_policy_stage(0.9, 8)], 6, 50),
    ],
)
def test_ilp_matches_brute_force_with_selective_recomputation(stages, blocks, budget):
    expected = brute_force(stages, blocks=blocks, budget=budget * GiB)
    result = solve(stages, blocks=blocks, budget_bytes=budget * GiB)
    assert result is not None and result.pace_s == pytest.approx(expected, abs=2e-6)
    assert sum(sum(mix.values()) for mix in result.blocks) == blocks
    assert optimal_pace_s(stages, blocks=blocks, budget_bytes=budget * GiB) == pytest.approx(expected, abs=2e-6)


def test_ilp_honours_an_outside_pace_cut():
    stages = [stage(0.5, 10), stage(0.0, 5)]
    optimum = solve(stages, blocks=6, budget_bytes=40 * GiB).pace_s
    assert solve(stages, blocks=6, budget_bytes=40 * GiB, pace_limit_s=optimum * 0.99) is None
    assert solve(stages, blocks=6, budget_bytes=40 * GiB, pace_limit_s=optimum * 1.01).pace_s == pytest.approx(optimum)


def test_ilp_reports_infeasible():
    assert solve([stage(0.0, 50), stage(0.0, 50)], blocks=4, budget_bytes=40 * GiB) is None
    assert optimal_pace_s([stage(0.0, 50), stage(0.0, 50)], blocks=4, budget_bytes=40 * GiB) is None


def test_ilp_recomputes_only_as_many_blocks_as_memory_needs():
    # One stage, 10 blocks: all "none" needs 100 GiB; budget 60 -> recompute exactly ceil((100-60)/8) = 5 blocks.
    result = solve([stage(0.0, 0)], blocks=10, budget_bytes=60 * GiB)
    assert result.blocks == ({"none": 5, "full": 5},)


def test_materialise_orders_policies_and_keeps_uniform_plans_simple():
    key = Strategy.parse("dp=1,pp=2")
    mixed = materialise(key, [{"full": 2, "none": 1}, {"none": 3, "full": 0}], blocks=6)
    assert mixed.block_recompute == ("full", "full", "none", "none", "none", "none")
    assert mixed.chunk_blocks == ()  # 3/3 is the even split
    uniform = materialise(key, [{"full": 4, "none": 0}, {"full": 2, "none": 0}], blocks=6)
    assert uniform.recompute == "full" and uniform.block_recompute == () and uniform.chunk_blocks == (4, 2)
