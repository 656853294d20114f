"""Apply a ``Plan`` to a real model on this rank and train it: ``apply_plan(model, plan) -> ParallelModel``.

Order of application: recomputation (hooks, FQNs unchanged) -> mesh -> data-parallel wrapping/sharding
(DDP or FSDP2) -> optimizer over the wrapped parameters. The runtime reads only the ``Plan`` data model.

Batches: every rank passes the same GLOBAL batch ``(inputs, targets)``, each ``(global_batch, T)``; a rank
keeps its contiguous data-parallel slice of rows (rank ``r`` of ``dp`` keeps rows
``[r * global_batch / dp, (r + 1) * global_batch / dp)``) and splits it into micro-batches of
``plan.strategy.micro_batch`` rows. A step therefore equals one single-device step on the whole batch
with the mean loss over all of it, whatever dp and micro-batch are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from tessera.errors import ConfigError, NotModelledError
from tessera.planner.plan import Plan
from tessera.runtime.data_parallel import COMPUTE_DTYPES, DP, apply_ddp, apply_fsdp, check_zero_supported
from tessera.runtime.mesh import build_mesh, check_axes_supported
from tessera.runtime.recompute import apply_recompute

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
DEFAULT_LR = 1e-3


def default_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: ``logits`` (B, T, V), ``targets`` (B, T); computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # (B*T, V) vs (B*T,)


def default_optimizer_factory(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with ``lr=1e-3`` and PyTorch's other defaults."""
    return torch.optim.AdamW(params, lr=DEFAULT_LR)


