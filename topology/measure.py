"""Timed runs on the live torch.distributed world: matmuls, copies, collectives and the framework overhead of
a reference transformer block (used by the profiler).

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
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)

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
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


class DeviceMeasurement(BaseModel):
    """What one rank achieved on its device while every rank ran the same benchmark."""

    model_config = FROZEN

    matmul_flops_by_dtype: dict[str, float]
    """Achieved dense matmul FLOP/s per dtype (slowest rank)."""
    matmul_dim: int
    """Square matmul size used."""
    memory_bandwidth_bytes_per_s: float
    """Achieved copy bandwidth (bytes read + written per second, slowest rank)."""
    copy_bytes: int
    """Size of the buffer copied."""
    threads_per_rank: int
    """``torch.get_num_threads()`` during the measurement."""
    solo_speedup: float = 1.0
    """Rank 0's fp32 matmul rate while the other ranks wait over its rate while every rank computes."""
    linear_overhead_s: dict[int, float] = Field(default_factory=dict)
    """Host seconds per linear of the reference block per micro-batch, forward and backward, by tensor-parallel
    degree (slowest rank, every rank running; CPU only): see ``measure_linear_overhead``."""
    fsdp_comm_slowdown: float | None = None
    """FSDP2's gathers and reduce-scatter of a unit over the bare collectives (CPU only): ``fsdp_slowdown``."""
    tp_compute_slowdown: dict[int, float] = Field(default_factory=dict)
    """A tensor-parallel block's arithmetic over its share of the whole block's, by degree (CPU only):
    ``tp_compute_slowdown``."""


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


def _rate(fn: Callable[[], None], *, device: torch.device, min_time_s: float) -> float:
    """Calls of ``fn`` per second: one warm-up, then as many calls as fit in ``min_time_s``."""
    fn()
    sync(device)
    calls, started = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        sync(device)
        elapsed = time.perf_counter() - started
        if elapsed >= min_time_s:
            return calls / elapsed


def _shared_rate(fn: Callable[[], None], *, device: torch.device, min_time_s: float) -> float:
    """Calls of ``fn`` per second per rank while every rank calls it: the same number of calls on every rank,
    enough for ``min_time_s``, over the slowest rank's time.

    Each rank timing its own window (``_rate``) reads high on ranks that share cores: ranks leave the barrier
    at different moments and finish at different moments, and a rank running while others have not started or
    are done gets more than its share (4 ranks on 2 cores: 48 to 82 GFLOP/s from one profile to the next, while
    one rank alone repeated within 15%). Over the slowest rank's time, every call of every rank is counted."""
    fn()
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    once = reduce_values([time.perf_counter() - started], op=dist.ReduceOp.MAX, device=device)[0]
    calls = max(2, math.ceil(min_time_s / max(once, 1e-9)))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    slowest = reduce_values([time.perf_counter() - started], op=dist.ReduceOp.MAX, device=device)[0]
    return calls / slowest


