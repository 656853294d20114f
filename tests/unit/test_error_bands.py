"""Error bands: the spread of published / predicted step time on held-out published runs, per regime."""

import json

import pytest

import tessera
from tessera.cost_models import Strategy
from tessera.cost_models import error_bands as eb
from tessera.planner.plan_facts import band_sentence, runners_up_inside_band


def test_the_band_is_the_tenth_and_ninetieth_percentile_of_the_ratios():
    band = eb.band_from_ratios("fsdp", [0.8 + 0.04 * i for i in range(11)])  # 0.80, 0.84, ..., 1.20
    assert (band.runs, band.low, band.high) == (11, pytest.approx(0.84), pytest.approx(1.16))
    assert band.range_s(10.0) == (pytest.approx(8.4), pytest.approx(11.6))
    assert band.describe(10.0) == "8.400 to 11.600 s (80% of 11 held-out FSDP (ZeRO-3) published runs)"


def test_written_bands_read_back_and_a_regime_without_runs_takes_all_of_them(tmp_path, monkeypatch):
    path = eb.write_bands({"fsdp": [0.9, 1.0, 1.1], "fp8": [1.2], "ptd-p": [0.95, 1.05]}, source="test", path=tmp_path / "b.json")
    raw = json.loads(path.read_text())
    assert set(raw["regimes"]) == {"fsdp", "ptd-p", "all"} and raw["regimes"]["all"]["runs"] == 6  # fp8: one run, no band
    monkeypatch.setattr(eb, "BAND_FILE", path)
    eb._bands.cache_clear()
    try:
        assert eb.error_band("fsdp").runs == 3 and not eb.error_band("fsdp").fallback
        moe = eb.error_band("moe")
        assert moe.fallback and moe.runs == 6
        assert moe.describe(1.0) == ("0.925 to 1.150 s (80% of all 6 held-out published runs: no held-out "
                                     "mixture-of-experts run was published)")
    finally:
        eb._bands.cache_clear()


def test_the_gap_band_holds_both_orders_of_each_pair(tmp_path, monkeypatch):
    path = eb.write_bands({"fsdp": [0.9, 1.1]}, source="test", pair_ratios=[1.05, 0.98, 1.2], path=tmp_path / "b.json")
    monkeypatch.setattr(eb, "BAND_FILE", path)
    eb._bands.cache_clear()
    try:
        gaps = eb.gap_band()
        assert gaps.runs == 3 and gaps.low == pytest.approx(1 / gaps.high, rel=1e-2)  # near symmetric: a gap and its inverse
        assert eb.error_band("all").runs == 2  # the pairs are not runs
        assert eb.within_gap_error(10.0, 10.0 * gaps.high, gaps) and not eb.within_gap_error(10.0, 10.1 * gaps.high, gaps)
    finally:
        eb._bands.cache_clear()


def test_a_plan_is_judged_in_its_regime():
    s = Strategy.parse
    assert eb.plan_regime(s("dp=8,zero=3"), "fp8", moe=True) == "moe"  # the published MoE runs are FP8
    assert eb.plan_regime(s("dp=8,zero=3"), "fp8", moe=False) == "fp8"
    assert eb.plan_regime(s("dp=4,cp=2,zero=3"), "bf16", moe=False) == "cp"
    assert eb.plan_regime(s("dp=4,cp=2,zero=3"), "fp8", moe=False) == "cp"  # the long-sequence rows: their own band
    assert eb.plan_regime(s("dp=8,ep=8,zero=3"), "bf16", moe=True) == "moe"
    assert eb.plan_regime(s("dp=8,zero=3"), "bf16", moe=False) == "fsdp"
    assert eb.plan_regime(s("dp=2,tp=4,zero=1"), "bf16", moe=False) == "ptd-p"


