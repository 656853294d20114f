"""The plan a checkpoint was saved under, read without building anything (shared by elastic resume, snapshot
recovery and the CLI's ``resume``; its own module so neither of the first two imports the other)."""

from __future__ import annotations

from pathlib import Path

from tessera.errors import CheckpointError
from tessera.planner.plan import Plan
from tessera.runtime.checkpoint_files import PLAN_FILE, select_checkpoint
from tessera.topology.validation import quoted


def saved_plan(checkpoint: str | Path) -> Plan:
    """The plan stored in ``checkpoint`` (a ``step-*`` folder, or a root: its newest intact checkpoint, by sizes).

    The checkpoint's DCP metadata is read too, through the restricted reader, so a checkpoint that a load would
    refuse (crafted or unreadable) is refused here, before anyone relaunches a run on it."""
    from tessera.runtime.checkpoint_reader import load_metadata  # after the cheap checks: DCP takes seconds to import

    folder, _ = select_checkpoint(Path(checkpoint), verify=False, group=None)
    load_metadata(folder)
    return Plan.from_json(folder / PLAN_FILE)


def check_same_model(plan: Plan, checkpoint: str | Path, *, saved: Plan | None = None) -> None:
    """Raise ``CheckpointError`` if ``checkpoint`` was saved from a model of another size than ``plan``'s
    (``saved``: its plan, already read; an in-memory snapshot's, which has no DCP metadata)."""
    saved = saved if saved is not None else saved_plan(checkpoint)
    if saved.param_count != plan.param_count:
        raise CheckpointError(
            f"checkpoint {checkpoint} was saved from {quoted(saved.model_name)} ({saved.param_count:,} parameters) but "
            f"this model, {plan.model_name}, has {plan.param_count:,}; resume with the model it was saved from"
        )
