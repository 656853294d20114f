"""The device mesh a plan runs on: named axes ``("edp", "pp", "ep", "cp", "tp")``, innermost (fastest-varying) last.

The layout is the one ``Strategy`` documents and the cost model counts (Llama 3's ``tp -> cp -> pp -> dp``
order, with expert parallelism carved out of ``dp`` inside the pipeline axis as Megatron-Core does): the data-
parallel axis is split ``dp = edp * ep`` and rank ``r`` has data-parallel rank ``dp_i = edp_i * ep + ep_i`` with

    ``r = (((edp_i * pp + pp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i``.

Tensor parallelism, which communicates on every layer, stays inside a node (NVLink domain) whenever ``tp``
divides the GPUs per node; the context-parallel ring is next-closest; an expert-parallel group (its
all-to-alls) sits inside one pipeline stage, ``tp * cp`` ranks apart, so inside a node when ``tp * cp * ep``
fits one; pipeline neighbours are ``tp * cp * ep`` ranks apart; the ``edp`` replicas are outermost. Without
expert parallelism (``ep == 1``), or without pipelining (``pp == 1``), this is exactly the plain
``("dp", "pp", "cp", "tp")`` layout, ``r = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i``.

Size-1 axes are always kept, so code can ask for any axis by name (``mesh["tp"]``, ``mesh.get_group("ep")``)
whatever the strategy; a size-1 axis costs one trivial group. The world is ``dp * pp * cp * tp`` ranks.

**The data-parallel axis ``"dp"``** is not a dimension of the root mesh but the flattened ``("edp", "ep")``
pair (DeviceMesh ``_flatten``, a process group of its own): the ranks with equal ``(pp_i, cp_i, tp_i)``, in
``dp_i`` order. :func:`build_mesh` creates it, and the root mesh resolves the name for groups and local ranks
(``mesh.get_group("dp")``, ``mesh.get_local_rank("dp")``: which rows of the batch a rank trains on); for the
1-D mesh itself use :func:`dp_mesh` (slicing a flattened name from the root mesh is deprecated in torch).

Derived meshes, all sharing the root mesh's ranks and layout:

- :func:`data_mesh`: the ranks that hold the same dense weights and see different tokens, ``dp * cp`` of them
  (``edp``, ``ep`` and ``cp`` flattened). Dense gradients are averaged, and ZeRO state sharded, over it.
- the ``ep`` axis (``mesh["ep"]``): ranks holding different experts, exchanging tokens by all-to-all;
- :func:`expert_data_mesh`: the ``edp * cp`` ranks (``edp`` and ``cp`` flattened) that hold the same experts
  and see different tokens, over which expert gradients are averaged.

**Folded experts** (``Strategy.etp = 1 < tp``, Megatron's "MoE parallel folding"): the dense layers keep the plain
``(dp, pp, cp, tp)`` layout (the root mesh's ``edp`` axis is then all ``dp`` ranks and its ``ep`` axis has size 1),
and the experts get a grid of their own over the same ranks (:func:`expert_grid`): each pipeline stage's
``dp x tp`` ranks, in ``q = dp_i * tp + tp_i`` order, unflattened (DeviceMesh ``_unflatten``) into
``("expert_dp", "expert_ep")`` with ``q = expert_dp_i * ep + expert_ep_i``. An expert-parallel group is therefore
``ep`` ranks of consecutive ``q``: inside one tensor-parallel group first (what ``cost_models.sparse`` prices:
ep peers ``etp = 1`` apart), then across data-parallel ranks; its members see different tokens (their
``(dp_i, tp_i)`` differ, and tensor-parallel ranks each dispatch their own share: ``experts_exchange.TokenShard``).
``expert_dp = dp * tp / ep`` ranks hold the same experts.
"""

from __future__ import annotations

import atexit
import functools
import gc

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.cost_models.types import Strategy
from tessera.errors import RuntimeSetupError

EDP, PP, EP, CP, TP = "edp", "pp", "ep", "cp", "tp"
AXES = (EDP, PP, EP, CP, TP)
"""Mesh axis names, outermost first."""
DP = "dp"
"""The data-parallel axis: ``("edp", "ep")`` flattened (:func:`dp_mesh`)."""
DATA, EXPERT_DATA = "dp_cp", "edp_cp"
"""Names of the flattened axes of :func:`data_mesh` and :func:`expert_data_mesh` when ``cp > 1``."""
STAGE, FOLDED_EDP, FOLDED_EP = "dp_tp", "expert_dp", "expert_ep"
"""The flattened ``dp x tp`` ranks of a stage and the two axes of the folded experts' grid (:func:`expert_grid`)."""


