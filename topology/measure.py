"""Timed collectives on the live torch.distributed world, and the timing helpers every measurement shares (used by
the profiler; the device's own figures, matmuls, copies and framework overhead, are ``topology.measure_device``).

A trial is ``k`` back-to-back ops after a barrier (``k`` makes a trial last ``ProfileSweep.min_trial_s``);
trials sweep every point in turn, ``trials`` times, so a burst of load elsewhere on the machine lands on
one trial of many points, not on every trial of one. A point's time is the mean of the faster half of its
trials, each the slowest rank's per-op time: scheduling delays only ever add time, so the slow half is
mostly noise from elsewhere. Every rank ends with the same numbers (timings are reduced across ranks).

A pass runs the points smallest message first, so each point follows one of its own size: a latency-bound
point timed right after a multi-MiB one read up to 2x slow on 4 ranks sharing 2 cores (the 4 KiB points,
which followed the previous collective's 16 MiB one), and that pulled the fitted latency up.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field

from tessera.errors import TesseraError
from tessera.topology.cluster import COLLECTIVES, FROZEN, Collective
from tessera.topology.fitting import Measurement

MiB = 2**20
MEASURED_FLOOR_S = max(time.get_clock_info("perf_counter").resolution, 1e-9)
"""Smallest positive time the profiler records (the timer's resolution, 1 ns on Linux): a measured difference
at or below it is noise, and recording it as 0 or less would write a cluster file that refuses to load."""
CALIBRATION_RUNS = 3
"""Timed runs per point before the trials; the fastest (slowest rank) sets the ops per trial."""
# torch 2.13 renamed the single-tensor forms (the old names warn); same (output, input) order.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProfileError(TesseraError):
    """Profiling could not run or a rank failed; the message names the cause."""


class ProfileSweep(BaseModel):
    """What ``profile_world`` measures and how long it may take."""

    model_config = FROZEN

    sizes_bytes: tuple[int, ...] = tuple(2**k for k in range(12, 25))
    """Message sizes (bytes, as the cost functions define them): 4 KiB to 16 MiB in powers of two."""
    collectives: tuple[Collective, ...] = COLLECTIVES
    """Collectives to measure (point-to-point runs on pairs only)."""
    trials: int = Field(default=19, gt=0)
    """Trials per point; each is ``k`` back-to-back ops. Many short trials beat a few long ones: on ranks
    that share CPU cores one trial of a small collective can take 1-6x another (wake-ups queue behind other
    ranks), and the faster-half mean of ~20 trials repeats within ~15% where that of 7 repeated within ~30%
    (odd vs even trials, 4 gloo ranks on 2 cores; ``benchmarks/collectives_fit.py``)."""
    long_op_trials: int = Field(default=10, gt=0)
    """Trials for a point whose one op outlasts ``min_trial_s`` (a trial of one op: multi-MiB messages). Their
    time is bandwidth, not a chain of wake-ups, and repeats within ~5-10% (odd vs even trials, 4 gloo ranks on 2
    cores), so fewer trials suffice, and the time saved goes to the latency-bound points' trials."""
    min_trial_s: float = Field(default=0.007, gt=0)
    """Ops per trial are chosen so a trial lasts at least this long: a latency-bound op is a chain of
    process wake-ups, and averaging several of them smooths the scheduler's noise."""
    max_ops_per_trial: int = Field(default=50, gt=0)
    """Upper bound on ops per trial."""
    compute_time_s: float = Field(default=0.3, gt=0)
    """Seconds each matmul / copy benchmark runs for."""

    @classmethod
    def quick(cls) -> "ProfileSweep":
        """A reduced sweep for tests and smoke runs (a few seconds on 2 CPU ranks)."""
        return cls(sizes_bytes=(2**12, 2**16, 2**20), trials=3, long_op_trials=2, min_trial_s=0.002, compute_time_s=0.1)


def groups_of(world: int, group_size: int, stride: int) -> list[list[int]]:
    """The concurrent groups of a layout: ``group_size`` ranks ``stride`` apart, tiling the world."""
    block = group_size * stride
    return [
        [base + offset + i * stride for i in range(group_size)]
        for base in range(0, world, block)
        for offset in range(stride)
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reduce_values(values: Sequence[float], *, op: Any, device: torch.device) -> list[float]:
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def measure_collectives(layouts: Sequence[tuple[int, int]], device: torch.device, *, sweep: ProfileSweep, bar: Any) -> list[Measurement]:
    """Every collective on every layout and size (point-to-point on pairs, timed as half a ping-pong)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    points = []  # (collective, group_size, stride, nbytes, op)
    for group_size, stride in layouts:
        groups = groups_of(world, group_size, stride)
        mine, _ = dist.new_subgroups_by_enumeration(groups)
        members = next(g for g in groups if rank in g)
        for collective in sweep.collectives:
            if collective == "p2p" and group_size != 2:
                continue
            for nbytes in sweep.sizes_bytes:
                op = _collective_op(collective, nbytes, group=mine, members=members, device=device)
                points.append((collective, group_size, stride, nbytes, op))
    points.sort(key=lambda point: point[3])  # smallest first, each point after one of its own size (module docstring)
    ops_per_trial = _calibrate(points, device=device, sweep=sweep, bar=bar)
    trials = _run_trials(points, ops_per_trial, device=device, sweep=sweep, bar=bar)
    halved = [[x / 2 for x in t] if c == "p2p" else t for (c, *_), t in zip(points, trials)]  # p2p: round trip
    return [
        Measurement(collective=c, group_size=g, stride=s, nbytes=n, seconds=faster_half_mean(t), trials_s=tuple(t))
        for (c, g, s, n, _), t in zip(points, halved)
    ]


def faster_half_mean(trials: Sequence[float]) -> float:
    """Mean of the faster half of ``trials`` (all of one trial): robust to delays that only add time."""
    ordered = sorted(trials)
    return statistics.fmean(ordered[: max(1, len(ordered) // 2)])


def _collective_op(collective: str, nbytes: int, *, group: Any, members: list[int], device: torch.device) -> Callable[[], None]:
    """A closure running one ``collective`` of ``nbytes`` (fp32) on this rank's group."""
    n, g = nbytes // 4, len(members)
    me = members.index(dist.get_rank())
    full = torch.ones(n, device=device)
    shard = torch.ones(n // g, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if collective == "all_gather":
        return lambda: ALL_GATHER(full, shard, group=group)
    if collective == "reduce_scatter":
        return lambda: REDUCE_SCATTER(shard, full, group=group)
    if collective == "all_to_all":
        received = torch.empty_like(full)
        return lambda: dist.all_to_all_single(received, full, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(full, src=members[0], group=group)
    if collective == "p2p":  # ping-pong: one op is a round trip, two messages (halved by the caller)
        peer = members[1 - me]

        def ping() -> None:
            dist.send(full, dst=peer, group=group)
            dist.recv(full, src=peer, group=group)

        def pong() -> None:
            dist.recv(full, src=peer, group=group)
            dist.send(full, dst=peer, group=group)

        return ping if me == 0 else pong
    raise ProfileError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def _calibrate(points: list, *, device: torch.device, sweep: ProfileSweep, bar: Any) -> list[int]:
    """Ops per trial for each point, agreed by all ranks (the slowest rank's best calibration run)."""
    task = bar.add_task("collectives: warm-up", total=len(points)) if bar else None
    once = []
    for *_, op in points:
        op()  # warm-up: connections, allocations
        best = math.inf
        for _ in range(CALIBRATION_RUNS):
            dist.barrier()
            started = time.perf_counter()
            op()
            sync(device)
            best = min(best, time.perf_counter() - started)
        once.append(best)
        if bar:
            bar.advance(task)
    slowest = reduce_values(once, op=dist.ReduceOp.MAX, device=device)
    return [max(1, min(sweep.max_ops_per_trial, math.ceil(sweep.min_trial_s / max(t, 1e-9)))) for t in slowest]


def _run_trials(points: list, ops_per_trial: list[int], *, device: torch.device, sweep: ProfileSweep, bar: Any) -> list[list[float]]:
    """Sweep every point once per pass, ``trials`` passes (``long_op_trials`` for a point of one op per trial);
    each trial's time is the slowest rank's."""
    counts = [sweep.trials if k > 1 else min(sweep.trials, sweep.long_op_trials) for k in ops_per_trial]
    task = bar.add_task("collectives: timing", total=sum(counts)) if bar else None
    local = [[] for _ in points]
    for trial in range(sweep.trials):
        for i, ((*_, op), k) in enumerate(zip(points, ops_per_trial)):
            if trial >= counts[i]:
                continue
            dist.barrier()
            started = time.perf_counter()
            for _ in range(k):
                op()
            sync(device)
            local[i].append((time.perf_counter() - started) / k)
            if bar:
                bar.advance(task)
    flat = iter(reduce_values([t for row in local for t in row], op=dist.ReduceOp.MAX, device=device))
    return [[next(flat) for _ in range(count)] for count in counts]
