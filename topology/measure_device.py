"""Timed runs of the device itself on the live torch.distributed world (used by the profiler): matmul rate and
memory bandwidth with every rank busy, the speed-up of one rank alone, and the framework overhead of a reference
transformer block (per linear, under tensor parallelism, and FSDP2's over its bare collectives). The collectives
and the shared timing helpers are ``topology.measure``.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash
from pydantic import BaseModel, Field
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)

from tessera.topology.cluster import FROZEN
from tessera.topology.measure import (
    ALL_GATHER, MEASURED_FLOOR_S, REDUCE_SCATTER, MiB, ProfileSweep, reduce_values, sync,
)


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
    snapshot_fixed_s: float | None = None
    """Seconds of a snapshot's work per rank that do not grow with its bytes (CPU only): ``snapshot_work``."""
    snapshot_bytes_per_s: float | None = None
    """Bytes of a rank's state per second its snapshot work gets through (CPU only): ``snapshot_work``."""
    snapshot_swap_bytes_per_s: float | None = None
    """Bytes per second of the swap with a buddy rank on top of it (CPU only, 2 ranks or more): ``snapshot_work``."""


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


FP8_CPU_DIM = 128
"""Square size of the FP8 product timed on CPU ranks: torch 2.13's CPU ``_scaled_mm`` is a reference loop
(0.06 GFLOP/s per rank, ``benchmarks/results/cluster-x86_64-cpu-2026-12-04.yaml``), so a larger one takes seconds."""


