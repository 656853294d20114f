"""Accelerator catalog: peak FLOP/s per dtype, memory, memory and scale-up bandwidth, each with its source.

The data lives in ``topology/catalog.yaml`` (units and sources are described at its top); this module
parses it into ``DeviceSpec`` objects. The same parser reads a device written inline in a cluster file
(``device: {name: ..., peak_tflops: {...}, ...}``), which is how ``tessera profile`` records the CPU it
measured. ``local_cpu_device`` gives this machine's CPU with nominal figures until it is profiled.

Catalog entries may also carry the published forward + backward rate of fused attention kernels on that device
(``attention_tflops``, see the file's header); ``attention_curve`` returns it. It is a fact about a catalogued
part, so it is read from the catalog only, not from a device written inline in a cluster file.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Any

import yaml
from pydantic import ValidationError

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import FP8_SCALINGS, DeviceSpec
from tessera.topology.validation import file_number, file_value, first_problem, quoted, short

GB = 10**9
GiB = 2**30
TFLOPS = 10**12
LOCAL_CPU = "local-cpu"
"""Name of this machine's CPU as a device; the cost model treats it as a CPU (no GPU efficiency factor)."""

DEVICE_FIELDS = (
    "name", "peak_tflops", "memory_gib", "memory_gb", "memory_bandwidth_tb_per_s",
    "memory_bandwidth_gb_per_s", "scale_up_gb_per_s", "host_gb_per_s", "solo_speedup", "linear_overhead_ms", "fsdp_comm_slowdown",
    "tp_compute_slowdown", "snapshot_fixed_ms", "snapshot_gb_per_s", "snapshot_swap_gb_per_s", "fp8_scalings", "source",
)

DEVICE_RENAMES = {"peak_flops_by_dtype": "peak_tflops", "memory_bandwidth_bytes_per_s": "memory_bandwidth (bytes/s)",
                  "scale_up_bandwidth_bytes_per_s": "scale_up_gb_per_s (bytes/s)",
                  "host_bandwidth_bytes_per_s": "host_gb_per_s (bytes/s)", "linear_overhead_s": "linear_overhead_ms",
                  "snapshot_fixed_s": "snapshot_fixed_ms (s)", "snapshot_bytes_per_s": "snapshot_gb_per_s (bytes/s)",
                  "snapshot_swap_bytes_per_s": "snapshot_swap_gb_per_s (bytes/s)"}
"""``DeviceSpec`` field names -> the file's names, for error messages (a value too large to be finite once
converted to SI units is reported here)."""

ATTENTION_KERNELS = ("fa2", "fa-triton", "cudnn", "fa3")
"""Fused attention kernels a catalog entry may give figures for (``catalog.yaml`` header)."""
CATALOG_ONLY_FIELDS = ("attention_tflops", "attention_scale", "attention_source", "matmul_scale", "matmul_source")
"""Catalog entry fields that are not ``DeviceSpec`` fields: the attention kernels' published rates and the part's
measured GEMM efficiency relative to the H100's."""

AttentionCurve = tuple[tuple[int, float], ...]
"""``((sequence length, forward + backward FLOP/s), ...)`` in increasing sequence length."""


def device_from_raw(raw: Any, *, where: str) -> DeviceSpec:
    """A ``DeviceSpec`` from a catalog entry or an inline cluster-file device; errors name the field."""
    _check_device_raw(raw, where=where)
    try:
        return DeviceSpec(**_device_fields(raw, where=where))
    except ValidationError as exc:
        raise ClusterSpecError(f"{where}: {first_problem(exc, renames=DEVICE_RENAMES)}; fix the value") from None


