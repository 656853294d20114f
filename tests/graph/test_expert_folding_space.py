"""The search space's folded experts (``etp = 1 < tp``, ``planner.space``): offered only for models with routed
experts, for an ep larger than dp admits (unpinned) or every ep (pinned ``etp=1``), never where the runtime refuses
(``cost_models.folding``); a pinned folded search returns a plan the runtime accepts."""

from functools import cache

import pytest

from tessera.cost_models import TrainingConfig
from tessera.cost_models.folding import folding_refusal
from tessera.errors import ConfigError
from tessera.planner.capture import capture_preset
from tessera.planner.search import rank_candidates, search
from tessera.planner.space import check_pins, strategies
from tessera.topology import load_cluster

TRAINING = TrainingConfig(global_batch=8, seq_len=16, precision="fp32")
CLUSTER = "cpu:ranks=4"


@cache
def layers(spec: str):
    return list(capture_preset(spec, seq_len=TRAINING.seq_len).layers)


def test_folded_candidates_only_for_experts_and_only_what_the_runtime_runs():
    cluster = load_cluster(CLUSTER)
    folded = [s for s in strategies(layers("moe-tiny"), cluster, TRAINING, {}) if s.etp is not None]
    assert folded and all(s.etp == 1 and s.tp > 1 and s.dp % s.ep and folding_refusal(s) is None for s in folded)
    assert {(s.dp, s.tp, s.ep) for s in folded} == {(1, 2, 2), (2, 2, 4)}  # tp=4 cannot split its 2 kv heads
    assert not any(s.etp is not None for s in strategies(layers("llama-tiny"), cluster, TRAINING, {}))
    pinned = [s for s in strategies(layers("moe-tiny"), cluster, TRAINING, {"etp": 1, "tp": 2})]
    assert {(s.dp, s.ep) for s in pinned} == {(1, 2), (2, 2), (2, 4)}  # beside dp's own ep too: pinned


def test_a_pinned_folded_search_returns_a_folded_plan_and_bad_pins_are_refused_in_one_line():
    graph = capture_preset("moe-tiny", seq_len=TRAINING.seq_len)
    plan = search(graph, load_cluster(CLUSTER), TRAINING, pins={"tp": 2, "etp": 1, "ep": 4})
    assert (plan.strategy.etp, plan.strategy.ep, plan.strategy.dp) == (1, 4, 2)
    with pytest.raises(ConfigError, match="the runtime folds experts only to etp=1"):
        check_pins({"tp": 4, "etp": 2}, load_cluster(CLUSTER))
    with pytest.raises(ConfigError, match=r"ep=4 must divide dp \(or pin etp=1"):
        check_pins({"dp": 2, "ep": 4}, load_cluster(CLUSTER))


def test_another_frameworks_expert_tensor_parallel_degree_is_priced_as_given():
    from tessera.cost_models.profiles import MEGATRON

    graph = capture_preset("moe-tiny:kv_heads=4", seq_len=TRAINING.seq_len)  # tp=4 splits its key/value heads
    pins = {"dp": 2, "tp": 4, "ep": 2, "etp": 2, "zero": 0, "micro_batch": 1, "recompute": "none"}
    check_pins(pins, load_cluster("cpu:ranks=8"), runtime=False)  # Megatron-Core folds to any etp dividing tp
    (strategy, _), = rank_candidates(graph, load_cluster("cpu:ranks=8"), TRAINING, pins=pins, profile=MEGATRON)
    assert (strategy.tp, strategy.etp, strategy.ep) == (4, 2, 2)
    with pytest.raises(ConfigError, match="the runtime folds experts only to etp=1"):
        search(graph, load_cluster("cpu:ranks=8"), TRAINING, pins=pins)  # Tessera's runtime does not