class ParallelModel:
    """One rank's share of a planned training run: the wrapped module, its optimizer and ``train_step``."""

    def __init__(
        self, plan: Plan, module: nn.Module, *, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
        mesh: DeviceMesh | None, device: torch.device,
    ) -> None:
        self.plan = plan
        """The plan this model was built from."""
        self.module = module
        """The model as run: a ``DistributedDataParallel`` wrapper (zero=0), the FSDP2-sharded model
        itself (zero=3), or the plain model (world size 1 without a process group)."""
        self.optimizer = optimizer
        """Optimizer over ``module``'s (possibly sharded) parameters."""
        self.loss_fn = loss_fn
        """``loss_fn(outputs, targets)``: mean loss of one micro-batch."""
        self.mesh = mesh
        """The ``("dp",)`` device mesh, or ``None`` when running without a process group."""
        self.device = device
        """Device the rank's batches are moved to."""
        self.rank = dist.get_rank() if mesh is not None else 0
        """This process's global rank."""
        self.world_size = dist.get_world_size() if mesh is not None else 1
        """Number of ranks in the run."""
        self.dp_rank = mesh.get_local_rank(DP) if mesh is not None else 0
        """Index of this rank on the data-parallel axis: which slice of the global batch it trains on."""

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on the GLOBAL batch ``(inputs, targets)``; returns the global mean loss.

        The returned float is the mean loss over the whole global batch, identical on every rank.
        """
        inputs, targets = batch
        accumulation = self._accumulation_steps(inputs, targets)
        micro = self.plan.strategy.micro_batch
        local_loss = torch.zeros((), device=self.device)
        pairs = zip(self._local_rows(inputs).split(micro), self._local_rows(targets).split(micro))
        for index, (micro_inputs, micro_targets) in enumerate(pairs):  # (micro, T) each
            with self._gradient_sync(enabled=index == accumulation - 1):
                with self._autocast():
                    loss = self.loss_fn(self.module(micro_inputs), micro_targets) / accumulation
                loss.backward()
            local_loss += loss.detach().float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._mean_over_dp(local_loss)

    def _accumulation_steps(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        if inputs.shape[0] != targets.shape[0]:
            raise ConfigError(
                f"inputs have {inputs.shape[0]} rows but targets {targets.shape[0]}; pass the same global batch"
            )
        return self.plan.strategy.gradient_accumulation(inputs.shape[0])

    def _local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor.shape[0] // self.plan.strategy.dp
        return tensor[self.dp_rank * rows : (self.dp_rank + 1) * rows].to(self.device)  # (B/dp, T)

    def _gradient_sync(self, *, enabled: bool) -> AbstractContextManager:
        """DDP: skip the all-reduce on all but the last micro-batch of a step.

        FSDP2 reduce-scatters after every micro-batch on purpose: skipping it would keep an unsharded fp32
        gradient of the whole model on every rank, which is the memory ZeRO-3 exists to avoid (and what
        the cost model assumes).
        """
        if isinstance(self.module, DistributedDataParallel) and not enabled:
            return self.module.no_sync()
        return nullcontext()

    def _autocast(self) -> AbstractContextManager:
        """Autocast for DDP/plain mixed precision; FSDP2 casts through its ``MixedPrecisionPolicy``."""
        precision = self.plan.training.precision
        if precision == "fp32" or isinstance(self.module, FSDPModule):
            return nullcontext()
        return torch.autocast(self.device.type, dtype=COMPUTE_DTYPES[precision])

    def _mean_over_dp(self, local_loss: torch.Tensor) -> float:
        if self.mesh is None:
            return local_loss.item()
        dist.all_reduce(local_loss, group=self.mesh.get_group(DP))  # gloo has no AVG: sum, then divide
        return local_loss.item() / self.plan.strategy.dp


def apply_plan(
    model: nn.Module, plan: Plan, *, loss_fn: LossFn | None = None, optimizer_factory: OptimizerFactory | None = None
) -> ParallelModel:
    """Parallelise ``model`` (in place) as ``plan`` says and return the rank's ``ParallelModel``.

    ``model`` must already be on this rank's device. Without an initialised process group the plan must
    have world size 1 and the model runs unwrapped. Raises ``NotModelledError`` for parts of a plan the
    runtime does not implement yet and ``RuntimeSetupError`` when the world does not match the plan.
    """
    check_supported(plan)
    device = next(model.parameters()).device
    apply_recompute(model, recompute_fqns(plan))
    mesh = None if _runs_without_process_group(plan) else build_mesh(plan.strategy)
    module = _parallelize(model, plan, mesh)
    optimizer = (optimizer_factory or default_optimizer_factory)(module.parameters())
    return ParallelModel(
        plan, module, optimizer=optimizer, loss_fn=loss_fn or default_loss_fn, mesh=mesh, device=device
    )


def check_supported(plan: Plan) -> None:
    """Raise ``NotModelledError`` naming the missing feature if the runtime cannot run ``plan`` yet."""
    check_axes_supported(plan.strategy)
    check_zero_supported(plan.strategy)
    if plan.training.precision == "fp16":
        raise NotModelledError(
            "precision fp16 needs dynamic loss scaling (a GradScaler whose overflow check agrees across "
            "sharded ranks), which the runtime does not implement yet; plan with bf16 or fp32"
        )
    selective = [layer.fqn for layer in plan.layers if layer.recompute == "selective"]
    if selective:
        raise NotModelledError(
            f"selective recomputation (planned for {selective[0]} and {len(selective) - 1} more) is not in the "
            "runtime yet (runtime issue); use recompute=full or none"
        )


def recompute_fqns(plan: Plan) -> tuple[str, ...]:
    """FQNs of the layers the plan recomputes in full (the plan's per-layer decisions are authoritative)."""
    return tuple(layer.fqn for layer in plan.layers if layer.recompute == "full")


def _runs_without_process_group(plan: Plan) -> bool:
    return plan.strategy.world_size == 1 and not dist.is_initialized()


def _parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh | None) -> nn.Module:
    if mesh is None:
        return model
    if plan.strategy.zero == 3:
        return apply_fsdp(model, mesh, block_fqns=plan.block_fqns, mixed_precision=plan.training.precision)
    return apply_ddp(model, mesh)
