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
  parameters are sharded at rest and gathered one block at a time. Per block, ``Strategy.block_reshard``
  may keep a block's gathered weights from its forward to its backward instead (``reshard_after_forward=False``
  on that block and on the expert units inside it: one all-gather fewer per micro-batch, a per-layer
  ZeRO-2/ZeRO-3 mix); the root keeps resharding.

Mixed precision: with bf16/fp16, FSDP2 (and ``replicate``) gather and compute parameters in that dtype and
reduce gradients in fp32; the sharded master weights stay fp32. DDP uses ``torch.autocast`` instead (in
``ParallelModel``).

**BatchNorm** normalises with statistics of the batch, so per-rank statistics would make ``dp`` ranks train
differently from one process. With ``dp > 1`` every BatchNorm layer is replaced (same parameters, buffers and
FQNs) by one that normalises over all data-parallel ranks' rows (:func:`sync_batch_norms`):
``torch.nn.SyncBatchNorm`` on an accelerator; on CPU, where torch 2.13's ``SyncBatchNorm`` raises in forward
("expected input tensor to be on GPU") and DDP refuses a CPU module that holds one, :class:`CpuSyncBatchNorm`,
which computes the same statistics with differentiable all-reduces over gloo. Where the statistics could still
not be the whole batch's, :func:`check_batch_norm` refuses the plan naming the layer: tensor or context
parallelism (channels or tokens split across ranks), pipeline parallelism (micro-batches, and a shape-inference
forward on empty tensors), more than one micro-batch per step (each would be normalised on its own), and
recomputation of a layer holding BatchNorm (its running statistics would be updated twice). A step is then
exactly one single-process step on the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from tessera.cost_models.types import Precision, Strategy
from tessera.errors import NotModelledError
from tessera.planner.plan import Plan
from tessera.runtime.expert_parallel import apply_expert_data_parallel
from tessera.runtime.mesh import data_mesh
from tessera.runtime.tp_styles import fsdp_shard_placement

COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                                          "fp8": torch.bfloat16}
"""The dtype each precision computes in; under fp8 everything but the FP8 linears' matmuls is bf16
(``runtime.float8``)."""


def uses_ddp(strategy: Strategy) -> bool:
    """Whether the plan's data-parallel axis is a ``DistributedDataParallel`` wrapper.

    Not with expert parallelism (expert gradients reduce over another group, which FSDP2 units express and
    DDP does not) nor context parallelism (DDP broadcasts rank 0's buffers before every forward, which would
    overwrite each cp rank's own rows of the RoPE tables); FSDP2 ``replicate`` does the same all-reduce.
    """
    plain = strategy.tp == 1 and strategy.pp == 1 and strategy.ep == 1 and strategy.cp == 1
    return strategy.zero == 0 and plain


