"""Two jobs saving into one checkpoint root at the same moments (issue 17: before the root lock, one trial in three
committed a corrupt checkpoint). Each job is its own process with no process group, saving the same steps in
lockstep (a barrier before every save): every save either commits an intact checkpoint or is refused with a
``CheckpointError``, and nothing half-written is ever committed or left behind.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.runtime.checkpoint_files import LOCK_FILE, check_checkpoint, complete_checkpoints, read_manifest

pytestmark = pytest.mark.distributed

JOBS, STEPS = 2, 6


class State:
    """The smallest ``TrainingState``: one linear layer, AdamW (no scheduler), a plan and a step."""

    def __init__(self, plan_json: str, job: int) -> None:
        from tessera.planner.plan import Plan

        torch.manual_seed(job)
        self.modules = [nn.Linear(256, 256)]  # 0.8 MB with AdamW's moments: writes take a while
        self.optimizer = torch.optim.AdamW(self.modules[0].parameters())
        self.modules[0](torch.randn(2, 256)).sum().backward()
        self.optimizer.step()
        self.lr_scheduler = None
        self.plan = Plan.from_json(plan_json)
        self.step = 0
        self.tied_names = ()


def save_in_lockstep(root: str, plan_json: str, job: int, barrier, results) -> None:
    from tessera.errors import CheckpointError
    from tessera.runtime.checkpoint import Checkpointer

    state, checkpointer, outcomes = State(plan_json, job), Checkpointer(), []
    for step in range(1, STEPS + 1):
        state.step = step
        barrier.wait()
        try:
            checkpointer.save(state, root).wait()
            outcomes.append("saved")
        except CheckpointError as error:
            outcomes.append(str(error))
    results.put((job, outcomes))


@pytest.fixture(scope="module")
def plan_json() -> str:
    import tessera

    return tessera.plan("gpt-tiny", "cpu:ranks=1", global_batch=2, seq_len=16).to_json()


def test_concurrent_saves_into_one_root_never_commit_a_corrupt_checkpoint(tmp_path, plan_json):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(JOBS), ctx.Queue()
    jobs = [ctx.Process(target=save_in_lockstep, args=(str(tmp_path), plan_json, job, barrier, results))
            for job in range(JOBS)]
    for job in jobs:
        job.start()
    outcomes = dict(results.get(timeout=120) for _ in jobs)
    for job in jobs:
        job.join(timeout=30)
    assert all(job.exitcode == 0 for job in jobs), [job.exitcode for job in jobs]
    committed = complete_checkpoints(Path(tmp_path))
    assert sorted(read_manifest(folder).step for folder in committed) == list(range(1, STEPS + 1))
    assert all(check_checkpoint(folder, verify=True, group=None) is None for folder in committed)
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == sorted([LOCK_FILE, *(f.name for f in committed)])
    for step in range(STEPS):  # each step saved by exactly one job; the other was refused with a reason
        assert sorted(outcome == "saved" for outcome in (outcomes[0][step], outcomes[1][step])) == [False, True]
        refused = next(outcome for outcome in (outcomes[0][step], outcomes[1][step]) if outcome != "saved")
        assert "another save is writing into" in refused or "already exists" in refused, refused
