"""``tessera compare``: the plan next to hand-tuned baselines, the throughput ratio and why they differ."""

import json

import pytest
from rich.console import Console

import tessera
from tessera.cost_models import error_bands as eb
from tessera.cli import main
from tessera.cost_models import Estimate
from tessera.planner.compare import Comparison, compare_to_baseline
from tessera.planner.plan_facts import step_terms
from tessera.report import print_comparison

GiB = 2**30


def make_estimate(*, compute=10.0, bubble=0.0, tp_comm=0.0, memory_gib=40, tokens_per_step=1e6) -> Estimate:
    """A hand-made estimate: 0.1 s optimizer, tensor-parallel communication fully exposed."""
    step = compute + bubble + tp_comm + 0.1
    return Estimate(
        step_time_s=step, compute_time_s=compute, recompute_time_s=0.0, optimizer_time_s=0.1,
        exposed_comm_time_s=tp_comm, bubble_time_s=bubble, comm_time_by_kind_s={"tp_allreduce": tp_comm} if tp_comm else {},
        memory_by_category_bytes={"parameters": memory_gib * GiB}, peak_memory_bytes=memory_gib * GiB,
        memory_budget_bytes=80 * GiB, tokens_per_s=tokens_per_step / step, model_flops_per_step=1e15, mfu=0.5,
    )


def test_ratio_is_plan_throughput_over_baseline_throughput_and_reason_names_the_bubble():
    plan, baseline = make_estimate(), make_estimate(bubble=2.0)
    result = compare_to_baseline(plan, requested="pp=4", strategy=tessera.Strategy(pp=4), estimate=baseline)
    assert result.throughput_ratio == pytest.approx(plan.tokens_per_s / baseline.tokens_per_s)
    assert result.throughput_ratio == pytest.approx(12.1 / 10.1)
    assert result.term_changes[0].term == "bubble" and result.term_changes[0].delta_s == pytest.approx(2.0)
    assert "1.20x" in result.reason and "biggest change: bubble +2.000 s (2.000 s vs 0.000 s)" in result.reason
    assert result.fits and result.over_budget_bytes == 0 and "the baseline fits" in result.reason
    assert sum(c.delta_s for c in result.term_changes) == pytest.approx(baseline.step_time_s - plan.step_time_s)


def test_reason_names_the_communication_kind_that_changed_most():
    plan, baseline = make_estimate(tp_comm=0.5), make_estimate(compute=9.0, tp_comm=4.0, memory_gib=30)
    result = compare_to_baseline(plan, requested="tp=8", strategy=tessera.Strategy(tp=8), estimate=baseline)
    assert [c.term for c in result.term_changes[:2]] == ["exposed tp_allreduce", "compute"]
    assert "biggest change: exposed tp_allreduce +3.500 s" in result.reason and "then compute -1.000 s" in result.reason
    assert result.memory_delta_bytes == -10 * GiB and "memory 30.00 vs 40.00 GiB per device" in result.reason


def test_a_baseline_that_does_not_fit_says_by_how_much():
    plan, baseline = make_estimate(), make_estimate(compute=8.0, memory_gib=100)
    result = compare_to_baseline(plan, requested="dp=8,zero=0", strategy=tessera.Strategy(dp=8), estimate=baseline)
    assert not result.fits and result.over_budget_bytes == 20 * GiB
    assert result.reason.startswith("does not fit: 20.00 GiB over the 80 GiB device")
    assert result.throughput_ratio < 1 and "would be 0.80x its throughput" in result.reason


@pytest.fixture(scope="module")
def comparison() -> Comparison:
    # Eight GPT-3 175B blocks (14.5B parameters) on one DGX A100: DDP's replicated state cannot fit.
    return tessera.compare("gpt3-175b:layers=8", "dgx-a100:nodes=1", global_batch=16, seq_len=2048,
                           baselines=["tp=8,mbs=1", "dp=8,zero=0", "dp=3"])


def test_compare_evaluates_each_baseline_like_evaluate(comparison):
    fits, too_big, invalid = comparison.baselines
    assert (fits.strategy, fits.estimate) == tessera.evaluate(
        "gpt3-175b:layers=8", "dgx-a100:nodes=1", global_batch=16, seq_len=2048, strategy="tp=8,mbs=1")
    assert fits.fits and fits.throughput_ratio >= 1
    assert fits.throughput_ratio == pytest.approx(comparison.plan_estimate.tokens_per_s / fits.estimate.tokens_per_s)
    assert fits.term_changes[0].term in step_terms(fits.estimate) and fits.term_changes[0].term in fits.reason
    assert not too_big.fits and too_big.over_budget_bytes > 0
    over = (too_big.estimate.peak_memory_bytes - too_big.estimate.memory_budget_bytes) / GiB
    assert too_big.reason.startswith(f"does not fit: {over:.2f} GiB over the 79.25 GiB device")
    assert invalid.estimate is None and invalid.reason.startswith("cannot run:") and "8" in invalid.error


def test_compare_cli_json_round_trips_and_table_renders(capsys):
    args = ["compare", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--global-batch", "8", "--seq-len", "32",
            "--baseline", "dp=2,zero=0,mbs=4", "--baseline", "dp=4"]
    assert main([*args, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    result = Comparison.model_validate(data)
    assert [b.requested for b in result.baselines] == ["dp=2,zero=0,mbs=4", "dp=4"]
    assert result.baselines[0].throughput_ratio == pytest.approx(
        result.plan_estimate.tokens_per_s / result.baselines[0].estimate.tokens_per_s)
    assert result.baselines[1].error
    console = Console(record=True, width=120)
    print_comparison(result, console)
    out = console.export_text()
    assert "plan speed-up" in out and "cannot run" in out and f"{result.baselines[0].throughput_ratio:.2f}x" in out
    assert main([*args[:-2], "--baseline", "tp=eight"]) == 2, "a malformed baseline is a one-line error"


def test_a_gpu_comparison_carries_the_plans_likely_range_and_names_the_baselines_inside_it():
    from tessera import compare

    result = compare("gpt3-2.7b", "dgx-a100:nodes=1", global_batch=64, seq_len=2048,
                     baselines=["dp=8,zero=1,mbs=1,recompute=full", "dp=8,zero=0,mbs=2", "tp=8,mbs=1"])
    assert result.likely.endswith("held-out tensor/pipeline/data-parallel published runs)")
    inside = result.baselines_inside_band()
    fitting = [i for i, b in enumerate(result.baselines, start=1) if b.estimate is not None and b.estimate.fits]
    gaps = eb.gap_band()  # the error of a predicted gap between two configurations, from published pairs
    assert result.inside_high_s == pytest.approx(result.plan_estimate.step_time_s * gaps.high)
    assert inside == [i for i in fitting if result.baselines[i - 1].estimate.step_time_s <= result.inside_high_s]
    assert result.likely_high_s > result.plan_estimate.step_time_s
    assert inside and len(inside) < len(fitting)  # one close baseline inside, the distant ones out
    console = Console(record=True, width=120)
    print_comparison(result, console)
    printed = " ".join(console.export_text().split())  # the line as one, unwrapped
    assert "Tessera's likely step time: " in printed and "Within the cost model's error of the plan: baseline" in printed
    cpu = compare("gpt-tiny", "cpu:ranks=2", global_batch=8, seq_len=32, baselines=["dp=2"])
    assert cpu.likely is None and cpu.baselines_inside_band() == []
