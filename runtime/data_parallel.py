"""The data-parallel axis: DDP for ZeRO-0, FSDP2 ``fully_shard`` for ZeRO-3.

Both average gradients over the ``dp`` mesh axis, so a step on ``dp`` ranks equals a single-device step
on the concatenated batch (up to the summation order of the reduction). ZeRO-1/2 are not implemented.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from tessera.cost_models.types import Precision, Strategy
from tessera.errors import NotModelledError

DP = "dp"
COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_zero_supported(strategy: Strategy) -> None:
    """Raise ``NotModelledError`` for ZeRO stages the runtime does not implement (1 and 2)."""
    if strategy.zero in (1, 2):
        raise NotModelledError(
            f"strategy {strategy.to_string()!r} asks for ZeRO-{strategy.zero}, which the runtime does not "
            "implement yet (optimizer/gradient sharding without parameter sharding; planned via "
            "ZeroRedundancyOptimizer / FSDP2 reshard_after_forward=False); use zero=0 (DDP) or zero=3 (FSDP)"
        )


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """Replicate ``model`` over the ``dp`` axis with DDP (ZeRO-0). Rank 0's weights are broadcast.

    Parameter FQNs gain a ``module.`` prefix on the returned wrapper (``wrapper.module`` is ``model``).
    """
    return DistributedDataParallel(model, process_group=mesh.get_group(DP))


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, block_fqns: tuple[str, ...], mixed_precision: Precision
) -> nn.Module:
    """Shard ``model`` over the ``dp`` axis with FSDP2 (ZeRO-3): each block, then the root.

    ``block_fqns`` are the plan's sharding units (``blocks.0``...); the rest of the parameters (embedding,
    final norm, head) form the root's group. With ``bf16``/``fp16`` the parameters are all-gathered and
    computed in that dtype and gradients are reduced in fp32; the sharded master weights stay fp32.
    Rank 0's weights are broadcast first, as DDP does, so ranks need not be seeded identically.
    FQNs are unchanged; parameters become ``DTensor`` shards (``p.full_tensor()`` gathers one).
    """
    broadcast_module_states(model, mesh)
    policy = _mixed_precision_policy(mixed_precision)
    for fqn in block_fqns:
        fully_shard(model.get_submodule(fqn), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def broadcast_module_states(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy parameters and buffers from the first rank of the ``dp`` axis to the others (in place)."""
    group = mesh.get_group(DP)
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type != "meta":
                dist.broadcast(tensor, src=source, group=group)


def _mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32)
