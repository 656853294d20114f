"""Planning end to end on meta tensors: the CLI, the Python API, the plan's JSON and infeasible input."""

import json
import subprocess
import sys

import pytest

import tessera
from tessera.cli import main
from tessera.errors import ClusterSpecError, InfeasiblePlanError
from tessera.planner.plan import Plan

GiB = 2**30


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True, timeout=300)


def test_llama3_70b_on_eight_dgx_h100_plans_quickly_without_weights():
    # The acceptance command, in a fresh process so its peak RSS is the plan's alone.
    code = (
        "import resource, sys, time; from tessera.cli import main; t = time.perf_counter();"
        "rc = main(['plan', '--model', 'llama3-70b', '--cluster', 'dgx-h100:nodes=8', '--global-batch', '1024', "
        "'--seq-len', '8192']); print('RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "'SECONDS', time.perf_counter() - t); sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "FSDP" in result.stdout and "tokens/s" in result.stdout
    fields = result.stdout.split()
    rss_gb = int(fields[fields.index("RSS_KB") + 1]) / 2**20
    assert rss_gb < 2.0, f"planning used {rss_gb:.2f} GB: weights were allocated"
    assert float(fields[fields.index("SECONDS") + 1]) < 60


def test_plan_json_round_trips(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--global-batch", "8", "--seq-len", "32", "--json", str(out)]) == 0
    plan = Plan.from_json(out)
    assert plan.schema_version == 1 and plan.strategy.dp == 2
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(out.read_text())["layers"][0]["fqn"]
    assert plan.block_fqns == ("blocks.0", "blocks.1")


def test_chosen_plan_is_the_fastest_fitting_candidate():
    plan = tessera.plan("llama3-8b", "dgx-h100:nodes=2", global_batch=64, seq_len=4096)
    assert plan.estimate.fits
    for candidate in plan.alternatives:
        assert (not candidate.estimate.fits) or candidate.estimate.step_time_s >= plan.estimate.step_time_s
        assert candidate.verdict
    timing = {"search_time_s": True, "capture_time_s": True, "solver": {"ilp_time_s"}}  # wall-clock fields differ run to run
    again = tessera.plan("llama3-8b", "dgx-h100:nodes=2", global_batch=64, seq_len=4096)
    assert plan.model_dump(exclude=timing) == again.model_dump(exclude=timing), "the search must be deterministic"


def test_a_model_that_cannot_fit_says_by_how_much_and_what_helps():
    with pytest.raises(InfeasiblePlanError, match=r"needs \d+\.\d GiB per device, \d+\.\d GiB over.*use about \d+ nodes"):
        tessera.plan("llama3-405b", "dgx-h100:nodes=1", global_batch=8, seq_len=8192)
    with pytest.raises(InfeasiblePlanError, match=r"on dgx-a100:nodes=1.*GiB over"):  # the example: 175B on 8 GPUs
        tessera.plan("gpt3-175b", "dgx-a100:nodes=1", global_batch=8, seq_len=2048)


def test_unknown_preset_is_one_line_listing_the_known_ones():
    result = run_cli("plan", "--model", "llama9-1t", "--cluster", "dgx-h100:nodes=1")
    assert result.returncode == 2
    assert "llama3-70b" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3  # one logical line, maybe wrapped by the terminal


def test_world_size_the_cluster_cannot_hold_says_so():
    result = run_cli("evaluate", "--model", "gpt-tiny", "--cluster", "cpu:ranks=2", "--strategy", "dp=4", "--global-batch", "8", "--seq-len", "32")
    assert result.returncode == 2 and "need 4 ranks" in result.stderr and "2 devices of cluster cpu:ranks=2" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = run_cli("plan", "--debug", "--model", "gpt-tiny", "--cluster", "nowhere:nodes=1")
    assert result.returncode != 0 and "Traceback" in result.stderr and "ClusterSpecError" in result.stderr


def test_auto_parallelize_refuses_a_world_that_does_not_match():
    with pytest.raises(tessera.RuntimeSetupError, match="launch 4 processes"):
        tessera.auto_parallelize("gpt-tiny", "cpu:ranks=4", global_batch=8, seq_len=32)
    with pytest.raises(ClusterSpecError):
        tessera.load_cluster("cpu:ranks=zero")


def test_search_uses_the_ilp_and_its_choice_is_rechecked_by_estimate():
    import tessera

    plan = tessera.plan("llama3-70b", "dgx-h100:nodes=8", global_batch=1024, seq_len=8192)
    assert plan.solver.ilp_solved >= 1 and plan.solver.worst_gap == 0
    assert plan.estimate.fits
    recomputed = [layer.recompute for layer in plan.layers if layer.kind == "block"]
    assert len(recomputed) == 80 and set(recomputed) <= {"none", "selective", "full"}
    best_uniform = min(
        (c.estimate.step_time_s for c in plan.alternatives if c.estimate.fits and not c.strategy.block_recompute),
        default=float("inf"),
    )
    assert plan.estimate.step_time_s <= best_uniform


def test_a_plan_pinned_to_a_cost_model_option_says_it_is_not_launched_here(tmp_path, capsys):
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "dgx-h100:nodes=1", "--global-batch", "8", "--seq-len",
                 "32", "--fix", "recompute_modules=mlp", "--format", "md", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Not on Tessera's runtime: recompute_modules=mlp: cost-model options" in report and "torchrun" not in report
    assert "torchrun" not in capsys.readouterr().out


def test_launch_prints_one_torchrun_line_per_node(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "dgx-h100:nodes=2", "--global-batch", "16", "--seq-len", "32", "--json", str(path)]) == 0
    result = run_cli("launch", str(path), "--script", "train.py")
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and len(lines) == 2
    assert all("--nnodes=2 --nproc-per-node=8" in line and f"--plan {path}" in line for line in lines)
    missing = run_cli("launch", str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_a_model_planned_on_example_inputs_reports_samples_and_readable_small_figures():
    # A CNN's rows are images: tokens/s (batch x seq_len, which it never reads) printed millions; a tiny model's step
    # and memory printed "0.000 s" and "0.0"; the transformer runs' error band was offered for it.
    import re

    import torch
    from torch import nn

    class Convolutional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.head = nn.Linear(8, 10)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.head(self.pool(torch.relu(self.conv(images))).flatten(1))

    plan = tessera.plan(Convolutional(), "dgx-h100:nodes=1", global_batch=64, seq_len=1,
                        example_inputs=torch.zeros(1, 3, 16, 16))
    text = plan.summary()
    assert not plan.token_inputs and "samples/s" in text and "tokens/s" not in text and "likely" not in text
    assert re.search(r"step time  \d+\.\d+ (ms|µs)", text) and "0.000" not in text
    assert re.search(r"parameters \d+\.\d KiB", text)
    again = Plan.from_json(plan.to_json())  # the plan file keeps what a row is
    assert again.throughput() == plan.throughput() == f"{64 / plan.estimate.step_time_s:,.0f} samples/s"
    tokens = tessera.plan("gpt-tiny", "cpu:ranks=2", global_batch=8, seq_len=64)
    assert tokens.token_inputs and "tokens/s" in tokens.summary()