def device_type() -> str:
    """``cuda`` when the process group runs on NCCL, else ``cpu`` (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def mesh_shape(strategy: Strategy) -> tuple[int, int, int, int, int]:
    """Sizes of the ``("edp", "pp", "ep", "cp", "tp")`` axes; with folded experts the plain dense layout (``ep``
    axis 1: the experts' own grid is :func:`expert_grid`)."""
    if folds_experts(strategy):
        return strategy.dp, strategy.pp, 1, strategy.cp, strategy.tp
    return strategy.expert_dp, strategy.pp, strategy.ep, strategy.cp, strategy.tp


def folds_experts(strategy: Strategy) -> bool:
    """Whether the experts run on a grid of their own (``etp < tp``: MoE parallel folding)."""
    return strategy.ep > 1 and strategy.expert_tp != strategy.tp


def is_folded(mesh: DeviceMesh, ep: int) -> bool:
    """Whether ``mesh`` (built by :func:`build_mesh`) carries folded experts: ``ep > 1`` but its ep axis is 1."""
    return ep > 1 and mesh[EP].size() == 1


def expert_grid(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The folded experts' 2-D mesh ``("expert_dp", "expert_ep")`` over this stage's ``dp x tp`` ranks (module
    docstring); created once per root mesh (every rank calls it alike: it makes process groups)."""
    key = (id(mesh), ep)
    if key not in _GRIDS:
        stage = mesh[EDP, TP]._flatten(STAGE)
        size = stage.size()
        if size % ep:
            raise RuntimeSetupError(f"ep={ep} does not divide the {size} dp x tp ranks of a stage; plan an ep that "
                                    f"divides dp*tp = {size}")
        _GRIDS[key] = (mesh, stage._unflatten(0, (size // ep, ep), (FOLDED_EDP, FOLDED_EP)))
    return _GRIDS[key][1]


def build_mesh(strategy: Strategy) -> DeviceMesh:
    """Build the named mesh ``("edp", "pp", "ep", "cp", "tp")`` for ``strategy``, and its flattened ``"dp"``
    axis, over the initialised default process group."""
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
    world = dist.group.WORLD
    key = (device_type(), mesh_shape(strategy), id(world))
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not world:  # each axis costs process groups (a rendezvous each): once per world
        if any(kept is not world for kept, _ in _MESHES.values()):
            _MESHES.clear()  # a new world: the old one's meshes are dead
            _GRIDS.clear()
        _collect_at_exit()
        mesh = init_device_mesh(key[0], key[1], mesh_dim_names=AXES)
        mesh[EDP, EP]._flatten(DP)  # registered on the root mesh: mesh.get_group("dp") / get_local_rank("dp")
        _MESHES[key] = (world, mesh)  # the world group is kept alive so that its id is not reused
    return _MESHES[key][1]


@functools.cache  # once per process
def _collect_at_exit() -> None:
    """Release the meshes and collect garbage before the interpreter shuts down. Sliced meshes left in reference
    cycles are otherwise freed during finalization, and freeing their gloo groups then aborts the process after
    its work is done ("terminate called without an active exception"): a torchrun job reported as failed. On 2
    gloo ranks (torch 2.13) a bare 5-axis mesh aborted so in 6 of 30 launches, 0 of 30 with a collection at exit,
    and Tessera's README snippet in 0 of 30 (``benchmarks/exit_aborts.py``)."""
    atexit.register(_release_at_exit)


def _release_at_exit() -> None:
    _MESHES.clear()
    _GRIDS.clear()
    gc.collect()


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D data-parallel mesh: ``edp`` and ``ep`` flattened, ``dp_i = edp_i * ep + ep_i``."""
    return mesh[EDP, EP]._flatten(DP)  # torch returns the one build_mesh created


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of ranks holding the same dense weights: ``dp`` (and ``cp``, flattened into it when > 1)."""
    if mesh[CP].size() == 1:
        return dp_mesh(mesh)
    return mesh[EDP, EP, CP]._flatten(DATA)  # created once: torch returns an existing flattening of the same ranks


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of ranks holding the same experts: ``edp`` (and ``cp``, flattened into it when > 1)."""
    if mesh[CP].size() == 1:
        return mesh[EDP]
    return mesh[EDP, CP]._flatten(EXPERT_DATA)


_MESHES: dict[tuple, tuple[dist.ProcessGroup, DeviceMesh]] = {}
_GRIDS: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}  # the root mesh kept alive: its id stays unique
