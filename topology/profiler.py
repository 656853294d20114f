"""Measure the live torch.distributed world and write a cluster file the cost model can use.

``profile_world()`` runs inside an existing job (every rank calls it; gloo on CPU, NCCL on GPU):

1. **Layout.** Ranks are grouped into nodes by host name (ranks of a node must be consecutive, as torchrun
   numbers them). One host gives one level (``<backend>-intra-node``); several give two (intra-node,
   inter-node). The group layouts measured are mesh axes: ``group_size`` ranks ``stride`` apart, every
   such group of the world running at once (``group_layouts``).
2. **Device.** Each rank, all at once, times fp32 and bf16 matmuls and a large copy; the slowest rank's
   figures are the device's FLOP/s and memory bandwidth (ranks share a CPU, so this is what each gets). On CPU
   ranks also: how much faster rank 0 computes alone (what a rank gains while others wait), the host
   overhead per linear of a tiny transformer block, plain and split over each tensor-parallel degree, and how
   much longer FSDP2's gathers and reduce-scatters take than the bare collectives.
3. **Collectives.** All-reduce, all-gather, reduce-scatter, all-to-all and broadcast on every layout, and
   point-to-point on pairs, over ``ProfileSweep.sizes_bytes`` (how each point is timed:
   ``tessera.topology.measure``).
4. **Fit.** ``tessera.topology.fitting`` fits latency and bandwidth per level and collective (weighted
   non-negative least squares on ``alpha * steps + bytes * volume / B + bytes * gamma``, per group
   size and per group layout) and builds the Cluster.
5. **Record.** Rank 0 writes the cluster file (``tessera.topology.clusterfile`` format) with a ``profile``
   section: date, host, hardware, software, the sweep, the device measurements, every raw trial and every
   fit. ``load_cluster(path)`` reads it; ``load_profile(path)`` reads the measurements back too.

``profile_local(nproc)`` spawns ``nproc`` local ranks itself (what ``tessera profile --nproc N`` runs);
like the runtime's launcher it gives each CPU rank one intra-op thread.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from pydantic import BaseModel, ValidationError

from tessera.topology.cluster import FROZEN, Cluster, DeviceSpec, LinkLevel
from tessera.errors import ClusterSpecError
from tessera.files import MARK, write_text_atomically
from tessera.topology.clusterfile import cluster_from_raw, cluster_to_raw
from tessera.topology.fitting import CollectiveFit, Measurement, fit_cluster
from tessera.topology.hardware import LOCAL_CPU, catalog
from tessera.topology.measure import MiB, ProfileError, ProfileSweep, faster_half_mean, measure_collectives
from tessera.topology.measure_device import DeviceMeasurement, at_measured_floor, measure_device
from tessera.topology.presets import load_cluster
from tessera.topology.validation import first_problem, load_yaml_text, read_bounded_text, short, significant

__all__ = [
    "DeviceMeasurement", "ProfileError", "ProfileResult", "ProfileSweep", "faster_half_mean", "group_layouts",
    "hardware_tag", "load_profile", "profile_local", "profile_world", "write_profile",
]


class ProfileResult(BaseModel):
    """Everything one profile produced: the fitted cluster, what was measured, and how it was fitted."""

    model_config = FROZEN

    cluster: Cluster
    """The fitted cluster (what the cost model uses)."""
    measurements: tuple[Measurement, ...]
    """Every collective point measured."""
    device: DeviceMeasurement
    """Device compute and memory measurements."""
    fits: tuple[CollectiveFit, ...]
    """Per level and collective fit behind ``cluster``."""
    host: dict[str, Any]
    """Date, host name, hardware and software the profile ran on."""
    sweep: ProfileSweep
    """The sweep that was run."""
    elapsed_s: float
    """Wall-clock seconds profile_world took."""


def profile_world(*, sweep: ProfileSweep | None = None, out: str | Path | None = None, progress: bool = True) -> ProfileResult:
    """Profile the default process group; every rank must call this. Rank 0 writes ``out`` if given.

    Returns the same ``ProfileResult`` on every rank (timings are reduced across ranks before fitting).
    """
    if not dist.is_initialized():
        raise ProfileError("profile_world needs an initialised torch.distributed process group; use profile_local")
    sweep = sweep or ProfileSweep()
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ProfileError("profiling needs a world of at least 2 ranks; there is nothing to measure between ranks")
    device = _rank_device()
    per_node = _ranks_per_node()
    skeleton = _skeleton(world, per_node=per_node, backend=dist.get_backend())
    layouts = group_layouts(world, per_node=per_node)
    with _progress_bar(enabled=progress and rank == 0) as bar:
        tp_degrees = sorted({g for g, stride in layouts if stride == 1 and g <= per_node})  # tp stays in a node
        measured_device = measure_device(device, sweep=sweep, bar=bar, tp_degrees=tp_degrees)
        measurements = measure_collectives(layouts, device, sweep=sweep, bar=bar)
    host = _host_info(world=world, per_node=per_node, device=device) | {"load_average_1m_before": round(load_before, 2)}
    spec = _device_spec(measured_device, device=device, per_node=per_node, host=host)
    source = f"fitted by tessera profile on {host['hostname']} ({host['date']}), {len(measurements)} points"
    cluster, fits = fit_cluster(skeleton, measurements, device=spec, name=str(out or "profiled"), source=source)
    result = ProfileResult(
        cluster=cluster, measurements=tuple(measurements), device=measured_device, fits=fits, host=host,
        sweep=sweep, elapsed_s=time.perf_counter() - started,
    )
    if out is not None and rank == 0:
        write_profile(result, out)
    dist.barrier()
    return result


def profile_local(
    nproc: int, *, sweep: ProfileSweep | None = None, out: str | Path | None = None, progress: bool = True,
    timeout_s: float = 600,
) -> ProfileResult:
    """Spawn ``nproc`` ranks on this machine, profile them, and return the result (also written to ``out``).

    NCCL on ``nproc`` GPUs when this machine has that many, else gloo on the CPU.
    """
    if nproc < 2:
        raise ProfileError(f"profiling needs at least 2 ranks, got --nproc {nproc}")
    sweep = sweep or ProfileSweep()
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    with tempfile.TemporaryDirectory(prefix="tessera-profile-") as workdir:
        path = Path(out) if out is not None else Path(workdir) / "cluster.yaml"
        args = (nproc, backend, f"{workdir}/store", sweep.model_dump_json(), str(path), progress, timeout_s)
        _spawn_and_wait(args, nproc=nproc, timeout_s=timeout_s)
        return load_profile(path)


def group_layouts(world: int, *, per_node: int) -> list[tuple[int, int]]:
    """``(group_size, stride)`` layouts to measure; each tiles the world into concurrent groups.

    One node: every power-of-two group size (and the world), packed (stride 1) and spread (widest stride).
    Several nodes: groups inside a node (stride 1), across nodes one rank per node (stride = ranks per
    node), and the whole world (crossing both levels: validation only).
    """
    if per_node >= world:
        sizes = sorted({2**k for k in range(1, int(math.log2(world)) + 1)} | {world})
        layouts = [(g, s) for g in sizes for s in sorted({1, world // g})]
    else:
        nodes = world // per_node
        inner = sorted({2, per_node}) if per_node >= 2 else []
        outer = sorted({2, nodes}) if nodes >= 2 else []
        layouts = [(g, 1) for g in inner] + [(g, per_node) for g in outer] + [(world, 1)]
    return [(g, s) for g, s in dict.fromkeys(layouts) if world % (g * s) == 0]


def write_profile(result: ProfileResult, path: str | Path) -> None:
    """Write ``result`` as a cluster file with its ``profile`` section, atomically, and only once the file's
    content reads back as a cluster (``ProfileError`` naming the field otherwise: never a file that cannot load)."""
    profile = {
        "host": result.host,
        "elapsed_s": round(result.elapsed_s, 3),
        "sweep": result.sweep.model_dump(mode="json"),
        "device": result.device.model_dump(mode="json"),
        "fits": [fit.model_dump(mode="json") for fit in result.fits],
        "measurements": [m.model_dump(mode="json") for m in result.measurements],
    }
    raw = cluster_to_raw(
        result.cluster, profile=_rounded(profile),
        description=f"measured by 'tessera profile' on {result.host['hostname']} at {result.host['date']}",
    )
    header = (
        f"# {MARK}: a cluster file of tessera profile (format: tessera/topology/clusterfile.py).\n"
        "# load with tessera.load_cluster(path); the 'profile' section holds the raw measurements.\n"
    )
    try:
        cluster_from_raw(raw, name=str(path), size=raw["size"])
    except ClusterSpecError as exc:
        raise ProfileError(f"the profile measured values a cluster file cannot hold ({exc}); nothing was written to "
                           f"{path}; re-run tessera profile on a quieter machine") from None
    text = header + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None, width=120)
    write_text_atomically(path, text, what="cluster file")


def _rounded(value: Any) -> Any:
    """``value`` with every float cut to 6 significant digits (timings are not finer than that)."""
    if isinstance(value, float):
        return significant(value)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(item) for item in value]
    return value


def load_profile(path: str | Path) -> ProfileResult:
    """Read a cluster file written by ``tessera profile`` back into a ``ProfileResult``."""
    cluster = load_cluster(str(path))  # first: it refuses hostile YAML (aliases, size) before the raw read
    raw = load_yaml_text(read_bounded_text(Path(path)))
    profile = raw.get("profile") if isinstance(raw, dict) else None
    if not isinstance(profile, dict):
        raise ProfileError(f"{path} has no 'profile' section; it was not written by tessera profile")
    try:
        return ProfileResult(
            cluster=cluster,
            measurements=tuple(Measurement(**m) for m in profile["measurements"]),
            device=DeviceMeasurement(**profile["device"]),
            fits=tuple(CollectiveFit(**f) for f in profile["fits"]),
            host=profile["host"],
            sweep=ProfileSweep(**profile["sweep"]),
            elapsed_s=profile["elapsed_s"],
        )
    except ValidationError as exc:
        raise ProfileError(f"{path}: 'profile' section: {first_problem(exc)}; re-run tessera profile") from None
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"{path}: 'profile' section is malformed ({short(str(exc))}); re-run tessera profile") from None


# --- the world -------------------------------------------------------------------------------------------


def _rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ranks_per_node() -> int:
    """Ranks per host; the hosts' ranks must be consecutive blocks of one size."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    blocks = [hosts[0]]
    for host in hosts[1:]:
        if host != blocks[-1]:
            blocks.append(host)
    per_node = len(hosts) // len(blocks)
    if len(set(blocks)) != len(blocks) or any(hosts.count(h) != per_node for h in blocks):
        raise ProfileError(
            f"ranks are not grouped into equal, consecutive blocks per host ({hosts}); launch with torchrun's "
            "default rank order"
        )
    return per_node