def _check_device_raw(raw: Any, *, where: str) -> None:
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"{where}: a device must be a mapping with fields {', '.join(DEVICE_FIELDS)}")
    unknown = sorted(short(key) for key in raw if key not in DEVICE_FIELDS)
    if unknown:
        raise ClusterSpecError(f"{where}: unknown field(s) {', '.join(unknown[:3])}; known: {', '.join(DEVICE_FIELDS)}")
    for field in ("name", "peak_tflops", "source"):
        if field not in raw:
            raise ClusterSpecError(f"{where}: missing field '{field}'")
    peaks = raw["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        raise ClusterSpecError(f"{where}: field 'peak_tflops' must map dtypes to TFLOP/s, e.g. {{bf16: 989}}")


def _device_fields(raw: dict[str, Any], *, where: str) -> dict[str, Any]:
    """``DeviceSpec``'s fields from a checked raw device, each number checked and in SI units."""
    return dict(
        name=str(raw["name"]),
        peak_flops_by_dtype={
            str(dtype): file_number(value, f"{where}: field 'peak_tflops.{dtype}'", positive=True) * TFLOPS
            for dtype, value in raw["peak_tflops"].items()
        },
        memory_bytes=max(1, int(_one_of(raw, {"memory_gib": GiB, "memory_gb": GB}, where=where))),
        memory_bandwidth_bytes_per_s=_one_of(
            raw, {"memory_bandwidth_tb_per_s": 1e12, "memory_bandwidth_gb_per_s": 1e9}, where=where
        ),
        scale_up_bandwidth_bytes_per_s=_optional_gb_per_s(raw, "scale_up_gb_per_s", where=where),
        host_bandwidth_bytes_per_s=_optional_gb_per_s(raw, "host_gb_per_s", where=where),
        solo_speedup=file_number(raw.get("solo_speedup", 1.0), f"{where}: field 'solo_speedup'", positive=True),
        linear_overhead_s=_overheads_s(raw.get("linear_overhead_ms") or {}, where=f"{where}: field 'linear_overhead_ms'"),
        fsdp_comm_slowdown=(
            None if raw.get("fsdp_comm_slowdown") is None
            else file_number(raw["fsdp_comm_slowdown"], f"{where}: field 'fsdp_comm_slowdown'", positive=True)
        ),
        tp_compute_slowdown=_by_degree(
            raw.get("tp_compute_slowdown") or {}, where=f"{where}: field 'tp_compute_slowdown'", unit="factor"
        ),
        snapshot_fixed_s=(
            None if raw.get("snapshot_fixed_ms") is None
            else file_number(raw["snapshot_fixed_ms"], f"{where}: field 'snapshot_fixed_ms'") / 1e3
        ),
        snapshot_bytes_per_s=_optional_gb_per_s(raw, "snapshot_gb_per_s", where=where),
        snapshot_swap_bytes_per_s=_optional_gb_per_s(raw, "snapshot_swap_gb_per_s", where=where),
        fp8_scalings=_fp8_scalings(raw.get("fp8_scalings"), where=f"{where}: field 'fp8_scalings'"),
        source=str(raw["source"]),
    )


def _fp8_scalings(raw: Any, *, where: str) -> tuple[str, ...] | None:
    """The FP8 scaling recipes a part runs, each one Tessera prices (``None`` when the field is absent)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        raise ClusterSpecError(f"{where} must be a list of scalings, e.g. [delayed, current]")
    unknown = [item for item in raw if item not in FP8_SCALINGS]
    if unknown:
        raise ClusterSpecError(f"{where}: {quoted(unknown[0])} is not a scaling; known: {', '.join(FP8_SCALINGS)}")
    return tuple(raw)


def _optional_gb_per_s(raw: dict[str, Any], field: str, *, where: str) -> float | None:
    """An optional ``*_gb_per_s`` field in bytes/s (``None`` when absent)."""
    return None if raw.get(field) is None else file_number(raw[field], f"{where}: field '{field}'", positive=True) * 1e9


def _overheads_s(raw: Any, *, where: str) -> dict[int, float]:
    """``{tensor-parallel degree: milliseconds}`` -> ``{degree: seconds}``."""
    return {degree: ms / 1e3 for degree, ms in _by_degree(raw, where=where, unit="milliseconds").items()}


def _by_degree(raw: Any, *, where: str, unit: str) -> dict[int, float]:
    """``{tensor-parallel degree: positive number}``, checked."""
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"{where} must map tensor-parallel degrees to {unit}, e.g. {{1: 0.3, 2: 4.0}}")
    values = {}
    for degree, value in raw.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ClusterSpecError(f"{where}: degree {quoted(degree)} must be a positive integer")
        values[degree] = file_number(value, f"{where}.{degree}", positive=True)
    return values


def device_to_raw(spec: DeviceSpec) -> dict[str, Any]:
    """The inline cluster-file form of ``spec`` (inverse of ``device_from_raw``)."""
    raw: dict[str, Any] = {
        "name": spec.name,
        "peak_tflops": {dtype: file_value(flops / TFLOPS, positive=True) for dtype, flops in spec.peak_flops_by_dtype.items()},
        "memory_gb": spec.memory_bytes / GB,
        "memory_bandwidth_gb_per_s": file_value(spec.memory_bandwidth_bytes_per_s / 1e9, positive=True),
    }
    if spec.scale_up_bandwidth_bytes_per_s is not None:
        raw["scale_up_gb_per_s"] = file_value(spec.scale_up_bandwidth_bytes_per_s / 1e9, positive=True)
    if spec.host_bandwidth_bytes_per_s is not None:
        raw["host_gb_per_s"] = file_value(spec.host_bandwidth_bytes_per_s / 1e9, positive=True)
    if spec.solo_speedup != 1.0:
        raw["solo_speedup"] = file_value(spec.solo_speedup, positive=True)
    if spec.linear_overhead_s:
        raw["linear_overhead_ms"] = {degree: file_value(s * 1e3, positive=True) for degree, s in spec.linear_overhead_s.items()}
    if spec.fsdp_comm_slowdown is not None:
        raw["fsdp_comm_slowdown"] = file_value(spec.fsdp_comm_slowdown, positive=True)
    if spec.tp_compute_slowdown:
        raw["tp_compute_slowdown"] = {degree: file_value(x, positive=True) for degree, x in spec.tp_compute_slowdown.items()}
    if spec.snapshot_fixed_s is not None:
        raw["snapshot_fixed_ms"] = file_value(spec.snapshot_fixed_s * 1e3)
    if spec.snapshot_bytes_per_s is not None:
        raw["snapshot_gb_per_s"] = file_value(spec.snapshot_bytes_per_s / 1e9, positive=True)
    if spec.snapshot_swap_bytes_per_s is not None:
        raw["snapshot_swap_gb_per_s"] = file_value(spec.snapshot_swap_bytes_per_s / 1e9, positive=True)
    if spec.fp8_scalings is not None:
        raw["fp8_scalings"] = list(spec.fp8_scalings)
    raw["source"] = spec.source
    return raw


def _one_of(raw: dict[str, Any], units: dict[str, float], *, where: str) -> float:
    given = [key for key in units if key in raw]
    if len(given) != 1:
        raise ClusterSpecError(f"{where}: give exactly one of the fields {', '.join(units)} (got {given or 'none'})")
    key = given[0]
    return file_number(raw[key], f"{where}: field '{key}'", positive=True) * units[key]


@functools.cache
def _entries() -> tuple[dict[str, Any], ...]:
    return tuple(yaml.safe_load((resources.files("tessera.topology") / "catalog.yaml").read_text()))


@functools.cache
def _catalog() -> dict[str, DeviceSpec]:
    specs = [
        device_from_raw({k: v for k, v in entry.items() if k not in CATALOG_ONLY_FIELDS}, where=f"catalog.yaml entry {i}")
        for i, entry in enumerate(_entries())
    ]
    return {spec.name: spec for spec in specs}


@functools.cache
def _attention_catalog() -> dict[str, dict[str, AttentionCurve]]:
    """``{device name: {kernel: curve}}`` for the catalog entries that give attention figures."""
    curves = {}
    for i, entry in enumerate(_entries()):
        where = f"catalog.yaml entry {i}"
        scale = _attention_scale(entry, where=where)
        if entry.get("attention_tflops"):
            curves[str(entry["name"])] = _scaled(attention_curves_from_raw(entry["attention_tflops"], where=where), scale)
    return curves


def _attention_scale(entry: dict, *, where: str) -> float:
    """The entry's ``attention_scale``: a factor in (0, 2] on its own ``attention_tflops``, 1 when absent."""
    if "attention_scale" not in entry:
        return 1.0
    field = f"{where}: field 'attention_scale'"
    if not entry.get("attention_tflops"):
        raise ClusterSpecError(f"{field} scales attention_tflops, which the entry does not give; add them or drop it")
    scale = file_number(entry["attention_scale"], field, positive=True)
    if scale > 2:
        raise ClusterSpecError(f"{field} is {scale:g}; a factor on a sibling part's figures is at most 2")
    return scale


def _scaled(curves: dict[str, AttentionCurve], scale: float) -> dict[str, AttentionCurve]:
    """``curves`` with every rate times ``scale`` (``attention_scale``: a part priced from a sibling's figures)."""
    return {kernel: tuple((seq, rate * scale) for seq, rate in curve) for kernel, curve in curves.items()}


def attention_curves_from_raw(raw: Any, *, where: str) -> dict[str, AttentionCurve]:
    """``{kernel: {sequence length: TFLOP/s}}`` -> ``{kernel: curve in FLOP/s}``; errors name the field."""
    field = f"{where}: field 'attention_tflops'"
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"{field} must map kernels to {{sequence length: TFLOP/s}}, e.g. {{fa2: {{2048: 155}}}}")
    curves = {}
    for kernel, points in raw.items():
        if kernel not in ATTENTION_KERNELS:
            raise ClusterSpecError(f"{field}: unknown kernel {quoted(kernel)}; known: {', '.join(ATTENTION_KERNELS)}")
        if not isinstance(points, dict) or not points:
            raise ClusterSpecError(f"{field}.{kernel} must map sequence lengths to TFLOP/s, e.g. {{2048: 155}}")
        for seq in points:
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
                raise ClusterSpecError(f"{field}.{kernel}: sequence length {quoted(seq)} must be a positive integer")
        curves[kernel] = tuple(
            (seq, file_number(points[seq], f"{field}.{kernel}.{seq}", positive=True) * TFLOPS) for seq in sorted(points)
        )
    return curves


