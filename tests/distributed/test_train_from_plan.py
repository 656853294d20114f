"""The ``train.py`` the launch lines name (``examples/train_from_plan.py``) runs as its docstring says, under torchrun:
a saved plan trained, checkpointed and resumed; the resumed steps' losses are those of an uninterrupted run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.planner.plan import Plan

pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_from_plan.py"


def torchrun(*args: str, cwd: Path) -> dict[int, str]:
    """The example on 2 gloo ranks; the loss it printed for each step."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
               str(EXAMPLE), *args]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {int(step): loss for step, loss in re.findall(r"step (\d+): loss (\S+)", done.stdout)}


def test_the_launched_script_trains_a_saved_plan_and_resumes_where_it_stopped(tmp_path):
    import tessera

    plan = tessera.plan("gpt-tiny:layers=2", "cpu:ranks=2", global_batch=8, seq_len=32, strategy="dp=2")
    (tmp_path / "plan.json").write_text(plan.to_json())
    whole = torchrun("--plan", "plan.json", "--steps", "4", cwd=tmp_path)
    first = torchrun("--plan", "plan.json", "--steps", "2", "--checkpoints", "ckpt", cwd=tmp_path)
    resumed = torchrun("--plan", "plan.json", "--steps", "2", "--resume-from", "ckpt", cwd=tmp_path)
    assert list(whole) == [1, 2, 3, 4] and first == {1: whole[1], 2: whole[2]}
    assert resumed == {3: whole[3], 4: whole[4]}
    assert Plan.from_json(tmp_path / "plan.json").strategy == plan.strategy


def test_a_plan_naming_a_factory_runs_no_code_unless_the_command_names_it(tmp_path):
    import tessera

    plan = tessera.plan("gpt-tiny:layers=2", "cpu:ranks=1", global_batch=8, seq_len=32)
    (tmp_path / "plan.json").write_text(plan.model_copy(update={"model_name": "evil.py:make"}).to_json())
    (tmp_path / "evil.py").write_text("import pathlib\ndef make():\n    pathlib.Path('ran').touch()\n")
    done = subprocess.run([sys.executable, str(EXAMPLE), "--plan", "plan.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "names the factory 'evil.py:make', which runs code" in done.stderr
    assert not (tmp_path / "ran").exists()
