"""The bound-ordered, pruned search finds exactly the strategy an exhaustive enumeration finds."""

from __future__ import annotations

import pytest

from tessera.api import _prepare
from tessera.cost_models import estimate
from tessera.cost_models.estimate import step_time_lower_bound
from tessera.cost_models.profiles import TESSERA
from tessera.planner.search import RECOMPUTE_COST, _dense_and_expert_params, _state_bytes_lower_bound, rank_candidates
from tessera.planner.space import strategies

CASES = [
    ("gpt-tiny", "cpu:ranks=4", 8, 64),
    ("gpt3-13b", "dgx-a100:nodes=4", 256, 2048),
    ("llama3-8b:layers=8", "dgx-h100:nodes=2", 128, 4096),
    # Mixture of experts: ep in the space, and the bound includes the expert all-to-alls.
    ("mixtral-8x7b:layers=4", "dgx-h100:nodes=2", 64, 4096),
]


@pytest.mark.parametrize("model,cluster,batch,seq", CASES)
def test_pruned_search_equals_exhaustive(model, cluster, batch, seq):
    graph, resolved, training = _prepare(model, cluster, global_batch=batch, seq_len=seq, precision=None)
    layers = list(graph.layers)
    everything = [(s, estimate(layers, resolved, training, s)) for s in strategies(layers, resolved, training, {})]
    fitting = sorted((pair for pair in everything if pair[1].fits),
                     key=lambda pair: (pair[1].step_time_s, pair[1].peak_memory_bytes, pair[0].to_string()))
    ranked = rank_candidates(graph, resolved, training)
    best = next(pair for pair in ranked if pair[1].fits)
    assert best[0] == fitting[0][0]
    assert len(ranked) < len(everything)  # the pruning did prune
    # The bounds are bounds: never above the estimate they bound (the memory one prunes what cannot fit).
    params = _dense_and_expert_params(layers)
    for strategy, est in everything:
        assert step_time_lower_bound(layers, resolved, training, strategy) <= est.step_time_s * (1 + 1e-12)
        assert _state_bytes_lower_bound(params, strategy, TESSERA) <= est.peak_memory_bytes, strategy.to_string()
    # Kept exact for the runners-up: every fitting strategy faster than the 6th fastest found was estimated, unless the
    # same one with less recomputation fits (recomputing more never runs faster: pruned as a runner-up too).
    reached = {"bound": float("inf")}
    kept = rank_candidates(graph, resolved, training, keep=6, reached=reached)
    sixth = sorted(e.step_time_s for _, e in kept if e.fits)[:6][-1]
    assert reached["bound"] >= sixth  # the enumeration went on past the sixth fastest
    fits = {s for s, e in fitting}
    estimated = {s for s, _ in kept}

    def lighter_fits(s):
        return any(s.model_copy(update={"recompute": r}) in fits for r, cost in RECOMPUTE_COST.items()
                   if cost < RECOMPUTE_COST[s.recompute])

    assert not [s for s, e in fitting if e.step_time_s < sixth and s not in estimated and not lighter_fits(s)]
    assert next(s for s, e in kept if e.fits) == best[0]  # the same plan


def test_communication_bounds_are_below_what_estimate_charges():
    """The all-to-all and tensor-parallel parts of the bound: positive under ep (tp), never above the stages'
    summed ep_comm (tp_comm)."""
    from tessera.cost_models.communication import tp_comm_s
    from tessera.cost_models.estimate import _ep_comm_lower_bound_s, _tp_comm_lower_bound_s
    from tessera.cost_models.partition import block_policies, split_blocks, stage_totals
    from tessera.cost_models.sparse import ep_comm_s

    graph, resolved, training = _prepare("mixtral-8x7b:layers=4", "dgx-h100:nodes=2", global_batch=64, seq_len=4096,
                                         precision=None)
    layers = list(graph.layers)
    checked = {"ep": 0, "tp": 0}
    for strategy in strategies(layers, resolved, training, {}):
        policies = block_policies(layers, strategy)
        stages = [stage_totals(stage, i, policies) for i, stage in enumerate(split_blocks(layers, strategy))]
        whole = stage_totals(layers, 0, policies)
        if strategy.ep > 1:
            bound = _ep_comm_lower_bound_s(layers, resolved, strategy, whole)
            assert 0 < bound <= sum(ep_comm_s(stage, resolved, strategy) for stage in stages)
            checked["ep"] += 1
        if strategy.tp > 1:
            for overlap in (False, True):
                variant = strategy.model_copy(update={"tp_overlap": overlap})
                bound = _tp_comm_lower_bound_s(whole, resolved, variant)
                assert 0 < bound <= sum(tp_comm_s(stage, resolved, training, variant) for stage in stages)
            checked["tp"] += 1
    assert checked["ep"] and checked["tp"]


