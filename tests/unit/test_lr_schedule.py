"""Learning-rate schedulers (``runtime.lr_schedule``): ``train_step`` steps them, disk checkpoints and in-memory
snapshots save and restore them, so a resumed run trains on the uninterrupted run's learning rates; one process
(the 4-rank fault run with a scheduler is ``tests/distributed/test_snapshots.py``)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tessera.errors import CheckpointError, ConfigError
from tessera.runtime.apply import apply_plan
from tessera.runtime.elastic import resume_if_possible
from tessera.runtime.snapshots import SnapshotConfig
from tests.distributed.harness import FP32_TOL, GPT, make_batches, make_model, make_plan

SAVE_AT, STEPS = 3, 6


def decay(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def _pm(factory=decay, seed: int = 0):
    model = make_model(GPT, seed)
    return apply_plan(model, make_plan(GPT, model, "dp=1,mbs=8"), lr_scheduler_factory=factory)


def _train(pm, batches, steps) -> list[tuple[float, float]]:
    """(loss, learning rate it trained with) per step."""
    out = []
    for _ in range(steps):
        lr = pm.optimizer.param_groups[0]["lr"]
        out.append((pm.train_step(batches[pm.step]), lr))
    return out


def test_train_step_steps_the_scheduler_and_a_checkpoint_resumes_its_schedule(tmp_path):
    batches = make_batches(GPT, STEPS)
    pm = _pm()
    before = _train(pm, batches, SAVE_AT)
    assert [lr for _, lr in before] == pytest.approx([1e-3, 1e-3 / 2, 1e-3 / 3])
    pm.save(tmp_path)
    uninterrupted = _train(pm, batches, STEPS - SAVE_AT)
    again = _pm(seed=1)
    assert again.load(tmp_path).step == SAVE_AT
    assert again.lr_scheduler.last_epoch == SAVE_AT
    resumed = _train(again, batches, STEPS - SAVE_AT)
    torch.testing.assert_close(resumed, uninterrupted, **FP32_TOL)


def test_a_snapshot_resumes_the_schedule_and_a_moving_learning_rate_keeps_the_staging(tmp_path):
    batches = make_batches(GPT, STEPS)
    pm = _pm()
    snapshotter = pm.enable_snapshots(SnapshotConfig(every=1, store=tmp_path / "store"))
    _train(pm, batches, 1)
    pm.wait_for_snapshot()
    staged = snapshotter._staged
    _train(pm, batches, SAVE_AT - 1)
    pm.wait_for_snapshot()
    assert snapshotter._staged is staged  # the learning rate moved every step; the staging stayed
    pm.snapshots = None  # the run "dies" here: its store keeps the snapshot of SAVE_AT ...
    os.close(snapshotter._lock)  # ... and its process would have released the store's lock
    uninterrupted = _train(pm, batches, STEPS - SAVE_AT)
    again = _pm(seed=1)
    again.enable_snapshots(SnapshotConfig(every=1, store=tmp_path / "store"))
    assert resume_if_possible(again, None).step == SAVE_AT and again.lr_scheduler.last_epoch == SAVE_AT
    resumed = _train(again, batches, STEPS - SAVE_AT)
    torch.testing.assert_close(resumed, uninterrupted, **FP32_TOL)
    again.close()


def test_a_checkpoint_without_scheduler_state_is_loaded_with_a_warning(tmp_path, caplog):
    pm = _pm(factory=None)
    _train(pm, make_batches(GPT, 1), 1)
    pm.save(tmp_path)
    again = _pm()
    with caplog.at_level(logging.WARNING, logger="tessera.runtime.lr_schedule"):
        again.load(tmp_path)
    assert "holds no learning-rate scheduler state" in caplog.text
    assert again.lr_scheduler.last_epoch == 0


def test_schedulers_the_runtime_cannot_step_or_save_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="ReduceLROnPlateau, which steps on a metric"):
        _pm(factory=lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="built on the optimizer it is given"):
        _pm(factory=lambda optimizer: torch.optim.lr_scheduler.StepLR(other, 1))


class _Warmup:
    """A callable object: ``LambdaLR`` saves its ``__dict__``, here holding a value no checkpoint may hold."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def __call__(self, step: int) -> float:
        return 1.0


def test_a_scheduler_state_that_would_need_code_to_load_is_refused_before_training():
    with pytest.raises(ConfigError, match=r"lr_scheduler\.lr_lambdas\[0\]\.device, a device"):
        _pm(factory=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup()))


def milestones(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 4], gamma=0.5)  # its state holds a Counter


def test_a_milestone_schedule_resumes_from_a_checkpoint_and_a_snapshot(tmp_path):
    batches = make_batches(GPT, STEPS)
    pm = _pm(factory=milestones)
    snapshotter = pm.enable_snapshots(SnapshotConfig(every=1, store=tmp_path / "store"))
    _train(pm, batches, SAVE_AT)
    pm.save(tmp_path / "disk")
    pm.wait_for_snapshot()
    pm.snapshots = None
    os.close(snapshotter._lock)
    uninterrupted = _train(pm, batches, STEPS - SAVE_AT)
    for resume in ("disk", "snapshot"):
        again = _pm(factory=milestones, seed=1)
        if resume == "snapshot":
            again.enable_snapshots(SnapshotConfig(every=1, store=tmp_path / "store"))
        info = resume_if_possible(again, tmp_path / "disk" if resume == "disk" else None)
        assert info.step == SAVE_AT and again.lr_scheduler.milestones == pm.lr_scheduler.milestones, resume
        torch.testing.assert_close(_train(again, batches, STEPS - SAVE_AT), uninterrupted, **FP32_TOL, msg=resume)
        if resume == "snapshot":
            again.snapshots = None  # leave the store to the test's tmp_path


def test_another_schedulers_state_is_refused_by_name(tmp_path):
    pm = _pm(factory=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2))
    _train(pm, make_batches(GPT, 1), 1)
    pm.save(tmp_path)
    with pytest.raises(CheckpointError, match="another learning-rate scheduler than this run's LambdaLR .*step_size"):
        _pm().load(tmp_path)


def _warm_then_step(optimizer, second=torch.optim.lr_scheduler.StepLR):
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=2)
    rest = second(optimizer, step_size=2) if second is torch.optim.lr_scheduler.StepLR else second(optimizer, T_max=4)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, rest], milestones=[2])


def test_a_sequential_schedule_takes_this_ranks_base_rates_and_refuses_other_parts():
    """Under another world size every rank loads rank 0's state: a ``SequentialLR``'s parts keep this rank's own
    base learning rates (its groups' ``initial_lr``), and a state whose parts are other schedulers is refused."""
    from tessera.runtime.lr_schedule import restore_scheduler, scheduler_state

    def optimizer(lr):
        return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr)

    saved = _warm_then_step(optimizer(1.0))
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    mine = _warm_then_step(optimizer(0.5))
    restore_scheduler(mine, scheduler_state(saved), source="rank 0's file", groups=1)
    assert mine.last_epoch == 3 and [part.base_lrs for part in mine._schedulers] == [[0.5], [0.5]]
    other = _warm_then_step(optimizer(0.5), second=torch.optim.lr_scheduler.CosineAnnealingLR)
    with pytest.raises(CheckpointError, match="another learning-rate scheduler than this run's SequentialLR .*step_size"):
        restore_scheduler(other, scheduler_state(saved), source="rank 0's file", groups=1)