def apply_data_parallel(
    module: nn.Module, mesh: DeviceMesh, *, strategy: Strategy, block_fqns: Sequence[str], precision: Precision,
    block_reshard: Mapping[str, bool] | None = None,
) -> nn.Module:
    """Wrap or shard ``module`` over the ``dp`` axis of ``mesh`` as ZeRO stage ``strategy.zero`` says.

    ``block_fqns`` are the blocks inside ``module`` (FSDP sharding units); ``block_reshard`` optionally says, per
    block FQN, whether it reshards after forward under ZeRO-3 (``Strategy.reshards_block``). Returns the module to run: a
    ``DistributedDataParallel`` wrapper for plain ZeRO-0 (:func:`uses_ddp`), else ``module`` itself
    (sharded or replicated in place by FSDP2 machinery).
    """
    zero = strategy.zero
    if strategy.ep > 1:
        apply_expert_data_parallel(module, mesh, strategy=strategy, mp_policy=mixed_precision_policy(precision),
                                   block_reshard=block_reshard)
    if uses_ddp(strategy):
        return apply_ddp(module, mesh)
    if zero == 0:
        return replicate(module, mesh=data_mesh(mesh), mp_policy=mixed_precision_policy(precision))
    return apply_fsdp(module, mesh, block_fqns=block_fqns, mixed_precision=precision,
                      reshard_after_forward=zero == 3, block_reshard=block_reshard)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """Replicate ``model`` over the ``dp`` axis with DDP (ZeRO-0). Rank 0's weights are broadcast.

    Parameter FQNs gain a ``module.`` prefix on the returned wrapper (``wrapper.module`` is ``model``).
    """
    return DistributedDataParallel(model, process_group=data_mesh(mesh).get_group())


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, block_fqns: Sequence[str], mixed_precision: Precision,
    reshard_after_forward: bool = True, block_reshard: Mapping[str, bool] | None = None,
) -> nn.Module:
    """Shard ``model`` over the ``dp`` axis with FSDP2: each block, then the root.

    ``block_fqns`` are the plan's sharding units (``blocks.0``...); the rest of the parameters (embedding,
    final norm, head) form the root's group. ``reshard_after_forward`` True is ZeRO-3, False ZeRO-1/2 (see
    the module docstring); ``block_reshard`` overrides it for the blocks it names (the expert units inside them
    follow it: ``runtime.expert_parallel.apply_expert_data_parallel``). A weight tensor parallelism splits as a
    strided shard on dim 0 (a packed ``nn.Linear`` q|k|v or gate|up) is sharded on dim 1
    (``tp_styles.fsdp_shard_placement``). Every rank of the ``dp`` axis must hold the same weights (``apply_plan``
    broadcasts rank 0's first; :func:`broadcast_module_states`). FQNs are unchanged; parameters become
    ``DTensor`` shards (``p.full_tensor()`` gathers one).
    """
    policy = mixed_precision_policy(mixed_precision)
    dp_mesh = data_mesh(mesh)
    for fqn in block_fqns:
        reshard = (block_reshard or {}).get(fqn, reshard_after_forward)
        fully_shard(model.get_submodule(fqn), mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard,
                    shard_placement_fn=fsdp_shard_placement)
    # Passed explicitly, the root reshards after forward too (FSDP2 keeps it gathered only when the argument is
    # left to its default): at ZeRO-3 the backward's start then holds no gathered unit, and the root is
    # re-gathered once the loss's backward has freed its tensors (``cost_models.memory.zero3_gathered_bytes``).
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                shard_placement_fn=fsdp_shard_placement)
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


# ------------------------------------------------------------------------------------------------ BatchNorm


def batch_norm_fqns(model: nn.Module) -> list[str]:
    """FQNs of the model's BatchNorm layers (every ``_BatchNorm``: ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``...)."""
    return [fqn for fqn, module in model.named_modules() if isinstance(module, _BatchNorm)]


def check_batch_norm(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan under which BatchNorm would not compute the whole batch's statistics (see
    :func:`sync_batch_norms`): ``NotModelledError`` naming the first such layer, the reason and the fix."""
    fqns = batch_norm_fqns(model)
    if not fqns:
        return
    problem = _batch_norm_axis_problem(plan)
    if problem or "" in fqns:
        raise NotModelledError(f"{_layer_name(model, fqns[0])} {problem or _ROOT_BATCH_NORM}")
    for layer in plan.layers:
        reruns = layer.recompute in ("selective", "full")  # offload runs the forward once
        inside = [fqn for fqn in fqns if reruns and f"{fqn}.".startswith(f"{layer.fqn}.")]
        if inside:
            raise NotModelledError(
                f"{_layer_name(model, inside[0])}: recomputing {layer.fqn} ({layer.recompute}) would run BatchNorm's "
                f"forward twice and update its running statistics twice; plan {layer.fqn} with recompute=none"
            )


_ROOT_BATCH_NORM = "is itself a BatchNorm layer: wrap it in a module (BatchNorm layers are replaced in their parent)"
_FIX = "or replace BatchNorm by GroupNorm or LayerNorm (per-sample statistics)"


def _batch_norm_axis_problem(plan: Plan) -> str | None:
    """Why BatchNorm cannot be exact under the plan's strategy, with the fix; ``None`` when it can."""
    strategy, global_batch = plan.strategy, plan.training.global_batch
    if strategy.tp > 1 or strategy.cp > 1:
        return (f"normalises over the batch, but tensor or context parallelism (tp={strategy.tp}, cp={strategy.cp}) "
                f"would give each rank the statistics of its own shard of the channels or tokens (not implemented); "
                f"plan with tp=1 and cp=1, {_FIX}")
    if strategy.pp > 1:
        return ("normalises over the batch, but pipeline parallelism runs micro-batches and a shape-inference "
                "forward on empty tensors, which would change its statistics and running averages; plan with pp=1, "
                f"{_FIX}")
    micro_batches = strategy.gradient_accumulation(global_batch)
    if micro_batches > 1:
        return (f"normalises each micro-batch with that micro-batch's statistics, and the plan runs {micro_batches} "
                f"micro-batches per step (global batch {global_batch}, dp={strategy.dp}, "
                f"micro_batch={strategy.micro_batch}), so a step would not equal one step on the whole batch; plan "
                f"with micro_batch={global_batch // strategy.dp} (one micro-batch per step), {_FIX}")
    return None


