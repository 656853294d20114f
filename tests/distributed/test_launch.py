"""The local launcher: results come back in rank order; a failing or hanging rank is reported, not waited on."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tessera.errors import TesseraError
from tessera.runtime.launch import RankCrashedError, WorkerError, WorkerTimeoutError, spawn

pytestmark = pytest.mark.distributed


def _rank_world_and_sum(offset: int) -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)  # proves the process group is live
    return dist.get_rank(), dist.get_world_size(), value.item() + offset


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 blocks here forever; the launcher must kill it


def _killed_on_rank_one() -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no error file: as the OOM killer does
    time.sleep(1)  # rank 1 is surely dead by now
    dist.barrier()  # rank 0 raises here (peer gone) and writes a traceback


def _abort_on_rank_one() -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        os.abort()  # as a C++ std::terminate inside torch or gloo does
    time.sleep(1)
    dist.barrier()


def _abort_while_exiting(value: int) -> int:
    import atexit

    atexit.register(os.abort)  # runs after the result is written, as a teardown crash in torch or gloo would
    return value + dist.get_rank()


def _abort_the_first_time(marks: str) -> int:
    """Rank 1 aborts on the first attempt only (a file under ``marks`` remembers it); rank 0 counts its attempts."""
    from pathlib import Path

    attempt = len(list(Path(marks).glob(f"rank{dist.get_rank()}-*"))) + 1
    (Path(marks) / f"rank{dist.get_rank()}-{attempt}").touch()
    dist.barrier()
    if dist.get_rank() == 1 and attempt == 1:
        os.abort()
    dist.barrier()
    return attempt


def _raise_and_count(marks: str) -> None:
    from pathlib import Path

    (Path(marks) / f"rank{dist.get_rank()}-{time.monotonic_ns()}").touch()
    raise ValueError("a Python error is the function's own: never retried")


def _raise_then_a_peer_aborts(marks: str) -> None:
    """Rank 0 raises; rank 1 aborts 20 ms later, before the launcher polls again: the error came first."""
    from pathlib import Path

    (Path(marks) / f"rank{dist.get_rank()}-{time.monotonic_ns()}").touch()
    dist.barrier()
    if dist.get_rank() == 0:
        raise ValueError("the real failure")
    time.sleep(0.02)
    os.abort()


def _sleep_forever() -> None:
    time.sleep(600)


def test_spawn_returns_each_ranks_value_in_rank_order():
    results = spawn(_rank_world_and_sum, nprocs=3, args=(10,))
    assert results == [(0, 3, 13.0), (1, 3, 13.0), (2, 3, 13.0)]


def test_raising_rank_is_named_with_its_traceback_and_the_others_are_killed():
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        spawn(_fail_on_rank_one, nprocs=2, timeout_s=60)
    message = str(caught.value)
    assert message.startswith("rank 1 of 2 failed")
    assert "ValueError: boom on rank one" in message
    assert "_fail_on_rank_one" in message  # the traceback, not just the message
    assert time.monotonic() - started < 30  # did not wait for the 60 s timeout


def test_a_rank_killed_by_a_signal_is_blamed_not_the_peer_that_lost_it():
    with pytest.raises(RankCrashedError) as caught:
        spawn(_killed_on_rank_one, nprocs=2, timeout_s=60, crash_retries=0)
    message = str(caught.value)
    assert message.startswith("rank 1 of 2 failed"), message
    assert "killed by signal 9" in message


def test_an_aborted_rank_is_reported_with_where_its_python_stood():
    with pytest.raises(RankCrashedError) as caught:
        spawn(_abort_on_rank_one, nprocs=2, timeout_s=60, crash_retries=0)
    message = str(caught.value)
    assert message.startswith("rank 1 of 2 failed") and "killed by signal 6" in message, message
    assert "died before writing its result" in message and "in _abort_on_rank_one" in message  # the fault handler's stack


def test_a_rank_that_dies_while_exiting_after_its_result_keeps_the_result_and_warns():
    with pytest.warns(RuntimeWarning, match=r"rank \d of 2 returned its result, then exited with code -6; "
                      r"it died after returning its result \(while exiting\)"):
        assert spawn(_abort_while_exiting, nprocs=2, args=(5,), timeout_s=60) == [5, 6]


def test_a_crashed_spawn_runs_again_when_asked_and_says_so(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"(?s)starting all 2 ranks of _abort_the_first_time again \(retry 1 of 1\) "
                      r"after a crash: rank 1 of 2 failed.*killed by signal 6"):
        assert spawn(_abort_the_first_time, nprocs=2, args=(str(tmp_path),), timeout_s=60, crash_retries=1) == [2, 2]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(RankCrashedError):  # without retries the crash is the answer
        spawn(_abort_the_first_time, nprocs=2, args=(str(fresh),), timeout_s=60, crash_retries=0)


def test_a_rank_that_raises_is_never_retried(tmp_path):
    with pytest.raises(WorkerError, match="never retried") as caught:
        spawn(_raise_and_count, nprocs=2, args=(str(tmp_path),), timeout_s=60, crash_retries=3)
    assert not isinstance(caught.value, RankCrashedError)
    assert len(list(tmp_path.glob("rank*"))) <= 2  # one attempt (a rank may be killed before it got there)


def test_a_crash_after_a_peer_raised_blames_the_error_and_is_not_retried(tmp_path):
    with pytest.raises(WorkerError, match="(?s)rank 0 of 2 failed.*its traceback.*ValueError: the real failure") as caught:
        spawn(_raise_then_a_peer_aborts, nprocs=2, args=(str(tmp_path),), timeout_s=60, crash_retries=2)
    assert not isinstance(caught.value, RankCrashedError)
    assert len(list(tmp_path.glob("rank*"))) == 2  # one attempt


def test_hanging_ranks_raise_a_timeout_error():
    started = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as caught:
        spawn(_sleep_forever, nprocs=2, timeout_s=4)
    assert isinstance(caught.value, TesseraError) and isinstance(caught.value, TimeoutError)
    assert "[0, 1]" in str(caught.value)
    assert time.monotonic() - started < 20


def _plan(strategy: str, cluster: str = "dgx-h100:nodes=2"):
    from .harness import GPT, make_model, make_plan

    return make_plan(GPT, make_model(GPT, device="meta"), strategy).model_copy(update={"cluster": cluster})


def test_launch_commands_one_torchrun_line_per_node_from_the_plans_cluster():
    from tessera.runtime.launch import launch_commands

    lines = launch_commands(_plan("dp=2,tp=8"), "train.py", script_args=["--plan", "plan.json"])
    assert lines == [
        f"torchrun --nnodes=2 --nproc-per-node=8 --node-rank={rank} --master-addr=$MASTER_ADDR "
        "--master-port=29500 train.py --plan plan.json"
        for rank in range(2)
    ]


def test_launch_commands_single_node_and_slurm():
    from tessera.runtime.launch import launch_commands

    assert launch_commands(_plan("dp=4", cluster="dgx-h100:nodes=1,gpus_per_node=4"), "train.py", nodes=1) == [
        "torchrun --standalone --nnodes=1 --nproc-per-node=4 train.py"]
    script = launch_commands(_plan("dp=4,pp=4"), "my train.py", nodes=2, scheduler="slurm")
    assert script[:4] == ["#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"]
    assert script[-1].startswith("srun torchrun --nnodes=2 --nproc-per-node=8 --rdzv-id=$SLURM_JOB_ID")
    assert script[-1].endswith("--rdzv-endpoint=$MASTER_ADDR:29500 'my train.py'")


def test_launch_commands_start_an_nvl72_rack_per_host():
    """A GB200 NVL72 rack is one NVLink node of 72 GPUs on 18 hosts of 4: torchrun runs on each host."""
    from tessera.errors import ConfigError
    from tessera.runtime.launch import launch_commands

    plan = _plan("dp=16,tp=8", cluster="gb200-nvl72:nodes=1,gpus_per_node=128")
    lines = launch_commands(plan, "train.py")
    assert len(lines) == 32 and lines[0].startswith("torchrun --nnodes=32 --nproc-per-node=4 --node-rank=0 ")
    assert "#SBATCH --gpus-per-node=4" in launch_commands(plan, "train.py", scheduler="slurm")
    with pytest.raises(ConfigError, match="8 processes per node, but the hosts of cluster .* have 4 devices"):
        launch_commands(plan, "train.py", nodes=16, procs_per_node=8)


def test_launch_commands_refuse_a_strategy_only_the_cost_model_knows():
    from tessera.errors import NotModelledError
    from tessera.runtime.launch import launch_commands

    with pytest.raises(NotModelledError, match="tp_overlap=true, recompute_modules=mlp: cost-model options"):
        launch_commands(_plan("dp=2,tp=8,tp_overlap=true,recompute_modules=mlp"), "train.py")


def test_launch_commands_hold_the_plan_to_its_cluster():
    """A plan whose strategy is not its cluster's size (edited by hand), more processes per node than its nodes
    have devices, and a batch script for CPU ranks asking for GPUs are all wrong launches."""
    from tessera.errors import ConfigError
    from tessera.runtime.launch import launch_commands

    with pytest.raises(ConfigError, match="uses 4 ranks but its cluster dgx-h100:nodes=2 has 16 devices"):
        launch_commands(_plan("dp=4"), "train.py")
    with pytest.raises(ConfigError, match="4 processes per node, but the hosts of cluster .* have 2 devices"):
        launch_commands(_plan("dp=8", cluster="dgx-h100:nodes=4,gpus_per_node=2"), "train.py", nodes=2)
    script = launch_commands(_plan("dp=2", cluster="cpu:ranks=2"), "train.py", scheduler="slurm")
    assert not any("gpus" in line for line in script)


def test_launch_commands_refuse_a_shape_that_is_not_the_plans_world():
    from tessera.errors import ConfigError
    from tessera.runtime.launch import launch_commands

    with pytest.raises(ConfigError, match="3 node\\(s\\) x 4 process\\(es\\) per node = 12 ranks, but the plan"):
        launch_commands(_plan("dp=16"), "train.py", nodes=3, procs_per_node=4)
