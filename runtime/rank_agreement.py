"""Calls every rank of a process group makes alike, for the checkpoint and snapshot code: this rank and the
group's size, objects shared or gathered, and actions whose failure on any rank is raised on all of them.
``group`` None means this process alone (no process group): every helper is then the identity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from tessera.errors import CheckpointError

T = TypeVar("T")


def together(action: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> T:
    """``action()`` on every rank; if it fails on any rank, the same ``CheckpointError`` is raised on all of them."""
    value, problem = attempt(action, group, what=what)
    problems = [p for p in all_gather(problem, group) if p]
    if problems:
        raise CheckpointError(problems[0])
    return value


def attempt(action: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> tuple[T | None, str | None]:
    """``(action(), None)``, or ``(None, one line saying what failed on this rank)`` if it raised."""
    from torch.distributed.checkpoint.api import CheckpointException  # here: DCP takes seconds to import

    try:
        return action(), None
    except CheckpointError as error:
        return None, str(error)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        return None, f"{what} failed on rank {rank(group)}: {describe_failure(error)}"


def describe_failure(error: BaseException) -> str:
    """One line for an error, looking inside DCP's ``CheckpointException`` for the rank's own exception."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: each rank's own exception
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}" + (f" ({error.filename})" if error.filename else "")
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``."""
    return dist.get_rank(group) if group is not None else 0


def world(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``."""
    return dist.get_world_size(group) if group is not None else 1


def broadcast(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``value`` on every rank."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather(value: Any, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``value``, in rank order."""
    if group is None:
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every rank of ``group``."""
    if group is not None:
        dist.barrier(group=group)