def measure_device(
    device: torch.device, *, sweep: ProfileSweep, bar: Any, tp_degrees: Sequence[int] = ()
) -> DeviceMeasurement:
    """Matmul FLOP/s and copy bandwidth with every rank running; on CPU ranks also the speed-up of a rank
    computing alone, the reference block's overhead per linear for ``tp_degrees`` (and plain tensors) and
    FSDP2's slowdown over the bare collectives."""
    task = bar.add_task("device: matmul, memory bandwidth, overhead", total=4) if bar else None
    dim = 8192 if device.type == "cuda" else 1024
    flops = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        n = dim if dtype == torch.float32 or device.type == "cuda" else dim // 2  # CPU bf16 may be emulated: keep it short
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        dist.barrier()
        flops[name] = 2 * n**3 * _shared_rate(lambda: torch.mm(a, b), device=device, min_time_s=sweep.compute_time_s)
        if bar:
            bar.advance(task)
    solo, overheads, fsdp, tp_slowdown = 1.0, {}, None, {}
    if device.type == "cpu":  # accelerators: a device per rank, and the host's overhead hides behind it
        solo = solo_speedup(flops["fp32"], dim=dim, device=device, sweep=sweep)
        overheads = measure_linear_overhead((1, *tp_degrees), flops_per_s=flops["fp32"], device=device, sweep=sweep)
        fsdp = fsdp_slowdown(device=device, sweep=sweep)
        tp_slowdown = tp_compute_slowdown(overheads, device=device, sweep=sweep)
    if bar:
        bar.advance(task)
    copy_bytes = (1024 if device.type == "cuda" else 64) * MiB
    src = torch.ones(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dist.barrier()
    bandwidth = 2 * copy_bytes * _shared_rate(lambda: dst.copy_(src), device=device, min_time_s=sweep.compute_time_s)
    if bar:
        bar.advance(task)
    values = reduce_values([flops["fp32"], flops["bf16"], bandwidth], op=dist.ReduceOp.MIN, device=device)
    return DeviceMeasurement(
        matmul_flops_by_dtype={"fp32": values[0], "bf16": values[1]}, matmul_dim=dim,
        memory_bandwidth_bytes_per_s=values[2], copy_bytes=copy_bytes, threads_per_rank=torch.get_num_threads(),
        solo_speedup=solo, linear_overhead_s=overheads, fsdp_comm_slowdown=fsdp, tp_compute_slowdown=tp_slowdown,
    )


def solo_speedup(shared_flops: float, *, dim: int, device: torch.device, sweep: ProfileSweep) -> float:
    """Rank 0's matmul rate alone, the others blocked in a barrier, over ``shared_flops`` (its rate while every
    rank ran): ranks sharing cores get the idle ranks' share. Never below 1 (noise)."""
    a, b = torch.randn(dim, dim, device=device), torch.randn(dim, dim, device=device)
    dist.barrier()
    alone = 0.0
    if dist.get_rank() == 0:
        alone = 2 * dim**3 * _rate(lambda: torch.mm(a, b), device=device, min_time_s=sweep.compute_time_s)
    ratio = reduce_values([alone / shared_flops], op=dist.ReduceOp.MAX, device=device)[0]
    return max(1.0, ratio)


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
        return lambda: _ALL_GATHER(full, shard, group=group)
    if collective == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(shard, full, group=group)
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


# --------------------------------------------------------------------------- framework overhead of a block

REFERENCE_WIDTH, REFERENCE_HEADS, REFERENCE_TOKENS = 64, 8, 32
"""A block this small does almost no arithmetic: its time is the framework's (Python, dispatch, autograd,
DTensor, collectives' fixed costs). 8 heads and 32 tokens split over up to 8 tensor-parallel ranks."""
REFERENCE_LINEARS = 6
"""Linears of the reference block (q, k, v, o, up, down): its overhead is reported per linear."""


class _ReferenceAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.head_dim = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)


class _ReferenceMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _ReferenceBlock(nn.Module):
    """A pre-norm transformer block as the GPT reference model builds it (separate q/k/v, causal SDPA, GELU)."""

    def __init__(self, width: int = REFERENCE_WIDTH, heads: int = REFERENCE_HEADS) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(width), _ReferenceAttention(width, heads)
        self.mlp_norm, self.mlp = nn.LayerNorm(width), _ReferenceMLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def measure_linear_overhead(
    degrees: Sequence[int], *, flops_per_s: float, device: torch.device, sweep: ProfileSweep
) -> dict[int, float]:
    """Host seconds per linear of the reference block per micro-batch (forward + backward), by tensor-parallel
    degree, every rank running at once (as in training), slowest rank; the block's arithmetic at
    ``flops_per_s`` is taken out. Degree ``t > 1`` splits the block over groups of ``t`` consecutive ranks as
    the runtime does (Megatron pairs with sequence parallelism, DTensor): its dispatch and its collectives'
    fixed costs are in the figure."""
    world = dist.get_world_size()
    block = _ReferenceBlock().to(device)
    hidden = torch.randn(1, REFERENCE_TOKENS, REFERENCE_WIDTH, device=device)  # (B, T, H)
    flops = _block_flops(block, hidden)
    overheads = {}
    for degree in degrees:
        if world % degree or REFERENCE_HEADS % degree:
            continue
        run = _plain_pass(block, hidden) if degree == 1 else _tensor_parallel_pass(degree, device=device)
        seconds = _pass_seconds(run, device=device, sweep=sweep)
        overheads[degree] = per_linear_overhead_s(seconds, arithmetic_s=flops / degree / flops_per_s)
    return overheads