def test_the_committed_bands_cover_the_regimes_plans_fall_in():
    for regime in ("fsdp", "ptd-p", "fp8", "cp", "moe", "all"):
        band = eb.error_band(regime)
        assert band is not None and not band.fallback and band.runs >= 3 and band.low < band.high
        assert regime in ("cp", "moe") or band.low < 1 < band.high  # (few rows, which may all err one way)


def test_a_gpu_plan_carries_its_band_and_names_the_runners_up_inside_it():
    plan = tessera.plan("gpt3-2.7b", "dgx-a100:nodes=1", global_batch=64, seq_len=2048)
    band = plan.error_band()
    low, high = band.range_s(plan.estimate.step_time_s)
    assert low < plan.estimate.step_time_s < high
    inside = runners_up_inside_band(plan, band)
    gaps = eb.gap_band()
    assert gaps.runs >= 10 and gaps.low < 1 < gaps.high
    assert inside == [rank for rank, c in enumerate(plan.alternatives, start=2)
                      if c.estimate.step_time_s <= plan.estimate.step_time_s * gaps.high]
    sentence = band_sentence(plan)
    assert sentence.startswith("Likely step time: ") and (not inside or f"{gaps.runs} pairs with a held-out run" in sentence)
    assert f"likely     {band.describe(plan.estimate.step_time_s)}" in plan.summary()


def test_a_cpu_plan_has_no_band_the_published_runs_are_gpu_runs():
    plan = tessera.plan("gpt-tiny", "cpu:ranks=2", global_batch=8, seq_len=64)
    assert plan.error_band() is None and band_sentence(plan) is None and "likely" not in plan.summary()


def test_evaluate_carries_the_band_of_the_strategy_it_filled_in(capsys):
    from tessera.cli import main

    workload = dict(global_batch=64, seq_len=2048)
    evaluation = tessera.evaluate("gpt3-2.7b", "dgx-a100:nodes=1", strategy="dp=8,zero=3", **workload)
    strategy, estimate = evaluation  # what evaluate always returned
    assert (evaluation.strategy, evaluation.estimate) == (strategy, estimate) and strategy.zero == 3
    band = evaluation.band
    assert band == eb.error_band("fsdp")
    assert main(["evaluate", "--model", "gpt3-2.7b", "--cluster", "dgx-a100:nodes=1", "--strategy", "dp=8,zero=3",
                 "--global-batch", "64", "--seq-len", "2048", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["likely_step_time_s"] == pytest.approx(list(band.range_s(estimate.step_time_s)))
    assert printed["likely_regime"] == "fsdp"
    assert tessera.evaluate("gpt-tiny", "cpu:ranks=2", strategy="dp=2", global_batch=8, seq_len=64).band is None


def test_a_routed_expert_block_of_any_kind_makes_a_prediction_mixture_of_experts():
    s = Strategy.parse("dp=8,zero=1")
    assert eb.prediction_band(s, "bf16", device_name="H100-SXM-80GB", block_kinds=["local-moe"]) == eb.error_band("moe")
    assert eb.prediction_band(s, "bf16", device_name="H100-SXM-80GB", block_kinds=["attention"]) == eb.error_band("ptd-p")


def test_a_model_without_attention_blocks_gets_no_band_from_the_transformer_runs():
    s = Strategy.parse("dp=8,zero=1")
    for kinds in ([], [""], ["ssm"]):  # a CNN's layers, a state-space model: no published run trained one
        assert eb.prediction_band(s, "bf16", device_name="H100-SXM-80GB", block_kinds=kinds) is None


def test_an_evaluation_pickles_and_copies_with_its_band():
    import copy
    import pickle

    evaluation = tessera.evaluate("gpt3-2.7b", "dgx-a100:nodes=1", strategy="dp=8,zero=3", global_batch=64, seq_len=2048)
    for again in (pickle.loads(pickle.dumps(evaluation)), copy.deepcopy(evaluation)):
        assert again == evaluation and again.band == evaluation.band and again.strategy == evaluation.strategy