def fp8_matmul_flops(device: torch.device, *, dim: int, sweep: ProfileSweep) -> float:
    """FLOP/s of ``torch._scaled_mm`` on e4m3 operands with every rank running (what FP8 training's linears
    run), or 0 where this device or torch has no FP8 matmul (then the profile records no fp8 rate)."""
    a = torch.randn(dim, dim, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(dim, dim, device=device).to(torch.float8_e4m3fn).t()  # column-major, as the kernels want
    one = torch.ones((), device=device)

    def product() -> None:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        product()
    except (RuntimeError, NotImplementedError):
        return 0.0
    dist.barrier()
    return 2 * dim**3 * _shared_rate(product, device=device, min_time_s=sweep.compute_time_s)


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
    fp8 = fp8_matmul_flops(device, dim=dim if device.type == "cuda" else FP8_CPU_DIM, sweep=sweep)
    solo, overheads, fsdp, tp_slowdown, snapshot = 1.0, {}, None, {}, (None, None, None)
    if device.type == "cpu":  # accelerators: a device per rank, and the host's overhead hides behind it
        solo = solo_speedup(flops["fp32"], dim=dim, device=device, sweep=sweep)
        overheads = measure_linear_overhead((1, *tp_degrees), flops_per_s=flops["fp32"], device=device, sweep=sweep)
        fsdp = fsdp_slowdown(device=device, sweep=sweep)
        tp_slowdown = tp_compute_slowdown(overheads, device=device, sweep=sweep)
        snapshot = snapshot_work(sweep=sweep)
    if bar:
        bar.advance(task)
    copy_bytes = (1024 if device.type == "cuda" else 64) * MiB
    src = torch.ones(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dist.barrier()
    bandwidth = 2 * copy_bytes * _shared_rate(lambda: dst.copy_(src), device=device, min_time_s=sweep.compute_time_s)
    if bar:
        bar.advance(task)
    values = reduce_values([flops["fp32"], flops["bf16"], bandwidth, fp8], op=dist.ReduceOp.MIN, device=device)
    by_dtype = {"fp32": values[0], "bf16": values[1]} | ({"fp8": values[3]} if values[3] > 0 else {})
    return DeviceMeasurement(
        matmul_flops_by_dtype=by_dtype, matmul_dim=dim,
        memory_bandwidth_bytes_per_s=values[2], copy_bytes=copy_bytes, threads_per_rank=torch.get_num_threads(),
        solo_speedup=solo, linear_overhead_s=overheads, fsdp_comm_slowdown=fsdp, tp_compute_slowdown=tp_slowdown,
        snapshot_fixed_s=snapshot[0], snapshot_bytes_per_s=snapshot[1], snapshot_swap_bytes_per_s=snapshot[2],
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
            ALL_GATHER(full, shard)
        REDUCE_SCATTER(shard, full)

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


SNAPSHOT_PROBE_BYTES = (1 * MiB, 16 * MiB)
"""State sizes ``snapshot_work`` times (the small models' snapshots: 16 MB per rank on 4 ranks); the fixed part
and the rate come from the line through the two, the swap's rate from the larger one with and without it."""
SNAPSHOT_PROBE_FILES = 3
"""Files each rank's probe rotates through, as a store does (``keep`` 2 plus the one being written)."""


def snapshot_work(*, sweep: ProfileSweep) -> tuple[float | None, float | None, float | None]:
    """(fixed seconds, bytes per second, swap bytes per second) of an in-memory snapshot's work on one rank while
    every rank snapshots (``runtime.snapshots``, CPU ranks): copy the state to a staging buffer, rewrite a store
    file with it, hash it (XXH3-128), agree with one small all-reduce; and, on top, swap it with another rank
    into a mapped store file (``None`` on one rank). Where training runs on these cores, a snapshot costs
    training that time (``cost_models.reliability``). Timed in a temporary folder that is removed after, in
    ``/dev/shm`` where it has room for every rank of the host, else the temporary folder; all ``None`` on every
    rank when some rank has room in neither (a container's 64 MB ``/dev/shm`` next to a full disk)."""
    root = _probe_root()
    if not reduce_values([0.0 if root is None else 1.0], op=dist.ReduceOp.MIN, device=torch.device("cpu"))[0]:
        return None, None, None
    small, large = SNAPSHOT_PROBE_BYTES
    with tempfile.TemporaryDirectory(prefix="tessera-profile-", dir=root) as folder:
        alone = [_snapshot_seconds(nbytes, folder=Path(folder), sweep=sweep, swap=False) for nbytes in (small, large)]
        swapped = None
        if dist.get_world_size() > 1:
            swapped = _snapshot_seconds(large, folder=Path(folder), sweep=sweep, swap=True)
    slope = (alone[1] - alone[0]) / (large - small)
    if slope * large < alone[1] / 10:  # noise swamped the difference: all of it per byte, the dearer reading
        fixed, rate = 0.0, large / alone[1]
    else:
        fixed, rate = max(0.0, alone[0] - slope * small), 1.0 / slope
    swap = None if swapped is None else large / max(swapped - alone[1], alone[1] / 100)
    return fixed, rate, swap


def _probe_root() -> str | None:
    """``/dev/shm``, else the temporary folder, whichever has room for the probe's files of every rank on this
    host (twice over); ``None`` if neither has."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    needed = 2 * ranks_here * 2 * SNAPSHOT_PROBE_FILES * max(SNAPSHOT_PROBE_BYTES)
    for root in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(root) and shutil.disk_usage(root).free >= needed:
            return root
    return None


def _snapshot_seconds(nbytes: int, *, folder: Path, sweep: ProfileSweep, swap: bool) -> float:
    """Seconds per snapshot of ``nbytes`` on each rank, every rank at once (``snapshot_work``). Store files are
    recycled as the runtime's are: the own file rewritten in place, the swapped copy received into a mapped
    file (``runtime.snapshot_store``)."""
    rank = dist.get_rank()
    own = [folder / f"rank{rank}-{slot}" for slot in range(SNAPSHOT_PROBE_FILES)]
    for path in own:
        path.write_bytes(bytes(nbytes))
    with contextlib.ExitStack() as stack:
        mappings = [_mapping(stack, folder / f"buddy{rank}-{slot}", nbytes)
                    for slot in range(SNAPSHOT_PROBE_FILES if swap else 0)]
        return _timed_snapshots(nbytes, own=own, mappings=mappings, sweep=sweep)


def _timed_snapshots(nbytes: int, *, own: list[Path], mappings: list[mmap.mmap], sweep: ProfileSweep) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = torch.randn(nbytes // 4).view(torch.uint8)
    staging = torch.zeros(nbytes, dtype=torch.uint8)
    received = [torch.frombuffer(mapping, dtype=torch.uint8) for mapping in mappings]
    flags = torch.zeros(world, dtype=torch.int64)
    taken = iter(range(1 << 62))

    def snapshot() -> None:
        slot = next(taken) % SNAPSHOT_PROBE_FILES
        staging.copy_(state)
        with open(own[slot], "r+b") as file:
            file.write(memoryview(staging.numpy()))
        flags.zero_()
        flags[rank] = xxhash.xxh3_128_intdigest(memoryview(staging.numpy())) & 0xFFFF
        if received:  # a ring shift: each rank sends to the next and receives from the one before
            requests = (dist.isend(staging, (rank + 1) % world), dist.irecv(received[slot], (rank - 1) % world))
            for request in requests:
                request.wait()
        dist.all_reduce(flags)

    try:
        return 1.0 / _shared_rate(snapshot, device=torch.device("cpu"), min_time_s=sweep.compute_time_s)
    finally:
        received.clear()  # no tensor over a mapping outlives it, even in a traceback


def _mapping(stack: contextlib.ExitStack, path: Path, nbytes: int) -> mmap.mmap:
    """``path`` created at ``nbytes`` and mapped (both closed with ``stack``); its pages allocated up front where
    the platform can (a full store then fails here, not with SIGBUS in the copy)."""
    file = stack.enter_context(open(path, "w+b"))
    file.truncate(nbytes)
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(file.fileno(), 0, nbytes)
    return stack.enter_context(mmap.mmap(file.fileno(), nbytes))