def _skeleton(world: int, *, per_node: int, backend: str) -> Cluster:
    """The level structure to fit: one level per host, then one across hosts."""
    def level(name: str, size: int) -> LinkLevel:
        return LinkLevel(name=name, group_size=size, bandwidth_bytes_per_s=1.0, latency_s=0.0, source="skeleton")

    levels = [level(f"{backend}-intra-node", per_node)] if per_node > 1 else []
    if per_node < world:
        levels.append(level(f"{backend}-inter-node", world))
    placeholder = DeviceSpec(name="placeholder", peak_flops_by_dtype={"fp32": 1.0}, memory_bytes=1,
                             memory_bandwidth_bytes_per_s=1.0, source="skeleton")
    return Cluster(name="skeleton", device=placeholder, num_devices=world, levels=tuple(levels))


def _device_spec(measured: DeviceMeasurement, *, device: torch.device, per_node: int, host: dict[str, Any]) -> DeviceSpec:
    """The catalog GPU when the name matches (datasheet peaks), else the measured device (CPU: local-cpu)."""
    if device.type == "cuda":
        known = _catalog_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
        if known is not None:
            return known
        memory = torch.cuda.get_device_properties(device).total_memory
        name = torch.cuda.get_device_name(device)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_node
        name = LOCAL_CPU
    return DeviceSpec(
        name=name,
        peak_flops_by_dtype=dict(measured.matmul_flops_by_dtype),
        memory_bytes=memory,
        memory_bandwidth_bytes_per_s=measured.memory_bandwidth_bytes_per_s,
        solo_speedup=measured.solo_speedup,
        linear_overhead_s={degree: at_measured_floor(s) for degree, s in measured.linear_overhead_s.items()},
        fsdp_comm_slowdown=measured.fsdp_comm_slowdown,
        tp_compute_slowdown=dict(measured.tp_compute_slowdown),
        snapshot_fixed_s=measured.snapshot_fixed_s, snapshot_bytes_per_s=measured.snapshot_bytes_per_s,
        snapshot_swap_bytes_per_s=measured.snapshot_swap_bytes_per_s,
        source=(
            f"measured by tessera profile on {host['hostname']} ({host['date']}): {measured.matmul_dim}^2 matmul "
            f"FLOP/s and {measured.copy_bytes // MiB} MiB copy bandwidth achieved per rank with all "
            f"{host['world_size']} ranks running, {measured.threads_per_rank} thread(s) per rank; memory = "
            f"{'host memory / ranks per host' if device.type == 'cpu' else 'device total'}"
            + ("; solo speed-up: rank 0's matmul alone; linear overhead: a reference transformer block's forward "
               "and backward at negligible size, per linear, by tensor-parallel degree; FSDP slowdown: a ZeRO-3 unit's "
               "gathers and reduce-scatter over the bare collectives; tensor-parallel compute slowdown: a 256-wide "
               "block on 256 tokens split by degree over 1/degree of it whole; snapshot: a snapshot's staging copy, file "
               "write and hash at 1 and 16 MiB per rank, and its swap with a buddy rank at 16 MiB, every rank at once" if device.type == "cpu" else "")
        ),
    )


