"""``benchmarks/local_truth.py``'s runner: strategies one after another on one set of gloo ranks, each
journaled as it finishes, a failing one recorded with its error, and a resumed run re-running nothing."""

import json
import sys
from pathlib import Path

import pytest

from tessera.cost_models.types import Strategy

pytestmark = pytest.mark.distributed

TINY_GPT = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=256"
RUNS = "dp=2,zero=0,mbs=4,recompute=none"
REFUSED = "dp=1,tp=2,zero=0,mbs=4,recompute=none,sp=true,tp_overlap=true"  # a cost-model-only option
RUNS_AFTER_FAILURE = "dp=1,pp=2,zero=0,mbs=4,recompute=none,schedule=1f1b"


@pytest.fixture
def local_truth():
    """``benchmarks/`` is scripts, not a package; spawned ranks import the module by name, so it must be
    importable (the script puts its own folder on ``sys.path``, which the ranks inherit)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import local_truth

    yield local_truth
    sys.path.remove(str(Path(__file__).parents[2] / "benchmarks"))


def test_strategies_are_journaled_one_by_one_and_a_failure_does_not_stop_the_rest(local_truth, tmp_path, monkeypatch):
    model = local_truth.prepared(TINY_GPT, "cpu:ranks=2")
    plans = [local_truth.as_plan(TINY_GPT, model, Strategy.parse(s)) for s in (RUNS, REFUSED, RUNS_AFTER_FAILURE)]
    keys = [plan.strategy.to_string() for plan in plans]
    journal = tmp_path / "journal.jsonl"

    measured, failed = local_truth.measure("tiny", TINY_GPT, plans, 2, 2, journal)

    assert set(measured) == {keys[0], keys[2]}
    for result in measured.values():
        assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])
        assert len(result["peak_bytes"]) == 2 and min(result["peak_bytes"]) > 0
    assert len(failed) == 1 and failed[0].startswith(keys[1]) and "tp_overlap" in failed[0]
    assert len(journal.read_text().splitlines()) == 3  # one line per strategy, the failure included

    def no_spawn(*args, **kwargs):
        raise AssertionError("a resumed run with every strategy journaled must not start ranks")

    monkeypatch.setattr(local_truth, "spawn", no_spawn)
    assert local_truth.measure("tiny", TINY_GPT, plans, 2, 2, journal) == (measured, failed)
    assert local_truth.journaled(journal, "another-model") == {}


def test_finalists_are_rerun_in_rounds_and_a_resumed_confirmation_reruns_nothing(local_truth, tmp_path, monkeypatch):
    model = local_truth.prepared(TINY_GPT, "cpu:ranks=2")
    plans = [local_truth.as_plan(TINY_GPT, model, Strategy.parse(s)) for s in (RUNS, RUNS_AFTER_FAILURE)]
    keys = [plan.strategy.to_string() for plan in plans]
    journal = tmp_path / "journal.jsonl"

    confirmed = local_truth.confirm("tiny", TINY_GPT, plans, 2, 2, 2, journal)

    assert set(confirmed) == set(keys)
    assert all(len(steps) == 4 and min(steps) > 0 for steps in confirmed.values())  # 2 rounds x 2 timed steps
    ran = [json.loads(line)["strategy"] for line in journal.read_text().splitlines()]
    assert ran == [keys[0], keys[1], keys[0], keys[1]]  # round-robin, not one strategy's rounds back to back
    assert local_truth.journaled(journal, "tiny") == {}  # re-runs are not the sweep's measurements

    def no_spawn(*args, **kwargs):
        raise AssertionError("a confirmation with every round journaled must not start ranks")

    monkeypatch.setattr(local_truth, "spawn", no_spawn)
    assert local_truth.confirm("tiny", TINY_GPT, plans, 2, 2, 2, journal) == confirmed


def test_regret_is_the_choices_median_over_the_fastest_finalists(local_truth):
    rows = [("a", 1.0, 1.3, 0, 0), ("b", 1.1, 0.9, 0, 0), ("c", 1.2, 1.0, 0, 0), ("d", 1.3, 1.1, 0, 0)]
    assert local_truth.finalists(rows, 2) == ["a", "b", "c"]  # the predicted fastest, then the sweep's fastest

    text = local_truth.confirmed_regret("a", {"a": [1.1, 1.0, 5.0], "b": [0.9, 1.0, 1.1], "c": [1.2, 1.2, 1.2]})
    assert text.startswith("regret 1.10 over the 3 finalists") and "fastest b" in text
    assert "not confirmed" in local_truth.confirmed_regret("a", {"b": [1.0], "c": [1.0]})
