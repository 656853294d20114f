"""The device mesh a plan runs on.

Today the runtime implements the data-parallel axis only, so the mesh is 1-D and named ``("dp",)``.
Later axes (pp, cp, ep, tp) will be added as further named dimensions of the same mesh, so code that
needs the data-parallel group should always ask for it by name: ``mesh.get_group("dp")``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.cost_models.types import Strategy
from tessera.errors import NotModelledError, RuntimeSetupError

DP = "dp"
UNSUPPORTED_AXES = {
    "tp": "tensor parallelism (runtime/tensor_parallel.py, not written yet)",
    "pp": "pipeline parallelism (runtime/pipeline.py, not written yet)",
    "cp": "context parallelism (not written yet)",
    "ep": "expert parallelism (runtime/experts.py, not written yet)",
}


def check_axes_supported(strategy: Strategy) -> None:
    """Raise ``NotModelledError`` if the strategy uses a mesh axis the runtime cannot build yet."""
    for axis, feature in UNSUPPORTED_AXES.items():
        degree = getattr(strategy, axis)
        if degree > 1:
            raise NotModelledError(
                f"strategy {strategy.to_string()!r} uses {axis}={degree}, but the runtime does not implement "
                f"{feature}; apply a plan with {axis}=1 (data parallelism only) for now"
            )


def device_type() -> str:
    """``cuda`` when the process group runs on NCCL, else ``cpu`` (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build_mesh(strategy: Strategy) -> DeviceMesh:
    """Build the named mesh ``("dp",)`` for ``strategy`` over the initialised default process group."""
    check_axes_supported(strategy)
    if not dist.is_initialized():
        raise RuntimeSetupError(
            f"strategy {strategy.to_string()!r} needs {strategy.world_size} ranks but no process group is "
            "initialised; launch with torchrun or tessera.runtime.spawn, or apply a plan with world size 1"
        )
    world_size = dist.get_world_size()
    if world_size != strategy.world_size:
        raise RuntimeSetupError(
            f"strategy {strategy.to_string()!r} needs {strategy.world_size} ranks but the process group has "
            f"{world_size}; relaunch with {strategy.world_size} processes or re-plan for {world_size} devices"
        )
    return init_device_mesh(device_type(), (strategy.dp,), mesh_dim_names=(DP,))
