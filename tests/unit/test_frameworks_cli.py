"""``tessera plan --format megatron|torchtitan|deepspeed``, ``evaluate --from-*`` and ``compare --baseline-from``
on a tiny model, in-process (``tessera.cli.main``) like the other CLI tests."""

from __future__ import annotations

import json

import pytest

from tessera.cli import main
from tessera.planner.frameworks import import_config

BASE = ["--model", "gpt-tiny", "--cluster", "cpu:ranks=4", "--global-batch", "8", "--seq-len", "32"]


def test_plan_prints_a_megatron_command_line_tessera_reads_back(capsys):
    assert main(["plan", *BASE, "--format", "megatron", "--fix", "tp=2,pp=2,mbs=1,zero=0,recompute=full"]) == 0
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2" in out and "--pipeline-model-parallel-size 2" in out
    config = import_config("megatron", out, world_size=4)
    assert config.strategy.to_string().startswith("dp=1,tp=2,pp=2,zero=0,mbs=1,recompute=full")
    assert (config.global_batch, config.seq_len, config.unread) == (8, 32, ())
    # Megatron-LM runs this strategy as it is, but on its own implementation: its estimate is printed all the same
    assert "# Tessera's estimate of what Megatron-LM runs (" in out


def test_plan_as_deepspeed_refuses_tensor_parallelism_in_one_line(capsys):
    assert main(["plan", *BASE, "--format", "deepspeed", "--fix", "tp=2"]) == 2
    err = capsys.readouterr().err
    assert "DeepSpeed config runs data parallelism and ZeRO only" in err and len(err.strip().splitlines()) == 1


