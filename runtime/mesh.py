"""The device mesh a plan runs on: named axes ``("dp", "pp", "tp")``, innermost (fastest-varying) last.

Ranks are laid out tensor-parallel innermost, then pipeline, then data parallel: rank
``r = (dp_index * pp + pp_index) * tp + tp_index``. Tensor parallelism, which communicates on every layer,
therefore stays inside a node (NVLink domain) whenever ``tp`` divides the GPUs per node, and pipeline
neighbours are the next-closest ranks. Size-1 axes are always kept, so code can ask for any axis by name
(``mesh["tp"]``, ``mesh.get_group("dp")``) whatever the strategy; a size-1 axis costs one trivial group.
Context and expert parallelism (``cp``, ``ep``) will be further named axes between ``tp`` and ``pp``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.cost_models.types import Strategy
from tessera.errors import NotModelledError, RuntimeSetupError

DP, PP, TP = "dp", "pp", "tp"
AXES = (DP, PP, TP)
"""Mesh axis names, outermost first."""
UNSUPPORTED_AXES = {
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
                f"{feature}; apply a plan with {axis}=1 for now"
            )


def device_type() -> str:
    """``cuda`` when the process group runs on NCCL, else ``cpu`` (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def mesh_shape(strategy: Strategy) -> tuple[int, int, int]:
    """Sizes of the ``("dp", "pp", "tp")`` axes."""
    return strategy.dp, strategy.pp, strategy.tp


def build_mesh(strategy: Strategy) -> DeviceMesh:
    """Build the named mesh ``("dp", "pp", "tp")`` for ``strategy`` over the initialised default process group."""
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
    key = (device_type(), mesh_shape(strategy), id(dist.group.WORLD))
    if key not in _MESHES:  # each axis costs process groups (a rendezvous each): build a shape once per world
        _MESHES.clear()
        _MESHES[key] = init_device_mesh(key[0], key[1], mesh_dim_names=AXES)
    return _MESHES[key]


_MESHES: dict[tuple, DeviceMesh] = {}