def _catalog_gpu(gpu_name: str, memory_bytes: int) -> DeviceSpec | None:
    """The catalog entry a CUDA/ROCm device name refers to, by model and memory size."""
    lowered = gpu_name.lower()
    for model in ("h200", "h100", "h800", "b200", "a100", "v100", "mi300x", "mi250x"):
        if model in lowered:
            entries = [spec for name, spec in catalog().items() if name.lower().startswith(model)]
            return min(entries, key=lambda spec: abs(spec.memory_bytes - memory_bytes), default=None)
    return None


def _host_info(*, world: int, per_node: int, device: torch.device) -> dict[str, Any]:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "hardware": hardware_tag(device),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "backend": dist.get_backend(),
        "world_size": world,
        "ranks_per_node": per_node,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def hardware_tag(device: torch.device | None = None) -> str:
    """Short hardware name for result files: ``x86_64-cpu`` or the GPU model (``nvidia-h200``)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return f"{platform.machine()}-cpu"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _progress_bar(*, enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


# --- local spawning ------------------------------------------------------------------------------------


def _spawn_and_wait(args: tuple, *, nproc: int, timeout_s: float) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_main, args=args, nprocs=nproc, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise ProfileError(f"profiling ranks still running after {timeout_s:.0f} s; they were stopped")
    except mp.ProcessRaisedException as exc:
        raise ProfileError(f"a profiling rank failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise ProfileError(f"a profiling rank died: {exc}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


def _rank_main(
    rank: int, world: int, backend: str, store: str, sweep_json: str, out: str, progress: bool, timeout_s: float
) -> None:
    """Body of one spawned profiling rank."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # as the runtime's launcher: ranks share the CPU's cores
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        profile_world(sweep=ProfileSweep.model_validate_json(sweep_json), out=out, progress=progress)
    finally:
        dist.destroy_process_group()