def test_the_bound_holds_for_a_framework_that_hides_or_thins_its_all_to_alls():
    """Under a profile that overlaps the expert all-to-alls (``ep_overlap``) or sends a token once per node
    (``ep_dispatch``), the estimate charges less than the per-copy, in-line all-to-alls the default bound counts: the
    bound as that profile runs leaves them out, and stays below every estimate."""
    from dataclasses import replace

    from tessera.cost_models.profiles import MEGATRON

    graph, resolved, training = _prepare("mixtral-8x7b:layers=4", "dgx-h100:nodes=2", global_batch=64, seq_len=4096,
                                         precision=None)
    layers = list(graph.layers)
    moe = [s for s in strategies(layers, resolved, training, {}) if s.ep > 1]
    assert moe
    for profile in (replace(MEGATRON, ep_overlap=True), replace(MEGATRON, ep_dispatch="per-node")):
        above = 0  # strategies the in-line, per-copy bound would have pruned wrongly
        for strategy in moe:
            step = estimate(layers, resolved, training, strategy, profile=profile).step_time_s
            assert step_time_lower_bound(layers, resolved, training, strategy, profile=profile) <= step * (1 + 1e-12)
            above += step_time_lower_bound(layers, resolved, training, strategy) > step
        assert above or not profile.ep_overlap  # (a per-node dispatch of Mixtral's 8 experts saves too little here)


def test_candidates_nothing_fits_do_not_use_up_the_refinement(monkeypatch):
    """GPT-3 175B on 1024 A100s, outer candidates that nothing fits (ZeRO-0 replicas: the integer program proves each
    infeasible at once) ranked ahead of a ZeRO-3 one whose per-block recomputation wins. Counted against
    ``MAX_SOLVES`` they would starve the refinement before it reaches that candidate; counted apart, it gets there,
    and the plan can only be faster (the keys refined are a superset, in the same order)."""
    from tessera.cost_models import Strategy
    from tessera.planner import refine

    graph, cluster, training = _prepare("gpt3-175b", "dgx-a100:nodes=128", global_batch=1536, seq_len=2048, precision=None)
    layers = list(graph.layers)
    hopeless = ["dp=512,tp=2,zero=0,mbs=1,sp=true", "dp=256,tp=4,zero=0,mbs=1,sp=true", "dp=128,tp=8,zero=0,mbs=1,sp=true"]
    candidates = [Strategy.parse(text) for text in [*hopeless, "dp=256,tp=4,zero=3,mbs=3,sp=true,recompute=full"]]
    scored = [(s, estimate(layers, cluster, training, s)) for s in candidates]
    assert [e.fits for _, e in scored] == [False, False, False, True]

    def refined(max_infeasible: int):
        monkeypatch.setattr(refine, "MAX_SOLVES", 1)
        monkeypatch.setattr(refine, "MAX_INFEASIBLE", max_infeasible)
        stats = refine.RefineStats()
        return refine.refine(layers, cluster, training, scored, policies=("none", "full"), stats=stats), stats

    found, stats = refined(refine.MAX_INFEASIBLE)
    starved, _ = refined(1)
    assert stats.infeasible >= len(hopeless) and found and not starved
    assert min(e.step_time_s for _, e in found) < scored[-1][1].step_time_s


def test_an_integer_programs_answer_is_lightened_where_its_linear_memory_model_overstates_the_mix():
    """A dense block and three MoE blocks on 4 CPU ranks at 275 MiB per rank: the mixed program's linear memory
    model (per-kind slopes) overstates what two unrecomputed blocks hold, so it answered one block without
    recomputation and three recomputed (slower than the best uniform plan when measured at 279 MiB, before the
    memory model stopped stacking the loss's temporaries on a recomputed block). The exact estimate fits two of each,
    faster than either; the search now finds that plan."""
    from tessera.cost_models import Strategy
    from tessera.planner.lighten import lighten
    from tessera.planner.search import best_candidate, search

    spec = "moe:layers=4,hidden=128,heads=4,kv_heads=2,ffn=128,vocab=2048,seq=256,experts=4,top_k=2,dense_layers=1,dense_ffn=512"
    graph, cluster, training = _prepare(spec, "cpu:ranks=4", global_batch=16, seq_len=256, precision=None)
    tight = cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": 275 * 2**20})})
    layers = list(graph.layers)
    heavy = Strategy.parse("dp=4,zero=3,mbs=1,block_recompute=1xnone/3xfull")
    lightened, est = lighten(layers, tight, training, (heavy, estimate(layers, tight, training, heavy)), policies=("none", "full"))
    assert est.fits and est.step_time_s < estimate(layers, tight, training, heavy).step_time_s
    assert [lightened.recompute_of_block(i) for i in range(4)].count("none") == 2
    plan = search(graph, tight, training)
    uniform = best_candidate(rank_candidates(graph, tight, training))
    assert plan.strategy.block_recompute and plan.estimate.step_time_s < uniform[1].step_time_s
