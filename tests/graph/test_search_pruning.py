"""The bound-ordered, pruned search finds exactly the strategy an exhaustive enumeration finds."""

from __future__ import annotations

import pytest

from tessera.api import _prepare
from tessera.cost_models import estimate
from tessera.cost_models.estimate import step_time_lower_bound
from tessera.planner.search import rank_candidates
from tessera.planner.space import strategies

CASES = [
    ("gpt-tiny", "cpu:ranks=4", 8, 64),
    ("gpt3-13b", "dgx-a100:nodes=4", 256, 2048),
    ("llama3-8b:layers=8", "dgx-h100:nodes=2", 128, 4096),
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
    # The bound is a bound: never above the estimate it bounds.
    for strategy, est in everything:
        assert step_time_lower_bound(layers, resolved, training, strategy) <= est.step_time_s * (1 + 1e-12)
