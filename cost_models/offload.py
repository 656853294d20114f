"""Activation offload: an offloaded block's saved tensors go to host memory in the forward and come back
for its backward (``Recompute`` ``"offload"``).

The copies run on the device's host link (PCIe, NVLink-C2C; ``DeviceSpec.host_bandwidth_bytes_per_s``) in both
directions. Where a runtime issues them on a copy stream of their own, each overlaps the compute: the copy-out
with the forward, the copy-in (prefetched a block ahead) with the backward, and only what a pass cannot hide is
on the critical path. Tessera's runtime (``runtime.offload``) does this on CUDA: both directions on a side stream,
the copies back of a block and of the one before it issued when the block's backward starts. That path has not
yet run on a GPU in this project (``tests/gpu/test_offload_cuda.py`` is its check), so its copies are still
priced in full; Transformer Engine's, which Megatron-Core runs, overlap (``ImplementationProfile.offload_copies_overlap``
says which). The device keeps two blocks' worth in transit
(``StageTotals.offload_buffer_bytes``); everything else lives on the host.
"""

from __future__ import annotations

from tessera.cost_models.memory import tp_activation_share
from tessera.cost_models.partition import StageTotals
from tessera.cost_models.types import Strategy
from tessera.topology.cluster import DeviceSpec
from tessera.topology.hardware import LOCAL_CPU

DEFAULT_HOST_BANDWIDTH_BYTES_PER_S = 64e9
"""Per-direction device-to-host bandwidth for a device whose catalog entry gives none
(``DeviceSpec.host_bandwidth_bytes_per_s`` is None): PCIe 5.0 x16 (32 GT/s x 16 lanes, 128b/130b: 63 GB/s;
NVIDIA's H100 datasheet gives "PCIe Gen5: 128 GB/s" for both directions). A stated assumption."""


def host_bandwidth_bytes_per_s(device: DeviceSpec) -> float:
    """The device's host link per direction: catalogued, or ``DEFAULT_HOST_BANDWIDTH_BYTES_PER_S``; on a CPU
    rank (``local-cpu``) a copy within its own memory, at the memory bandwidth (and ``cost_models.memory`` keeps
    the offloaded tensors in its memory: there is no other)."""
    if device.name == LOCAL_CPU:
        return device.memory_bandwidth_bytes_per_s
    return device.host_bandwidth_bytes_per_s or DEFAULT_HOST_BANDWIDTH_BYTES_PER_S


def offload_copy_s(stage: StageTotals, device: DeviceSpec, strategy: Strategy) -> float:
    """Seconds one direction of one micro-batch's offload copies takes on one device of ``stage``."""
    if not stage.offloaded_bytes:
        return 0.0
    nbytes = stage.offloaded_bytes * strategy.micro_batch * tp_activation_share(strategy) / strategy.cp
    return nbytes / host_bandwidth_bytes_per_s(device)


def exposed_offload_s(
    stage: StageTotals, device: DeviceSpec, strategy: Strategy, *, forward_s: float, backward_s: float,
    overlapped: bool = False,
) -> float:
    """Offload seconds of one micro-batch on the critical path: both copies where they do not overlap the compute
    (``overlapped``: ``ImplementationProfile.offload_copies_overlap``), else the copy-out beyond the forward and the
    copy-in beyond the backward."""
    copy = offload_copy_s(stage, device, strategy)
    if not overlapped:
        return 2 * copy
    return max(0.0, copy - forward_s) + max(0.0, copy - backward_s)