@functools.cache
def _matmul_scales() -> dict[str, float]:
    """``{device name: matmul_scale}`` for the catalog entries that give one."""
    scales = {}
    for i, entry in enumerate(_entries()):
        if "matmul_scale" in entry:
            field = f"catalog.yaml entry {i}: field 'matmul_scale'"
            scale = file_number(entry["matmul_scale"], field, positive=True)
            if scale > 2 or not entry.get("matmul_source"):
                raise ClusterSpecError(f"{field} must be at most 2 and name its benchmark in 'matmul_source'")
            scales[str(entry["name"])] = scale
    return scales


def matmul_scale(device_name: str) -> float:
    """The catalogued part's share of its peak in large GEMMs over the H100 SXM's (``catalog.yaml``: measured, or a
    sibling part's where its source says so), 1 for a part without one (the H100 itself, or a device the catalog does
    not hold)."""
    return _matmul_scales().get(device_name, 1.0)


def attention_curve(device_name: str, kernel: str) -> AttentionCurve | None:
    """The published forward + backward rate of ``kernel`` on the catalogued device ``device_name`` by sequence
    length (causal, head dim 128, counted as the kernel benchmarks count it), or ``None`` where the catalog has
    none (an uncatalogued device, or a kernel not measured on it)."""
    return _attention_catalog().get(device_name, {}).get(kernel)


