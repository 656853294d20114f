"""Launching ranks: ``spawn`` (local gloo ranks for tests) and ``launch_commands`` (torchrun / SLURM lines).

``launch_commands(plan, script, nodes=...)`` returns the shell lines that start ``script`` with the plan's
world size on a multi-node cluster: one ``torchrun`` line per node, or a SLURM batch script whose ``srun``
starts one ``torchrun`` per node with c10d rendezvous on the first node. The script is expected to call
``apply_plan``/``auto_parallelize`` with the same plan on every rank.

``spawn``: start N local ranks, each with an initialised gloo process group, and collect what they return.

``spawn`` is the small launcher the distributed tests (and local experiments) use. It starts real
processes with the ``spawn`` start method, rendezvouses them through a ``file://`` store in a fresh
temporary folder, and passes each rank's return value (or its traceback) back through a file per rank,
so a large return value can never block a process from exiting the way a full pipe can.

Inside ``fn`` a rank learns its number from ``torch.distributed.get_rank()``. As with every ``spawn``
start method, ``fn`` and ``args`` must be picklable (``fn`` defined at module level) and a script that
calls ``spawn`` must guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shlex
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.errors import ClusterSpecError, ConfigError, NotModelledError, TesseraError
from tessera.planner.plan import Plan
from tessera.topology import load_cluster
from tessera.topology.cluster import Cluster
from tessera.topology.hardware import LOCAL_CPU

POLL_INTERVAL_S = 0.05
DEFAULT_MASTER_PORT = 29500


class WorkerError(TesseraError):
    """A spawned rank raised or died; the message holds its rank number and traceback."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Spawned ranks ran past the launcher's time limit and were killed."""


class RankCrashedError(WorkerError):
    """A rank died by a signal (a segfault or abort inside torch or gloo, or the OOM killer), not by raising."""