def test_compare_baseline_from_megatron_equals_the_hand_written_baseline(capsys):
    flags = ("pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 2 "
             "--micro-batch-size 1 --global-batch-size 8 --seq-length 32 --recompute-granularity full "
             "--recompute-method uniform --recompute-num-layers 1 --overlap-grad-reduce --lr 1e-4")
    code = main(["compare", *BASE, "--format", "json", "--baseline", "dp=1,tp=2,pp=2,zero=0,mbs=1,recompute=full,"
                 "sp=false,schedule=1f1b", "--baseline-from", "megatron", flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    hand, imported = json.loads(captured.out)["baselines"]
    assert imported["strategy"] == hand["strategy"]  # what Megatron-LM runs, priced as it runs it
    assert (hand["runs_on"], imported["runs_on"]) == ("tessera", "megatron")
    assert "not read by Tessera (listed, not evaluated): --lr 1e-4" in captured.err


def test_evaluate_from_megatron_prices_its_multi_token_prediction_and_compare_refuses_it(capsys):
    flags = ("pretrain_gpt.py --pipeline-model-parallel-size 2 --num-layers 2 --micro-batch-size 1 "
             "--global-batch-size 8 --seq-length 32")
    args = ["evaluate", "--model", "gpt-tiny", "--cluster", "cpu:ranks=4", "--format", "json", "--from-megatron"]
    assert main([*args, flags]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, flags + " --mtp-num-layers 1"]) == 0
    with_module = json.loads(capsys.readouterr().out)
    assert (plain["mtp_layers"], with_module["mtp_layers"]) == (0, 1)
    assert with_module["step_time_s"] > plain["step_time_s"]
    assert main(["compare", *BASE, "--baseline-from", "megatron", flags + " --mtp-num-layers 1"]) == 2
    assert "evaluate it alone" in capsys.readouterr().err


def test_evaluate_from_deepspeed_fills_the_batch_and_refuses_a_conflict(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3}}))
    args = ["evaluate", "--model", "gpt-tiny", "--cluster", "cpu:ranks=4", "--seq-len", "32", "--format", "json"]
    assert main([*args, "--from-deepspeed", str(path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["strategy"].startswith("dp=4,zero=3,mbs=1")
    assert main([*args, "--from-deepspeed", str(path), "--global-batch", "16"]) == 2
    err = capsys.readouterr().err
    assert "the DeepSpeed config says global batch 8, but 16 is asked for" in err


def test_evaluate_needs_exactly_one_strategy_source(capsys):
    assert main(["evaluate", *BASE]) == 2
    assert "one of the arguments --strategy --from-megatron --from-torchtitan --from-deepspeed is required" in \
        capsys.readouterr().err
    assert main(["evaluate", *BASE, "--strategy", "dp=4", "--from-megatron", "--micro-batch-size 1"]) == 2
    capsys.readouterr()
    assert main(["evaluate", *BASE, "--from-megatron", ""]) == 2  # an empty command line is read, not skipped
    assert "--micro-batch-size is required" in capsys.readouterr().err


def test_the_report_carries_each_frameworks_configuration():
    from pathlib import Path

    from tessera.planner.explain import framework_sections
    from tessera.planner.explain_plots import render_html, render_markdown
    from tessera.planner.plan import Plan

    plan = Plan.from_json(Path(__file__).resolve().parents[2] / "docs" / "report-llama3-70b-pp" / "plan.json")
    sections = framework_sections(plan)  # report_sections puts these after the launch line
    markdown = render_markdown("report", sections)
    for title in ("## As Megatron-LM configuration", "## As torchtitan configuration", "## As DeepSpeed configuration"):
        assert title in markdown
    # two chunks per rank: as a count when they are even, as Megatron's layout string when the plan sized them
    interleaving = "--pipeline-model-parallel-layout" if plan.strategy.chunk_blocks else "--num-virtual-stages-per-pipeline-rank 2"
    assert "```python\n# torchtitan" in markdown and interleaving in markdown
    assert "Not expressible: a DeepSpeed config runs data parallelism and ZeRO only" in markdown
    assert "<h2>As torchtitan configuration</h2>" in render_html("report", sections)


def test_evaluate_prices_a_framework_config_as_that_framework_runs_it(tmp_path, capsys):
    """``--from-deepspeed`` prices as DeepSpeed runs it (its ZeRO-3 gathers); ``--runs-on`` names any framework (an
    unknown one gets the known names); torchtitan's selective recomputation re-runs every second matmul."""
    import tessera

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3}}))
    args = ["evaluate", "--model", "gpt-tiny", "--cluster", "cpu:ranks=4", "--seq-len", "32"]
    assert main([*args, "--from-deepspeed", str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs_on"] == "deepspeed"
    assert main([*args, "--from-deepspeed", str(path)]) == 0
    assert "priced as deepspeed runs it" in capsys.readouterr().out
    assert main([*args, "--strategy", "dp=4", "--runs-on", "colossal"]) == 2
    assert "unknown implementation profile 'colossal'; known: tessera, torchtitan" in capsys.readouterr().err
    workload = dict(global_batch=8, seq_len=64, strategy="dp=8,zero=3,mbs=1,recompute=selective")
    _, tessera_runtime = tessera.evaluate("llama-tiny", "dgx-h100:nodes=1", **workload)
    _, torchtitan = tessera.evaluate("llama-tiny", "dgx-h100:nodes=1", **workload, runs_on="torchtitan")
    # torchtitan's op-level policy re-runs every second matmul; Tessera's runtime keeps every matmul's output and
    # re-runs the rest (profiles.selective_policy): more FLOPs again there, more bytes kept here
    assert torchtitan.hardware_flops_per_step > tessera_runtime.hardware_flops_per_step
    assert torchtitan.memory_by_category_bytes["activations"] < tessera_runtime.memory_by_category_bytes["activations"]


def test_evaluate_runs_on_a_framework_that_combines_what_tessera_runtime_refuses(capsys):
    """Context with pipeline parallelism: Tessera's runtime refuses the pair in one line; Megatron runs it, so
    ``--runs-on megatron`` prices it (the refusal is the runtime's, not the cost model's)."""
    args = ["evaluate", "--model", "llama-tiny", "--cluster", "dgx-h100:nodes=1", "--global-batch", "8",
            "--seq-len", "64", "--strategy", "dp=2,pp=2,cp=2"]
    assert main(args) == 2
    refused = capsys.readouterr().err
    assert "the runtime does not implement cp together with pp; pin one of them off" in refused
    assert "tessera evaluate --runs-on megatron" in refused
    assert main([*args, "--runs-on", "megatron", "--format", "json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["runs_on"] == "megatron" and {"pp=2", "cp=2"} <= set(priced["strategy"].split(","))


MIXTRAL = ("hf:mixtral:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
           "intermediate_size=128,vocab_size=256,num_local_experts=4,num_experts_per_tok=2")


def test_a_torchtitan_export_is_bounded_by_torchtitan_not_by_tessera_runtime(capsys):
    """Tessera's runtime splits Hugging Face Mixtral's stacked experts, but not under zero-bubble with ZeRO >= 1
    (``planner.capabilities``); torchtitan's experts borrow FSDP ranks, so its run of a ZeRO-0 ep plan is ZeRO-3.
    That limit is Tessera's runtime's: the export is priced as torchtitan runs it, and Tessera still refuses it."""
    pytest.importorskip("transformers")
    workload = ["--model", MIXTRAL, "--cluster", "dgx-h100:nodes=2", "--global-batch", "64", "--seq-len", "64"]
    plan = "dp=8,pp=2,ep=2,zero=0,mbs=8,recompute=none,schedule=zero-bubble"
    assert main(["plan", *workload, "--fix", plan, "--format", "torchtitan"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "expert_parallel_degree = 2" in out and "'InterleavedZeroBubble'" in out
    assert "# Tessera's estimate of what torchtitan runs (dp=8,pp=2,ep=2,zero=3," in out
    assert main(["evaluate", *workload, "--strategy", plan.replace("zero=0", "zero=3")]) == 2
    assert "ep+zero-bubble+zero, which the runtime cannot run on this model" in capsys.readouterr().err


def test_an_imported_fp8_recipe_is_the_workloads_fp8_scaling_and_must_agree_with_the_option():
    import argparse

    import pytest

    from tessera.cli_frameworks import training_from
    from tessera.errors import ConfigError

    flags = "--micro-batch-size 1 --bf16 --fp8-format hybrid --fp8-recipe {}"
    scalings = {recipe: import_config("megatron", flags.format(recipe), world_size=8).fp8_scaling
                for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8")}
    assert scalings == {"delayed": "delayed", "tensorwise": "current", "blockwise": "block", "mxfp8": "mx"}
    assert import_config("megatron", "--micro-batch-size 1 --bf16", world_size=8).fp8_scaling is None
    mx = import_config("megatron", flags.format("mxfp8"), world_size=8)
    none = argparse.Namespace(global_batch=None, seq_len=None, precision=None, fp8_scaling=None)
    assert training_from(none, [mx])["fp8_scaling"] == "mx" and training_from(none, [mx])["precision"] == "fp8"
    with pytest.raises(ConfigError, match="says fp8 scaling mx, but current is asked for"):
        training_from(argparse.Namespace(**{**vars(none), "fp8_scaling": "current"}), [mx])


def test_compare_prices_tessera_at_a_scaling_its_runtime_runs_beside_a_delayed_scaling_baseline(capsys):
    """Megatron-LM's default FP8 recipe is delayed scaling, which torchao (Tessera's runtime) no longer runs: the
    baseline is priced at it, Tessera's own plan at current scaling, and the output says so."""
    flags = ("--micro-batch-size 1 --global-batch-size 8 --seq-length 32 --bf16 --fp8-format hybrid "
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    code = main(["compare", "--model", "gpt-tiny", "--cluster", "dgx-h100:nodes=1", "--format", "json",
                 "--baseline-from", "megatron", flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Tessera's plan is priced at current FP8 scaling" in captured.err and "at delayed scaling" in captured.err


def test_runtime_training_keeps_what_the_runtime_runs():
    from tessera.api import runtime_training
    from tessera.cost_models import TrainingConfig

    for scaling, runs in (("delayed", "current"), ("mx", "current"), ("block", "current"), ("rowwise", "rowwise")):
        training = TrainingConfig(global_batch=8, seq_len=32, precision="fp8", fp8_scaling=scaling)
        assert runtime_training(training).fp8_scaling == runs
    bf16 = TrainingConfig(global_batch=8, seq_len=32)
    assert runtime_training(bf16) is bf16