def local_cpu_device(ranks: int) -> DeviceSpec:
    """This machine's CPU shared by ``ranks`` processes, with nominal figures.

    Peak FLOP/s and memory bandwidth are nominal until ``tessera profile`` measures them (a profiled cluster
    file carries the measured device inline); memory is the machine's physical memory divided among ranks.
    """
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    # ~25 GFLOP/s fp32 per core: order of magnitude of an AVX2 core's sustained sgemm, not measured here.
    per_rank_flops = 25e9 * max(1, cores // ranks)
    # FP8: torch's CPU _scaled_mm is a reference loop: 0.06 GFLOP/s per rank on 2 ranks here
    # (benchmarks/results/cluster-x86_64-cpu-2026-12-04.yaml, tessera profile --nproc 2).
    per_rank_fp8_flops = 0.06e9 * max(1, cores // ranks)
    return DeviceSpec(
        name=LOCAL_CPU,
        peak_flops_by_dtype={"fp32": per_rank_flops, "bf16": per_rank_flops, "fp8": per_rank_fp8_flops},
        memory_bytes=total_memory // ranks,
        memory_bandwidth_bytes_per_s=10e9,
        source=f"nominal: {cores} cores, {total_memory / GiB:.1f} GiB shared by {ranks} ranks (not profiled)",
    )


def device(name: str) -> DeviceSpec:
    """Catalog lookup; an unknown name lists the known ones."""
    try:
        return _catalog()[name]
    except KeyError:
        known = ", ".join([*sorted(_catalog()), LOCAL_CPU])
        raise ClusterSpecError(f"unknown device {quoted(name)}; known devices: {known}") from None


def catalog() -> dict[str, DeviceSpec]:
    """All catalogued devices by name (``local-cpu`` is built per machine by ``local_cpu_device``)."""
    return dict(_catalog())