def spawn(
    fn: Callable[..., Any], *, nprocs: int, args: tuple = (), timeout_s: float = 120, crash_retries: int = 0,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` gloo ranks; return each rank's result in rank order.

    If a rank raises (or dies), the others are killed and ``WorkerError`` names the rank that failed
    first, with its traceback. If the ranks are not all done after ``timeout_s`` seconds they are
    killed and ``WorkerTimeoutError`` is raised. A rank killed by a signal is reported with its threads'
    stacks where Python's fault handler could write them (``RankCrashedError`` when that death came first).
    With ``crash_retries`` every rank is started again up to that many times after such a crash, each retry
    announced by a ``RuntimeWarning`` with the crash: for an ``fn`` that is safe to run again (nothing it leaves
    on disk trips a second run), where a rare crash inside torch or gloo's C++ is not what the caller checks (on 2
    loaded CPU cores gloo ranks have, rarely, died by SIGSEGV or SIGABRT inside a collective; PLATFORM-NOTES). A
    spawn whose first failure was a rank raising, or that timed out, is never retried. A rank that wrote its result
    and then died while exiting keeps its result, with a ``RuntimeWarning`` that shows its stacks.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    if crash_retries < 0:
        raise ValueError(f"crash_retries must be 0 or more, got {crash_retries}")
    first_crash = None
    for attempt in range(crash_retries + 1):
        try:
            return _spawn_once(fn, args, nprocs=nprocs, timeout_s=timeout_s)
        except RankCrashedError as crash:
            if attempt == crash_retries:
                if first_crash is None:
                    raise
                raise RankCrashedError(f"{crash} (it crashed on all {crash_retries + 1} attempts)") from first_crash
            first_crash = first_crash or crash
            warnings.warn(f"starting all {nprocs} ranks of {getattr(fn, '__name__', fn)} again "
                          f"(retry {attempt + 1} of {crash_retries}) after a crash: {crash}", RuntimeWarning, stacklevel=2)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _spawn_once(fn: Callable[..., Any], args: tuple, *, nprocs: int, timeout_s: float) -> list:
    workdir = Path(tempfile.mkdtemp(prefix="tessera-spawn-"))
    try:
        procs = _start_ranks(fn, args, nprocs=nprocs, workdir=workdir, timeout_s=timeout_s)
        try:
            _wait_for_ranks(procs, workdir=workdir, timeout_s=timeout_s)
        finally:
            _kill(procs)
        return _collect_results(workdir, nprocs)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _start_ranks(fn, args, *, nprocs: int, workdir: Path, timeout_s: float) -> list:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(nprocs):
        proc = ctx.Process(
            target=_run_rank,
            args=(fn, args, rank, nprocs, str(workdir), timeout_s),
            name=f"tessera-rank{rank}",
            daemon=False,  # a rank may start its own workers (DataLoader, inductor compile pool)
        )
        proc.start()
        procs.append(proc)
    return procs


def _run_rank(fn, args, rank: int, world_size: int, workdir: str, timeout_s: float) -> None:
    """Body of one spawned process: join the group, run ``fn``, write its result or traceback."""
    torch.set_num_threads(1)  # the CI machine has 2 cores shared by every rank
    # a rank killed by a signal (an abort inside torch or gloo, a segfault) leaves no Python traceback; the
    # interpreter's fault handler writes each thread's stack here so the failure report can show where it died
    fault_log = open(_fault_path(workdir, rank), "w")  # open until the process ends: the handler writes on death
    faulthandler.enable(file=fault_log, all_threads=True)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        value = fn(*args)
        _write_atomically(_result_path(workdir, rank), lambda path: torch.save(value, path))
    except BaseException:
        report = json.dumps({"unix_time_s": time.time(), "traceback": traceback.format_exc()})
        _write_atomically(_error_path(workdir, rank), lambda path: Path(path).write_text(report))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_ranks(procs: list, *, workdir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(proc.is_alive() for proc in procs):
        if _failed_ranks(procs, workdir):
            break
        if time.monotonic() > deadline:
            running = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
            raise WorkerTimeoutError(
                f"ranks {running} of {len(procs)} still running after {timeout_s:.0f} s and were killed; "
                "a rank is probably blocked in a collective the others never reached, or raise timeout_s"
                f"{_deaths_after_results(procs, workdir)}"
            )
        time.sleep(POLL_INTERVAL_S)
    for proc in procs:
        proc.join(timeout=POLL_INTERVAL_S)
    failed = _failed_ranks(procs, workdir)
    if failed:  # the caller kills the ranks still running
        raise _describe_failure(failed, procs, workdir)
    _warn_of_deaths_after_results(procs, workdir)


def _failed_ranks(procs: list, workdir: Path) -> list[int]:
    """Ranks that wrote a traceback, or exited with a non-zero code before writing their result."""
    return [
        rank
        for rank, proc in enumerate(procs)
        if _error_path(workdir, rank).exists()
        or (proc.exitcode not in (None, 0) and not _result_path(workdir, rank).exists())
    ]


def _warn_of_deaths_after_results(procs: list, workdir: Path) -> None:
    """A rank that wrote its whole result and then died while exiting (torch's or gloo's teardown aborting:
    "terminate called without an active exception") did its work: keep the result, say what happened."""
    for rank in _dead_after_results(procs, workdir):
        warnings.warn(f"{_death_after_result(procs, rank)}{_stacks_at_fault(workdir, rank)}", RuntimeWarning,
                      stacklevel=5)  # spawn's caller


def _describe_failure(failed: list[int], procs: list, workdir: Path) -> WorkerError:
    """Blame the rank that failed first: later ones are usually peers losing their connection.

    A rank that raised is timed by its traceback, a rank killed by a signal by the stacks its fault handler wrote
    as it died. A death with no such time (``kill -9``, the OOM killer, ``os._exit``) is blamed before everything
    else. ``RankCrashedError`` when the first failure is a signal, else ``WorkerError``.
    """
    reports = []
    for rank in failed:
        path = _error_path(workdir, rank)
        if path.exists():
            report = json.loads(path.read_text())
            reports.append((report["unix_time_s"], rank, "its traceback", report["traceback"]))
        else:
            code = procs[rank].exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            text = f"process {how}, no Python traceback{_stacks_at_fault(workdir, rank)}\n"
            reports.append((_death_time(workdir, rank), rank, "how it died", text))
    reports.sort()
    _, first_rank, what, first_text = reports[0]
    others = [report[1] for report in reports[1:]]
    also = f" (ranks {others} failed after it)" if others else ""
    signalled = what == "how it died" and (procs[first_rank].exitcode or 0) < 0
    error = RankCrashedError if signalled else WorkerError
    return error(f"rank {first_rank} of {len(procs)} failed{also}{_deaths_after_results(procs, workdir)}; "
                 f"{what}:\n{first_text}")


def _death_time(workdir: Path, rank: int) -> float:
    """When a rank killed by a signal died: when its fault handler wrote its stacks (-inf: it could not)."""
    path = _fault_path(workdir, rank)
    return path.stat().st_mtime if path.exists() and path.stat().st_size else float("-inf")


def _dead_after_results(procs: list, workdir: Path) -> list[int]:
    """Ranks that wrote their result and then exited with a non-zero code."""
    return [rank for rank, proc in enumerate(procs)
            if proc.exitcode not in (None, 0) and _result_path(workdir, rank).exists()]


def _death_after_result(procs: list, rank: int) -> str:
    return f"rank {rank} of {len(procs)} returned its result, then exited with code {procs[rank].exitcode}"


def _deaths_after_results(procs: list, workdir: Path) -> str:
    """``; rank 1 of 2 returned its result, then exited with code -6`` for each rank that did, else empty."""
    return "".join(f"; {_death_after_result(procs, rank)}" for rank in _dead_after_results(procs, workdir))


def _result_path(workdir: str | Path, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.result.pt"


def _error_path(workdir: str | Path, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.error.json"


def _fault_path(workdir: str | Path, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.fault.txt"


def _stacks_at_fault(workdir: Path, rank: int) -> str:
    """The thread stacks the rank's fault handler wrote as it died, and whether that was before or after it wrote its
    result."""
    path = _fault_path(workdir, rank)
    stacks = path.read_text().strip() if path.exists() else ""
    stage = ("after returning its result (while exiting)" if _result_path(workdir, rank).exists()
             else "before writing its result")
    return f"; it died {stage}" + (f"; its threads' stacks:\n{stacks}" if stacks else "")


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a side file, then rename, so the parent never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


def _collect_results(workdir: Path, nprocs: int) -> list:
    results = []
    for rank in range(nprocs):
        path = _result_path(workdir, rank)
        if not path.exists():
            raise WorkerError(f"rank {rank} exited cleanly but left no result; this is a bug in tessera.runtime.launch")
        results.append(torch.load(path, weights_only=False))
    return results


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ------------------------------------------------------------------------------------------ cluster launch lines


def launch_commands(
    plan: Plan,
    script: str,
    *,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    scheduler: Literal["torchrun", "slurm"] = "torchrun",
    script_args: Sequence[str] = (),
    master_port: int = DEFAULT_MASTER_PORT,
) -> list[str]:
    """Shell lines that run ``script`` (with ``script_args``) on ``plan.strategy.world_size`` ranks.

    ``nodes`` and ``procs_per_node`` default to the plan's cluster (``dgx-h100:nodes=2``: 2 nodes of 8);
    their product must be the plan's world size. ``torchrun``: one line per node (``--node-rank``), the
    first node's address taken from ``$MASTER_ADDR``; a single node uses ``--standalone``. ``slurm``: a
    batch script (``#SBATCH`` header, the first host as rendezvous endpoint, one ``srun`` of ``torchrun``
    per node). Raises ``ConfigError`` when the shape does not match the plan.
    """
    if (refused := plan.not_on_the_runtime()) is not None:
        raise NotModelledError(f"the plan's strategy has {refused}")
    cluster = _plan_cluster(plan, needed=nodes is None and procs_per_node is None)
    nodes, per_node = _launch_shape(plan, cluster, nodes=nodes, procs_per_node=procs_per_node)
    command = shlex.join([script, *script_args])
    if scheduler == "slurm":
        gpus = cluster is None or cluster.device.name != LOCAL_CPU
        return _slurm_lines(nodes, per_node, command, master_port=master_port, gpus=gpus)
    if nodes == 1:
        return [f"torchrun --standalone --nnodes=1 --nproc-per-node={per_node} {command}"]
    return [
        f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --node-rank={rank} "
        f"--master-addr=$MASTER_ADDR --master-port={master_port} {command}"
        for rank in range(nodes)
    ]


def _plan_cluster(plan: Plan, *, needed: bool) -> Cluster | None:
    """The plan's cluster, checked against the plan's world size; None where it cannot be read and the caller gave
    the launch's shape itself (``needed`` False)."""
    try:
        cluster = load_cluster(plan.cluster)
    except (ClusterSpecError, OSError, ValueError) as error:
        if needed:
            raise ConfigError(f"cannot read cluster {plan.cluster!r} of the plan ({error}); pass nodes=") from None
        return None
    if cluster.num_devices != plan.strategy.world_size:
        raise ConfigError(f"the plan's strategy ({plan.strategy.to_string()}) uses {plan.strategy.world_size} ranks but "
                          f"its cluster {plan.cluster} has {cluster.num_devices} devices; plan again for that cluster")
    return cluster


def _launch_shape(plan: Plan, cluster: Cluster | None, *, nodes: int | None,
                  procs_per_node: int | None) -> tuple[int, int]:
    world = plan.strategy.world_size
    if nodes is None and procs_per_node is None:
        nodes = cluster.num_hosts
    if procs_per_node is None:
        procs_per_node = world // (nodes or 1)
    nodes = nodes or world // procs_per_node
    if nodes * procs_per_node != world:
        raise ConfigError(
            f"{nodes} node(s) x {procs_per_node} process(es) per node = {nodes * procs_per_node} ranks, but the plan "
            f"({plan.strategy.to_string()}) needs {world}; pick nodes and processes per node whose product is {world}"
        )
    if cluster is not None and procs_per_node > cluster.host_size:
        raise ConfigError(f"{procs_per_node} processes per node, but the hosts of cluster {plan.cluster} have "
                          f"{cluster.host_size} devices; launch on {world // cluster.host_size or 1} nodes "
                          "or fewer processes per node")
    return nodes, procs_per_node


def _slurm_lines(nodes: int, per_node: int, command: str, *, master_port: int, gpus: bool) -> list[str]:
    """A batch script; ``gpus`` False (CPU ranks) asks for no GPUs."""
    return [
        "#!/bin/bash",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpus else []),
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-id=$SLURM_JOB_ID "
        f"--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:{master_port} {command}",
    ]
