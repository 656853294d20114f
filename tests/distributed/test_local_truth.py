"""``benchmarks/local_truth.py``'s runner: strategies one after another on one set of gloo ranks, each
journaled as it finishes, a failing one recorded with its error, and a resumed run re-running nothing."""

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