def _layer_name(model: nn.Module, fqn: str) -> str:
    return f"{fqn or 'the model'} ({type(model.get_submodule(fqn)).__name__})"


def sync_batch_norms(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Replace each BatchNorm layer below ``model``, in place, by one that normalises with the statistics of
    the whole data-parallel batch; returns their FQNs (none when the data-parallel group is one rank).

    Per-rank statistics would make ``dp`` ranks train differently from one process on the same batch; with
    the statistics (and running averages) of all ``dp * cp`` ranks' rows (``runtime.mesh.data_mesh``) a step
    equals the single-process step. On an accelerator the layer is ``torch.nn.SyncBatchNorm``; on CPU, where
    torch 2.13's ``SyncBatchNorm`` refuses to run (and DDP refuses a CPU module holding one), it is
    :class:`CpuSyncBatchNorm`, which computes the same statistics with two all-reduces. Parameters and
    buffers are kept (the same objects), and so are FQNs. Call after :func:`check_batch_norm`.
    """
    group = data_mesh(mesh).get_group()
    if dist.get_world_size(group) == 1:
        return []
    synced: dict[int, nn.Module] = {}  # a layer used twice stays one layer
    converted = []
    for parent_fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, (nn.SyncBatchNorm, CpuSyncBatchNorm)):
                if id(child) not in synced:
                    synced[id(child)] = _synced_copy(child, group, device_type=mesh.device_type)
                setattr(parent, name, synced[id(child)])
                converted.append(f"{parent_fqn}.{name}".removeprefix("."))
    return converted


def _synced_copy(layer: _BatchNorm, group: dist.ProcessGroup, *, device_type: str) -> nn.Module:
    if device_type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(layer, group)
    return CpuSyncBatchNorm.from_batch_norm(layer, group)


class CpuSyncBatchNorm(_BatchNorm):
    """BatchNorm over the rows of every rank of ``process_group``, on CPU (gloo), where
    ``torch.nn.SyncBatchNorm`` raises in forward.

    In training, with more than one rank: the per-channel sum and element count are all-reduced, then the sum
    of squared deviations from that mean (two passes, as exact as one process), so every rank normalises with
    the mean and biased variance of the global batch and updates the running averages as one process would
    (unbiased variance over the global count, ``momentum`` or the cumulative average when it is ``None``).
    The all-reduce is differentiable (its backward all-reduces the gradient, as ``SyncBatchNorm``'s does), so
    input gradients carry every rank's terms. Statistics are computed in fp32. In eval mode, or on one
    rank, it is plain BatchNorm.
    """

    def __init__(self, num_features: int, *, eps: float, momentum: float | None, affine: bool,
                 track_running_stats: bool, process_group: dist.ProcessGroup) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device="meta")
        self.process_group = process_group

    @classmethod
    def from_batch_norm(cls, layer: _BatchNorm, group: dist.ProcessGroup) -> CpuSyncBatchNorm:
        """A synced layer holding ``layer``'s very parameters and buffers, in its train/eval mode."""
        synced = cls(layer.num_features, eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                     track_running_stats=layer.track_running_stats, process_group=group)
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(synced, name, getattr(layer, name))
        synced.train(layer.training)
        return synced

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size(self.process_group) == 1:
            return super().forward(input)
        self._check_input_dim(input)
        x = input.float()  # (B, C, *)
        dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
        totals = _SumOverGroup.apply(torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.shape[1]])]),
                                     self.process_group)  # (C + 1,): sums, then the element count
        count, mean = totals[-1], totals[:-1] / totals[-1]  # (C,)
        centered = x - mean.view(shape)
        var = _SumOverGroup.apply(centered.square().sum(dims), self.process_group) / count  # biased, (C,)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * count / (count - 1))
        output = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` whose backward all-reduces the gradient: each rank's input feeds every
    rank's output."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
