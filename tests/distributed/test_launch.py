"""The local launcher: results come back in rank order; a failing or hanging rank is reported, not waited on."""

import time

import pytest
import torch
import torch.distributed as dist

from tessera.errors import TesseraError
from tessera.runtime.launch import WorkerError, WorkerTimeoutError, spawn

pytestmark = pytest.mark.distributed


def _rank_world_and_sum(offset: int) -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)  # proves the process group is live
    return dist.get_rank(), dist.get_world_size(), value.item() + offset


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 blocks here forever; the launcher must kill it


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


def test_hanging_ranks_raise_a_timeout_error():
    started = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as caught:
        spawn(_sleep_forever, nprocs=2, timeout_s=4)
    assert isinstance(caught.value, TesseraError) and isinstance(caught.value, TimeoutError)
    assert "[0, 1]" in str(caught.value)
    assert time.monotonic() - started < 20
