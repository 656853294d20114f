"""A ``ParallelModel``'s learning-rate scheduler: stepped by ``train_step`` after every optimizer step, saved with
its state in disk checkpoints (``runtime.checkpoint``) and in-memory snapshots (``runtime.snapshots``), restored
by both.

Why the runtime steps it: a snapshot is taken inside ``train_step``, after the optimizer step. A scheduler the
caller stepped after ``train_step`` returned would be saved one step behind, and a run resumed from it would train
its next step at the previous step's learning rate.

Its state is ``state_dict()``, plain numbers, strings, lists and dicts for PyTorch's schedulers (``LambdaLR``
saves no function, only the ``__dict__`` of callable objects; ``MultiStepLR``'s milestones are a ``Counter``):
it is checked when the scheduler is built, so that a state a received checkpoint cannot hold without running
code (``torch.load(weights_only=True)``) is refused before training, not at the first save. A received state is
checked against the run's own scheduler before it is loaded (``load_state_dict`` overwrites the scheduler's
attributes with whatever it is given): another scheduler's state is refused by name. Under another world size
every rank gets rank 0's state; each group's base learning rate is then its own ``initial_lr`` again (restored
per parameter with the optimizer), in the scheduler and in those it is made of (``SequentialLR``,
``ChainedScheduler``), so ranks whose groups differ (a per-stage optimizer) keep their own.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from tessera.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

LRSchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
"""``factory(optimizer) -> scheduler``: builds the scheduler on the rank's optimizer (``apply_plan`` calls it)."""


def build_scheduler(factory: LRSchedulerFactory | None, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
    """``factory(optimizer)``, checked: an ``LRScheduler`` on this optimizer that steps without a metric."""
    if factory is None:
        return None
    scheduler = factory(optimizer)
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ConfigError("lr_scheduler_factory returned a ReduceLROnPlateau, which steps on a metric train_step "
                          "does not have; step it yourself on your validation metric and save its state_dict() in "
                          "data_state, or use a scheduler that steps by optimizer step (LambdaLR, CosineAnnealingLR...)")
    if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not optimizer:
        raise ConfigError(f"lr_scheduler_factory must return a torch.optim.lr_scheduler.LRScheduler built on the "
                          f"optimizer it is given; it returned {type(scheduler).__name__}"
                          f"{' on another optimizer' if isinstance(scheduler, LRScheduler) else ''}")
    try:
        scheduler_state(scheduler)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    return scheduler


def scheduler_state(scheduler: LRScheduler | None) -> dict[str, Any] | None:
    """``scheduler.state_dict()`` (``None`` without one); ``CheckpointError`` naming the first value that is not a
    number, string, ``None``, list, tuple or string-keyed dict."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    _check_plain(state, "lr_scheduler")
    return state


def restore_scheduler(scheduler: LRScheduler | None, state: dict[str, Any] | None, *, source: str,
                      groups: int) -> None:
    """Load ``state`` (saved in ``source``) into ``scheduler``; a logged warning when only one of them exists,
    ``CheckpointError`` when the state is for another number of param groups (``groups``)."""
    if state is None:
        if scheduler is not None:
            log.warning("%s holds no learning-rate scheduler state: this run's scheduler starts from its first "
                        "step (saved before the scheduler was passed, or by a run without one)", source)
        return
    if scheduler is None:
        log.warning("%s holds a learning-rate scheduler's state but this run has none (lr_scheduler_factory=): the "
                    "learning rate stays the saved optimizer's from now on", source)
        return
    _check_same_kind(scheduler, state, source)
    saved = state.get("base_lrs", state.get("_last_lr"))
    if isinstance(saved, (list, tuple)) and len(saved) != groups:
        raise CheckpointError(f"{source} holds a learning-rate scheduler for {len(saved)} param group(s), this rank's "
                              f"optimizer has {groups}; resume with the optimizer's param groups it was saved with")
    scheduler.load_state_dict(state)
    initial = [group.get("initial_lr") for group in scheduler.optimizer.param_groups]
    if None not in initial:  # this rank's own (rank 0's state may be another stage's)
        for each in _with_parts(scheduler):
            if hasattr(each, "base_lrs"):
                each.base_lrs = list(initial)


def _with_parts(scheduler: LRScheduler) -> list[LRScheduler]:
    """``scheduler`` and the schedulers it is made of (``SequentialLR``, ``ChainedScheduler``), depth first."""
    return [scheduler, *(part for sub in getattr(scheduler, "_schedulers", ()) for part in _with_parts(sub))]


def _check_same_kind(scheduler: LRScheduler, state: dict[str, Any], source: str, own: dict | None = None) -> None:
    """``CheckpointError`` unless ``state`` has only keys this scheduler's own state has, each of the same kind, and
    the same for the schedulers it is made of (``_schedulers``: one state each)."""
    own = scheduler.state_dict() if own is None else own
    foreign = sorted(set(state) - set(own))
    mismatched = sorted(key for key in set(state) & set(own) if _kind(state[key]) != _kind(own[key])
                        and None not in (state[key], own[key]))
    if foreign or mismatched:
        what = f"keys {', '.join(foreign[:3])}" if foreign else f"{', '.join(mismatched[:3])} of another type"
        raise CheckpointError(f"{source} holds the state of another learning-rate scheduler than this run's "
                              f"{type(scheduler).__name__} ({what}); resume with the lr_scheduler_factory it was "
                              "saved with")
    parts, own_parts = state.get("_schedulers"), own.get("_schedulers")
    if isinstance(parts, list) and isinstance(own_parts, list):
        if len(parts) != len(own_parts) or not all(isinstance(part, dict) for part in parts):
            shape = f"of {len(parts)} schedulers" if len(parts) != len(own_parts) else "whose schedulers' states are not dicts"
            raise CheckpointError(f"{source} holds a {type(scheduler).__name__} {shape}, this run's has "
                                  f"{len(own_parts)}; resume with the lr_scheduler_factory it was saved with")
        for part, own_part in zip(parts, own_parts):
            _check_same_kind(scheduler, part, source, own_part)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return type(value).__name__


def _check_plain(value: Any, key: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{key}[{index}]")
        return
    if isinstance(value, Counter) and all(isinstance(name, int) for name in value):  # MultiStepLR's milestones
        return
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        for name, item in value.items():
            _check_plain(item, f"{key}.{name}")
        return
    raise CheckpointError(f"the learning-rate scheduler's state holds {key}, a {type(value).__name__}: checkpoints "
                          "and snapshots keep numbers, strings, lists and dicts (a checkpoint received from someone "
                          "else must load without running code); give the scheduler plain attributes")
