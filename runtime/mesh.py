"""The device mesh a plan runs on: named axes ``("dp", "pp", "cp", "tp")``, innermost (fastest-varying) last.

Ranks are laid out tensor-parallel innermost, then context-parallel, then pipeline, then data parallel (the
convention ``Strategy`` documents and the cost model counts; Megatron-LM's and Llama 3's order): rank
``r = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index``. Tensor parallelism, which communicates on
every layer, therefore stays inside a node (NVLink domain) whenever ``tp`` divides the GPUs per node; the
context-parallel ring is next-closest; then pipeline neighbours. Size-1 axes are always kept, so code can ask
for any axis by name (``mesh["tp"]``, ``mesh.get_group("dp")``) whatever the strategy; a size-1 axis costs one
trivial group. The world is ``dp * pp * cp * tp`` ranks.

Two derived meshes share the root mesh's ranks and layout:

- :func:`data_mesh`: the ranks that hold the same dense weights and see different tokens, ``dp * cp`` of them
  (the ``dp`` and ``cp`` axes flattened). Dense gradients are averaged, and ZeRO state sharded, over it.
- :func:`expert_mesh`: expert parallelism is carved out of the data-parallel axis (``ep`` divides ``dp``; it
  adds no ranks): ``dp`` is split ``("edp", "ep")`` with ``ep`` innermost, so an expert-parallel group is ``ep``
  consecutive data-parallel ranks (of one cp index). ``ep`` ranks hold different experts and exchange tokens
  (all-to-all); the ``edp = dp / ep`` ranks of the ``edp`` axis, times the ``cp`` ranks, hold the same experts
  and see different tokens: :func:`expert_data_mesh`, over which expert gradients are averaged.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.cost_models.types import Strategy
from tessera.errors import RuntimeSetupError

DP, PP, CP, TP = "dp", "pp", "cp", "tp"
AXES = (DP, PP, CP, TP)
"""Mesh axis names, outermost first."""
EDP, EP = "edp", "ep"
"""Axes :func:`expert_mesh` splits ``dp`` into: replicas of the same experts, and the expert-parallel group."""
DATA, EXPERT_DATA = "dp_cp", "edp_cp"
"""Names of the single (flattened) axes of :func:`data_mesh` and :func:`expert_data_mesh`."""


def device_type() -> str:
    """``cuda`` when the process group runs on NCCL, else ``cpu`` (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def mesh_shape(strategy: Strategy) -> tuple[int, int, int, int]:
    """Sizes of the ``("dp", "pp", "cp", "tp")`` axes."""
    return strategy.dp, strategy.pp, strategy.cp, strategy.tp


def build_mesh(strategy: Strategy) -> DeviceMesh:
    """Build the named mesh ``("dp", "pp", "cp", "tp")`` for ``strategy`` over the initialised default process group."""
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
        _DERIVED.clear()
        _MESHES[key] = init_device_mesh(key[0], key[1], mesh_dim_names=AXES)
    return _MESHES[key]


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of ranks holding the same dense weights: ``dp`` (and ``cp``, flattened into it when > 1)."""
    if mesh[CP].size() == 1:
        return mesh[DP]
    key = (id(mesh), DATA)
    if key not in _DERIVED:  # kept here: slicing a flattened axis from the root mesh is deprecated
        _DERIVED[key] = mesh[DP, CP]._flatten(DATA)
    return _DERIVED[key]


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The root mesh with ``dp`` split into ``("edp", "ep")``, ``ep`` innermost: ``(edp, ep, pp, cp, tp)``."""
    dp = mesh[DP].size()
    if dp % ep:
        raise RuntimeSetupError(f"ep={ep} does not divide the mesh's dp={dp}; plan with an ep that divides dp")
    key = (id(mesh), EP, ep)
    if key not in _DERIVED:
        _DERIVED[key] = mesh._unflatten(DP, (dp // ep, ep), (EDP, EP))
    return _DERIVED[key]


def expert_data_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The 1-D mesh of ranks holding the same experts: ``edp`` (and ``cp``, flattened into it when > 1)."""
    emesh = expert_mesh(mesh, ep)
    if mesh[CP].size() == 1:
        return emesh[EDP]
    key = (id(mesh), EXPERT_DATA, ep)
    if key not in _DERIVED:
        _DERIVED[key] = emesh[EDP, CP]._flatten(EXPERT_DATA)
    return _DERIVED[key]


_MESHES: dict[tuple, DeviceMesh] = {}
_DERIVED: dict[tuple, DeviceMesh] = {}
