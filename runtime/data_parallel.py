"""The data-parallel axis: ZeRO stages 0-3 over the ``dp`` mesh axis (``edp`` x ``ep`` flattened: every rank
with this rank's pipeline, context and tensor indices; ``runtime.mesh``).

Every stage averages gradients over ``dp``, so a step on ``dp`` ranks equals a single-device step on the
concatenated batch (up to the summation order of the reduction). With context parallelism the ``cp`` ranks of
a sequence hold the same weights and see different tokens: dense gradients are averaged, and ZeRO state is
sharded, over ``dp * cp`` ranks (``runtime.mesh.data_mesh``). With expert parallelism each expert is its own
unit over the ``edp`` ranks that hold it (``runtime.expert_parallel.apply_expert_data_parallel``), wrapped
first so that the dense units leave it alone.

- **ZeRO-0** (replicated): ``DistributedDataParallel`` for pure data parallelism; with tensor parallelism
  (``DTensor`` parameters, which DDP cannot bucket) or pipeline stages (pipelining's shape inference runs a
  backward that DDP's bucket rebuild miscounts) PyTorch's FSDP2-based ``replicate``
  (``torch.distributed._composable.replicate_with_fsdp``): the same all-reduce of every gradient.
- **ZeRO-1** (optimizer state sharded) and **ZeRO-2** (+ gradients sharded): FSDP2 ``fully_shard`` with
  ``reshard_after_forward=False``. We chose FSDP2 over ``ZeroRedundancyOptimizer`` because it is the one
  that composes with everything else here: DTensor tensor parallelism (2-D FSDP×TP), pipeline stages
  (``torch.distributed.pipelining`` drives FSDP modules itself) and ``torch.compile``, while
  ``ZeroRedundancyOptimizer`` only partitions plain-tensor parameters and broadcasts them after the step.
  Parameters are all-gathered once per step and kept unsharded through forward and backward (no second
  all-gather in backward: the communication of ZeRO-1/2, reduce-scatter + all-gather), the optimizer steps
  on each rank's 1/dp shard, so its state is 1/dp. ZeRO-1 differs from ZeRO-2 in gradient reduction: it keeps
  the full-size local gradient through the micro-batches of a step and reduce-scatters once, on the last one
  (``ParallelModel`` turns gradient sync off before the others); ZeRO-2 reduce-scatters after every
  micro-batch and accumulates only its shard. With one micro-batch per step they are identical. Under
  pipeline parallelism, ``pipelining`` itself defers the reduction to the last micro-batch for every stage.
- **ZeRO-3**: FSDP2 ``fully_shard`` on every block, then on the root, ``reshard_after_forward=True``:
  parameters are sharded at rest and gathered one block at a time.

Mixed precision: with bf16/fp16, FSDP2 (and ``replicate``) gather and compute parameters in that dtype and
reduce gradients in fp32; the sharded master weights stay fp32. DDP uses ``torch.autocast`` instead (in
``ParallelModel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from tessera.cost_models.types import Precision, Strategy
from tessera.runtime.expert_parallel import apply_expert_data_parallel
from tessera.runtime.mesh import data_mesh

COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def uses_ddp(strategy: Strategy) -> bool:
    """Whether the plan's data-parallel axis is a ``DistributedDataParallel`` wrapper.

    Not with expert parallelism (expert gradients reduce over another group, which FSDP2 units express and
    DDP does not) nor context parallelism (DDP broadcasts rank 0's buffers before every forward, which would
    overwrite each cp rank's own rows of the RoPE tables); FSDP2 ``replicate`` does the same all-reduce.
    """
    plain = strategy.tp == 1 and strategy.pp == 1 and strategy.ep == 1 and strategy.cp == 1
    return strategy.zero == 0 and plain


def apply_data_parallel(
    module: nn.Module, mesh: DeviceMesh, *, strategy: Strategy, block_fqns: Sequence[str], precision: Precision
) -> nn.Module:
    """Wrap or shard ``module`` over the ``dp`` axis of ``mesh`` as ZeRO stage ``strategy.zero`` says.

    ``block_fqns`` are the blocks inside ``module`` (FSDP sharding units). Returns the module to run: a
    ``DistributedDataParallel`` wrapper for plain ZeRO-0 (:func:`uses_ddp`), else ``module`` itself
    (sharded or replicated in place by FSDP2 machinery).
    """
    zero = strategy.zero
    if strategy.ep > 1:
        apply_expert_data_parallel(module, mesh, strategy=strategy, mp_policy=mixed_precision_policy(precision))
    if uses_ddp(strategy):
        return apply_ddp(module, mesh)
    if zero == 0:
        return replicate(module, mesh=data_mesh(mesh), mp_policy=mixed_precision_policy(precision))
    return apply_fsdp(module, mesh, block_fqns=block_fqns, mixed_precision=precision,
                      reshard_after_forward=zero == 3)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """Replicate ``model`` over the ``dp`` axis with DDP (ZeRO-0). Rank 0's weights are broadcast.

    Parameter FQNs gain a ``module.`` prefix on the returned wrapper (``wrapper.module`` is ``model``).
    """
    return DistributedDataParallel(model, process_group=data_mesh(mesh).get_group())


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, block_fqns: Sequence[str], mixed_precision: Precision,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` over the ``dp`` axis with FSDP2: each block, then the root.

    ``block_fqns`` are the plan's sharding units (``blocks.0``...); the rest of the parameters (embedding,
    final norm, head) form the root's group. ``reshard_after_forward`` True is ZeRO-3, False ZeRO-1/2 (see
    the module docstring). Every rank of the ``dp`` axis must hold the same weights (``apply_plan``
    broadcasts rank 0's first; :func:`broadcast_module_states`). FQNs are unchanged; parameters become
    ``DTensor`` shards (``p.full_tensor()`` gathers one).
    """
    policy = mixed_precision_policy(mixed_precision)
    dp_mesh = data_mesh(mesh)
    for fqn in block_fqns:
        fully_shard(model.get_submodule(fqn), mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # Passed explicitly, the root reshards after forward too (FSDP2 keeps it gathered only when the argument is
    # left to its default): at ZeRO-3 the backward's start then holds no gathered unit, and the root is
    # re-gathered once the loss's backward has freed its tensors (``cost_models.memory.zero3_gathered_bytes``).
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def broadcast_module_states(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy parameters and buffers (not on meta) from the first rank of ``group`` (default: all ranks) to the
    others, in place, so ranks need not be seeded identically. Call it before any sharding."""
    group = group or dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type != "meta":
                dist.broadcast(tensor, src=source, group=group)


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``precision``: compute in it, reduce gradients in fp32 (fp32: no casting)."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32)

