"""Accelerator catalog: peak FLOP/s, memory and bandwidth, each with its source.

Sources are transcribed in ``../shared/reference/published_runs.yaml`` (hardware section) and restated
here so the project stands alone. The full catalog (V100, MI300X, TPUs, Gaudi...) arrives with the
topology issue; this holds what the presets need.
"""

from __future__ import annotations

import os

from tessera.errors import ClusterSpecError
from tessera.topology.cluster import DeviceSpec

GB = 10**9
GiB = 2**30
TFLOPS = 10**12

_CATALOG: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="A100-SXM-80GB",
            peak_flops_by_dtype={"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS},
            memory_bytes=80 * GiB,
            memory_bandwidth_bytes_per_s=2.039e12,
            source="NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 19.5 FP32, 80 GB HBM2e at 2,039 GB/s",
        ),
        DeviceSpec(
            name="H100-SXM-80GB",
            peak_flops_by_dtype={"fp32": 67 * TFLOPS, "bf16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
            memory_bytes=80 * GiB,
            memory_bandwidth_bytes_per_s=3.35e12,
            source="NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 1,979 dense FP8, "
            "67 FP32, 80 GB HBM3 at 3.35 TB/s",
        ),
        DeviceSpec(
            name="H200-SXM-141GB",
            peak_flops_by_dtype={"fp32": 67 * TFLOPS, "bf16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
            memory_bytes=141 * GB,
            memory_bandwidth_bytes_per_s=4.8e12,
            source="NVIDIA H200 product page: H100 compute, 141 GB HBM3e at 4.8 TB/s",
        ),
    )
}


def local_cpu_device(ranks: int) -> DeviceSpec:
    """This machine's CPU shared by ``ranks`` processes.

    Peak FLOP/s is a nominal figure until ``tessera profile`` measures it (topology issue); memory is
    the machine's physical memory divided among ranks.
    """
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    # ~25 GFLOP/s fp32 per core: order of magnitude of an AVX2 core's sustained sgemm, not measured here.
    per_rank_flops = 25e9 * max(1, cores // ranks)
    return DeviceSpec(
        name="local-cpu",
        peak_flops_by_dtype={"fp32": per_rank_flops, "bf16": per_rank_flops},
        memory_bytes=total_memory // ranks,
        memory_bandwidth_bytes_per_s=10e9,
        source=f"nominal: {cores} cores, {total_memory / GiB:.1f} GiB shared by {ranks} ranks (not profiled)",
    )


def device(name: str) -> DeviceSpec:
    """Catalog lookup; an unknown name lists the known ones."""
    try:
        return _CATALOG[name]
    except KeyError:
        raise ClusterSpecError(f"unknown device {name!r}; known devices: {', '.join(sorted(_CATALOG))}") from None


def catalog() -> dict[str, DeviceSpec]:
    """All catalogued devices by name."""
    return dict(_CATALOG)