def per_linear_overhead_s(pass_s: float, *, arithmetic_s: float) -> float:
    """Host seconds per linear of the reference block: what a pass took beyond its arithmetic, shared among its
    linears, never below ``MEASURED_FLOOR_S`` (under load the arithmetic estimate can exceed the whole pass)."""
    return at_measured_floor((pass_s - arithmetic_s) / REFERENCE_LINEARS)


def at_measured_floor(seconds: float) -> float:
    """``seconds``, or ``MEASURED_FLOOR_S`` where it is smaller (zero, negative or NaN): a time the profiler
    records is one a cluster file can hold."""
    return seconds if seconds >= MEASURED_FLOOR_S else MEASURED_FLOOR_S


def _block_flops(block: nn.Module, hidden: torch.Tensor) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        block(hidden).sum().backward()
    return float(counter.get_total_flops())


def _plain_pass(block: nn.Module, hidden: torch.Tensor) -> Callable[[], None]:
    return lambda: block(hidden).sum().backward()


def _tensor_parallel_pass(
    degree: int, *, device: torch.device, width: int = REFERENCE_WIDTH, tokens: int = REFERENCE_TOKENS
) -> Callable[[], None]:
    """Forward + backward of a reference block split over this rank's group of ``degree`` consecutive ranks,
    the residual stream sharded over the sequence between the pairs (``runtime.tensor_parallel``'s layout)."""
    mesh = DeviceMesh(device.type, torch.arange(dist.get_world_size()).reshape(-1, degree), mesh_dim_names=("rest", "tp"))
    styles = {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
              "attn": _gather_sequence(), "mlp": _gather_sequence(),
              **{f"attn.{name}": ColwiseParallel() for name in "qkv"}, "mlp.up": ColwiseParallel(),
              "attn.o": RowwiseParallel(output_layouts=Shard(1)), "mlp.down": RowwiseParallel(output_layouts=Shard(1))}
    block = parallelize_module(_ReferenceBlock(width).to(device), mesh["tp"], styles)
    local = torch.randn(1, tokens // degree, width, device=device)  # (B, T / tp, H)
    return lambda: block(local).sum().backward()


def _gather_sequence() -> PrepareModuleInput:
    """All-gather the sequence-sharded residual stream in front of a pair's column linears."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def _pass_seconds(run: Callable[[], None], *, device: torch.device, sweep: ProfileSweep, min_calls: int | None = None) -> float:
    """Seconds per call of ``run`` on every rank at once: the same number of calls everywhere (collectives
    inside must match), at least ``trials`` and enough for ``compute_time_s``; the median per rank, then the
    slowest rank. The median, not the faster half: ranks sharing cores wait for each other's wake-ups in
    training too (4 ranks on 2 cores: faster-half means of 5 calls of a tensor-parallel block spread 2x)."""
    for _ in range(3):  # warm-up: sharding propagation caches, allocator
        run()
    dist.barrier()
    started = time.perf_counter()
    run()
    sync(device)
    once = reduce_values([time.perf_counter() - started], op=dist.ReduceOp.MAX, device=device)[0]
    calls = max(sweep.trials if min_calls is None else min_calls, min(500, math.ceil(sweep.compute_time_s / max(once, 1e-9))))
    times = []
    dist.barrier()
    for _ in range(calls):
        started = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - started)
    return reduce_values([statistics.median(times)], op=dist.ReduceOp.MAX, device=device)[0]


FSDP_UNIT_WIDTH, FSDP_UNIT_LINEARS = 512, 4
"""The unit ``fsdp_slowdown`` shards: 4 square linears of 512, 4 MiB of fp32 parameters (a small block's)."""


def fsdp_slowdown(*, device: torch.device, sweep: ProfileSweep) -> float:
    """How many times longer FSDP2 takes to gather a unit's parameters (forward and backward) and reduce-scatter
    its gradients than the bare all-gathers and reduce-scatter of the same bytes, every rank at once over the
    world (ZeRO-3 on one token: next to no arithmetic, which a plain forward + backward takes out). Never
    below 1 (noise)."""
    def unit() -> nn.Module:
        return nn.Sequential(*(nn.Linear(FSDP_UNIT_WIDTH, FSDP_UNIT_WIDTH, bias=False) for _ in range(FSDP_UNIT_LINEARS)))

    world = dist.get_world_size()
    token = torch.randn(1, FSDP_UNIT_WIDTH, device=device)  # (B, H)
    plain = unit().to(device)
    sharded = fully_shard(unit().to(device), mesh=DeviceMesh(device.type, torch.arange(world)), reshard_after_forward=True)
    full = torch.empty(FSDP_UNIT_LINEARS * FSDP_UNIT_WIDTH**2, device=device)  # the unit's parameters, flat
    shard = torch.empty(full.numel() // world, device=device)

    def bare() -> None:
        for _ in range(2):  # forward and backward gathers
            _ALL_GATHER(full, shard)
        _REDUCE_SCATTER(shard, full)

    arithmetic = _pass_seconds(lambda: plain(token).sum().backward(), device=device, sweep=sweep)
    fsdp = _pass_seconds(lambda: sharded(token).sum().backward(), device=device, sweep=sweep)
    return max(1.0, (fsdp - arithmetic) / _pass_seconds(bare, device=device, sweep=sweep))


TP_BLOCK_WIDTH, TP_BLOCK_TOKENS, TP_BLOCK_CALLS = 256, 1024, 7
"""The block ``tp_compute_slowdown`` splits: a small model's width (``benchmarks/local_truth.py``) on four
sequences of 256 tokens, ~0.15 s of arithmetic at a CPU rank's rate, timed over 7 calls (the profile's time
budget): enough arithmetic between collectives for the slowdown to show (on 256 tokens the fixed costs per
linear swamp it; 4 ranks on 2 cores, 2026-11-30: 1.3x at degrees 2 and 4 on 2048 tokens)."""


def tp_compute_slowdown(overheads: dict[int, float], *, device: torch.device, sweep: ProfileSweep) -> dict[int, float]:
    """How many times longer a block's arithmetic takes split over ``t`` ranks than ``1/t`` of the whole block's,
    for each degree ``t > 1`` in ``overheads`` (every rank running, ``t``-rank groups side by side; CPU only).

    Ranks that share cores and meet at every collective of a layer wait for each other, and the split block
    moves more bytes per FLOP (sequence-parallel gathers, DTensor's redistributions). The fixed costs per
    linear (``overheads``, ``measure_linear_overhead``) are taken out of both passes. Never below 1 (noise)."""
    block = _ReferenceBlock(TP_BLOCK_WIDTH).to(device)
    hidden = torch.randn(1, TP_BLOCK_TOKENS, TP_BLOCK_WIDTH, device=device)  # (B, T, H)

    def arithmetic_s(run: Callable[[], None], degree: int) -> float:
        seconds = _pass_seconds(run, device=device, sweep=sweep, min_calls=TP_BLOCK_CALLS)
        return seconds - REFERENCE_LINEARS * overheads[degree]

    whole = arithmetic_s(_plain_pass(block, hidden), 1)
    slowdowns = {}
    for degree in sorted(d for d in overheads if d > 1):
        split = arithmetic_s(_tensor_parallel_pass(degree, device=device, width=TP_BLOCK_WIDTH, tokens=TP_BLOCK_TOKENS), degree)
        slowdowns[degree] = max(1.0, split * degree / max(whole, 1e-9))
    return slowdowns
