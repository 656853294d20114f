"""``ParallelModel``: one rank's share of a planned training run, and its ``train_step``.

Batches: every rank passes the same GLOBAL batch ``(inputs, targets)``, each ``(global_batch, T)``; a rank
keeps its contiguous data-parallel slice of rows (rank ``r`` of ``dp`` keeps rows
``[r * global_batch / dp, (r + 1) * global_batch / dp)``) and splits it into micro-batches of
``plan.strategy.micro_batch`` rows. A step therefore equals one single-device step on the whole batch
with the mean loss over all of it, whatever dp, tp, pp and micro-batch are. Tensor-parallel ranks of one
data-parallel group see the same rows. With context parallelism (``cp > 1``) each rank of a cp group keeps
its zig-zag share of every sequence of those rows, ``(B/dp, T/cp)`` (``runtime.context_parallel``), and the
loss is averaged over ``dp * cp`` ranks. With pipeline parallelism the schedule runs the micro-batches; the
loss exists on the last stage and is broadcast so ``train_step`` returns the same float on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._pytree import tree_leaves, tree_map

from tessera.errors import ConfigError
from tessera.planner.plan import Plan
from tessera.runtime.checkpoint import Checkpointer, CheckpointInfo, PendingSave
from tessera.runtime.data_parallel import COMPUTE_DTYPES
from tessera.runtime.expert_balance import loss_free_balanced, update_expert_biases
from tessera.runtime.float8 import forget_float8_scales, refresh_float8_scales
from tessera.runtime.context_parallel import shard_sequence
from tessera.runtime.mesh import CP, DP, PP, data_mesh
from tessera.runtime.rank_agreement import all_gather
from tessera.runtime.offload import OffloadStats

if TYPE_CHECKING:
    from tessera.runtime.snapshots import SnapshotConfig, Snapshotter

Inputs = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
"""A batch's inputs: one tensor, or a tuple (positional) or dict (keyword arguments) of tensors, rows first."""
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""``loss_fn(outputs, targets) -> scalar``: the mean loss of one micro-batch, from the model's output (a logits
tensor, a Hugging Face ``ModelOutput``, a dict, a tuple...) and the micro-batch's rows of the targets."""


class ParallelModel:
    """One rank's share of a planned training run: the modules it runs, their optimizer and ``train_step``."""

    def __init__(
        self, plan: Plan, modules: Sequence[nn.Module], *, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
        mesh: DeviceMesh | None, device: torch.device, schedule: _PipelineSchedule | None = None,
        chunks: Sequence[int] = (0,), offloads: Mapping[str, OffloadStats] | None = None,
        lr_scheduler: LRScheduler | None = None, check_targets: Callable[[torch.Tensor], None] | None = None,
        token_weights: Any = None, tied_names: Sequence[tuple[str, ...]] = (),
    ) -> None:
        self.plan = plan
        """The plan this model was built from."""
        self.modules = tuple(modules)
        """What this rank runs: the whole model (wrapped by DDP, or sharded in place by FSDP2/DTensor) without
        pipelining, else one module per local pipeline chunk (see ``runtime.pipeline``)."""
        # apply_plan converted the FP8 linears to cast as shards before FSDP2 gathers them: each step computes
        # their scales first (runtime.float8.refresh_float8_scales)
        self._gathers_fp8 = plan.gathers_fp8()
        self._balanced = loss_free_balanced(self.modules)  # torchtitan's MoE: its trainer moves the routing bias
        self.tied_names = tuple(tied_names)
        """Every name of each parameter the user's model holds under several (``runtime.tied_state``): a load
        fills a pipeline stage's copy of a tied weight from its partner's state when the checkpoint lacks its own."""
        self.optimizer = optimizer
        """Optimizer over this rank's (possibly sharded) parameters."""
        self.lr_scheduler = lr_scheduler
        """The learning-rate scheduler on ``optimizer`` (``apply_plan(lr_scheduler_factory=...)``), or ``None``:
        ``train_step`` steps it after every optimizer step, and checkpoints and snapshots save its state
        (``runtime.lr_schedule``)."""
        self.loss_fn = loss_fn
        """``loss_fn(outputs, targets)``: mean loss of one micro-batch (vocabulary-parallel under tp). The default
        (``runtime.losses.default_loss_fn``) is cross-entropy on the output's logits: a logits tensor, a
        ``.logits`` attribute or ``"logits"`` key (Hugging Face ``ModelOutput``, dicts), or a tuple's first
        element; ``runtime.losses.build_loss`` says what a custom one receives under tp and pp."""
        self.mesh = mesh
        """The ``("edp", "pp", "ep", "cp", "tp")`` device mesh (``"dp"`` is ``edp x ep`` flattened; see ``runtime.mesh``), or ``None`` without a process group."""
        self.device = device
        """Device the rank's batches are moved to."""
        self.schedule = schedule
        """The pipeline schedule (``None`` without pipeline parallelism)."""
        self.chunks = tuple(chunks)
        """Pipeline chunks this rank runs (``(0,)`` without pipelining)."""
        self.offloads = dict(offloads or {})
        """What the activation offload hooks of each of this rank's offloaded blocks moved (``runtime.offload``)."""
        self.rank = dist.get_rank() if mesh is not None else 0
        """This process's global rank."""
        self.world_size = dist.get_world_size() if mesh is not None else 1
        """Number of ranks in the run."""
        self.dp_rank = mesh.get_local_rank(DP) if mesh is not None else 0
        """Index of this rank on the data-parallel axis: which slice of the global batch it trains on."""
        self.step = 0
        """Optimizer steps taken (restored by :meth:`load`): the index of the next global batch to train on."""
        self.resumed: CheckpointInfo | None = None
        """What the last :meth:`load` restored (its ``data_state`` is the data position saved), else ``None``."""
        self.snapshots: Snapshotter | None = None
        """In-memory snapshots (``runtime.snapshots``), once :meth:`enable_snapshots` is called."""
        self._token_weights = token_weights
        """The default loss's ``runtime.losses.TokenWeights`` (None under a custom loss): set from each global batch
        so the loss is the mean over all its counted targets, as one process computes it."""
        self._checkpointer = Checkpointer()
        self._check_targets = check_targets
        self._pipeline_row: tuple[int, ...] | None = None  # the first step's row shape under pp
        self._batch_unchecked = True  # whether every rank passed the same batch is checked on the first step
        """What ``train_step`` checks the global batch's targets with before any rank splits it: the default
        loss's (``runtime.targets.check_class_targets``); None under a custom ``loss_fn``, whose targets are its
        own business."""

    @property
    def module(self) -> nn.Module:
        """The first (without pipelining: the only) module this rank runs."""
        return self.modules[0]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters keyed by their FQN in the user's model (DDP's ``module.`` prefix removed)."""
        for module in self.modules:
            for name, param in module.named_parameters():
                yield name.removeprefix("module."), param

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on the GLOBAL batch ``(inputs, targets)``; returns the global mean loss.

        The returned float is the mean loss over the whole global batch, identical on every rank. Each
        micro-batch's loss is ``loss_fn(model(inputs), targets)``: with the default loss the model may return
        a logits tensor ``(..., V)``, an object with ``.logits`` or a ``"logits"`` key (Hugging Face
        ``ModelOutput``, dicts) or a tuple whose first element is the logits, against integer ``targets`` of
        the logits' leading shape; any other output needs ``loss_fn=`` (a one-line ``ConfigError`` names the
        output's type). Pass batches of the planned global batch: BatchNorm layers were checked for it.
        """
        inputs, targets = _inputs_and_targets(batch)
        if not isinstance(inputs, torch.Tensor):
            self._check_several_inputs_supported(inputs)
        if self._batch_unchecked and self.world_size > 1:
            _check_same_batch_on_every_rank(inputs, targets)
            self._batch_unchecked = False
        if self.schedule is not None:
            self._check_pipeline_rows(inputs)
        if self._check_targets is not None:  # on the whole batch, so every rank refuses it alike
            self._check_targets(targets)
        accumulation = self._accumulation_steps(inputs, targets)
        if self._token_weights is not None:
            ranks = data_mesh(self.mesh).size() if self.mesh is not None else 1
            self._token_weights.set_step(targets, micro_batches=accumulation, ranks=ranks)
        inputs, targets = tree_map(self._local_rows, inputs), self._local_rows(targets)  # (B/dp, T)
        if self.schedule is not None and accumulation != self.schedule._n_microbatches:
            raise ConfigError(
                f"the pipeline schedule was built for {self.schedule._n_microbatches} micro-batches per step (the "
                f"plan's global batch {self.plan.training.global_batch}); this batch of {batch[1].shape[0]} rows "
                f"makes {accumulation}; pass batches of the planned size"
            )
        if self._gathers_fp8:
            refresh_float8_scales(self.modules)
        try:
            if self.schedule is None:
                local_loss = self._run_micro_batches(inputs, targets, accumulation)
            else:
                local_loss = self._run_pipeline(inputs, targets)
            reduce_partial_gradients(self.optimizer)
            if self._balanced:
                update_expert_biases(self._balanced, data_mesh(self.mesh).get_group() if self.mesh is not None else None)
            self.optimizer.step()
        finally:  # scales of these weights: wrong once the optimizer or anything else changes them
            if self._gathers_fp8:
                forget_float8_scales(self.modules)
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        loss = self._mean_over_dp(local_loss)
        if self.snapshots is not None:
            self.snapshots.after_step(self)  # stages a copy, then writes it in the background
        return loss

    def save(self, root: str | Path, *, data_state: Any = None, async_save: bool = False,
             keep_last: int | None = None) -> PendingSave:
        """Save a sharded checkpoint of this step to ``root/step-<step>`` (call on every rank; see
        ``runtime.checkpoint``): model, optimizer, learning-rate scheduler, step, RNG states, ``data_state`` (the
        data position) and the plan. ``async_save`` returns once the state is copied to host memory and writes in the background;
        ``keep_last`` (at least 1) deletes Tessera's older checkpoints beyond that many (never other folders).
        One save writes into a root at a time; any failure raises ``CheckpointError`` and leaves no partial
        folder. ``.wait()`` on the result returns the committed folder.
        """
        return self._checkpointer.save(self, root, data_state=data_state, async_save=async_save, keep_last=keep_last)

    def load(self, path: str | Path, *, verify: bool = True) -> CheckpointInfo:
        """Restore a checkpoint saved under any plan and world size (call on every rank): ``path`` is a
        ``step-*`` folder, or the root given to :meth:`save` (then the newest intact checkpoint is used).
        ``verify`` checks every file's SHA-256; ``CheckpointError`` names what is incomplete or corrupt.
        """
        self.resumed = self._checkpointer.load(self, path, verify=verify)
        return self.resumed

    def enable_snapshots(self, config: SnapshotConfig | None = None, *,
                         data_state: Callable[[], Any] | None = None) -> Snapshotter:
        """Snapshot the training state every ``config.every`` steps into host memory on this node and a buddy
        node (call on every rank; see ``runtime.snapshots``; without ``config.every``, the reliability model picks it
        for this plan). ``data_state()`` returns the data position to store with each (default: none; ``step`` is
        the next batch's index)."""
        from tessera.runtime.snapshot_staging import refuse_strided_splits  # noqa: PLC0415 (only when used)
        from tessera.runtime.snapshots import SnapshotConfig, Snapshotter  # noqa: PLC0415 (only when used)

        refuse_strided_splits(self.module.named_parameters())  # here, not at the first snapshot's staging
        self.snapshots = Snapshotter(config or SnapshotConfig(), data_state=data_state, plan=self.plan)
        return self.snapshots

    def wait_for_snapshot(self) -> Path | None:
        """Block until this rank's part of the snapshot in flight is done (its file written and copied to the buddy
        node; on a node's leader, also the node's commit); its folder in this node's store. Other ranks may still be
        at work: after it returns on every rank (e.g. then ``dist.barrier()``), the snapshot is committed everywhere."""
        return self.snapshots.wait() if self.snapshots is not None else None

    def close(self) -> None:
        """A clean finish (call on every rank): wait for the checkpoint in flight, remove the snapshots."""
        self._checkpointer.wait()
        if self.snapshots is not None:
            self.snapshots.close()
            self.snapshots = None

    def wait_for_checkpoint(self) -> Path | None:
        """Block until an asynchronous save is committed; its folder (``None`` if none was in flight)."""
        return self._checkpointer.wait()

    def _run_micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor, accumulation: int) -> torch.Tensor:
        micro = self.plan.strategy.micro_batch
        local_loss = torch.zeros((), device=self.device)
        for index, micro_targets in enumerate(targets.split(micro)):
            micro_inputs = tree_map(lambda t: t[index * micro:(index + 1) * micro], inputs)
            with self._step_context(last_micro_batch=index == accumulation - 1, autocast=False):
                with self._autocast():  # the forward only: its cache of cast weights goes when it exits
                    loss = self.loss_fn(_call(self.module, micro_inputs), micro_targets) / accumulation
                loss.backward()
            local_loss += loss.detach().float()
        return local_loss

    def _check_pipeline_rows(self, inputs: torch.Tensor) -> None:
        """Pipeline stages exchange activations of the shape they were built for: a row of another shape would
        make a receive's buffer disagree with its send, which gloo answers by aborting the process. Token ids must
        have the plan's ``seq_len``; other inputs the shape of the first step's rows. Every rank holds the whole
        batch, so every rank refuses alike, before any collective."""
        row = tuple(inputs.shape[1:])
        planned = self.plan.training.seq_len
        if not inputs.is_floating_point() and inputs.dim() == 2 and row != (planned,):
            raise ConfigError(f"under pipeline parallelism the stages exchange activations of the planned shape: "
                              f"these token ids have {row[0]} positions, the plan's seq_len is {planned}; pass "
                              f"batches of seq_len {planned}, or plan again for {row[0]}")
        if self._pipeline_row is None:
            self._pipeline_row = row
        if row != self._pipeline_row:
            raise ConfigError(f"under pipeline parallelism every step's rows keep the first step's shape "
                              f"{self._pipeline_row}; this batch's rows are {row}")

    def _run_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the schedule; the last stage's mean micro-batch loss, broadcast over the pipeline axis."""
        last_chunk = len(self.plan.chunk_fqns()) - 1
        has_last = last_chunk in self.chunks
        losses: list[torch.Tensor] = []
        args = (inputs,) if 0 in self.chunks else ()
        kwargs = {"target": targets, "losses": losses} if has_last else {}
        with self._step_context(last_micro_batch=True):
            # Only the losses are read: return_outputs=False lets the last stage free each micro-batch's logits.
            self.schedule.step(*args, return_outputs=False, **kwargs)
        local_loss = torch.stack([loss.detach().float() for loss in losses]).mean() if has_last else torch.zeros(())
        local_loss = local_loss.to(self.device)
        group = self.mesh.get_group(PP)
        dist.broadcast(local_loss, src=dist.get_global_rank(group, last_chunk % self.plan.strategy.pp), group=group)
        return local_loss

    def _step_context(self, *, last_micro_batch: bool, autocast: bool = True) -> AbstractContextManager:
        """Gradient sync on the last micro-batch, the loss on vocabulary shards under tp and, with ``autocast``,
        autocast over forward and backward alike (a pipeline schedule runs both in one call; its autocast cache
        then keeps one compute-dtype copy of each weight until the step's last backward, see
        ``cost_models.memory_transients.accumulation_bytes``)."""
        stack = ExitStack()
        stack.enter_context(self._gradient_sync(enabled=last_micro_batch))
        if autocast:
            stack.enter_context(self._autocast())
        if self.plan.strategy.tp > 1:
            stack.enter_context(loss_parallel())  # the loss and its backward run on vocabulary shards
        return stack

    def _accumulation_steps(self, inputs: Inputs, targets: torch.Tensor) -> int:
        for tensor in tree_leaves(inputs):
            if tensor.shape[0] != targets.shape[0]:
                raise ConfigError(f"inputs have {tensor.shape[0]} rows but targets {targets.shape[0]}; pass the same "
                                  "global batch")
        return self.plan.strategy.gradient_accumulation(targets.shape[0])

    def _check_several_inputs_supported(self, inputs: Inputs) -> None:
        """Several input tensors run under data and tensor parallelism; a pipeline's first stage and context
        parallelism's split of a sequence take one."""
        strategy = self.plan.strategy
        if strategy.pp > 1 or strategy.cp > 1:
            axis = "pipeline parallelism (its first stage takes one tensor)" if strategy.pp > 1 else (
                "context parallelism (it splits one sequence tensor)")
            raise ConfigError(f"train_step got {len(inputs)} input tensors, and {axis} takes one; pass one tensor "
                              f"(wrap the model so its forward takes one), or plan with {'pp' if strategy.pp > 1 else 'cp'}=1")

    def _local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows (``dp``) and, with context parallelism, its zig-zag share of each sequence (``cp``)."""
        rows = tensor.shape[0] // self.plan.strategy.dp
        tensor = tensor[self.dp_rank * rows : (self.dp_rank + 1) * rows]  # (B/dp, T)
        if self.plan.strategy.cp > 1:
            cp_rank = self.mesh.get_local_rank(CP)
            tensor = shard_sequence(tensor, cp=self.plan.strategy.cp, rank=cp_rank)  # (B/dp, T/cp)
        return tensor.to(self.device)

    def _gradient_sync(self, *, enabled: bool) -> AbstractContextManager:
        """Reduce gradients once per step where the plan keeps full-size gradients anyway.

        DDP (ZeRO-0) skips its all-reduce on all but the last micro-batch; so do FSDP2-based ``replicate``
        (ZeRO-0 with tensor parallelism) and ZeRO-1, which hold an unsharded gradient through the step and
        reduce (scatter) it once. ZeRO-2/3 reduce-scatter after every micro-batch on purpose: skipping it would
        keep an unsharded fp32 gradient of the whole model on every rank, which is what they exist to avoid
        (and what the cost model assumes). ZeRO-1/2 also keep their parameters unsharded until the last
        micro-batch's backward: FSDP2 reshards after every backward by default and would all-gather them again
        for each micro-batch, where ZeRO-1/2 gather once per step (``runtime.data_parallel``; the cost model
        charges one all-gather). Pipeline schedules manage both themselves (``PipelineStage`` sets them).
        """
        if self.schedule is not None:
            return nullcontext()
        module = self.module
        if isinstance(module, DistributedDataParallel):
            return nullcontext() if enabled else module.no_sync()
        if isinstance(module, FSDPModule) and self.plan.strategy.zero <= 1:
            module.set_requires_gradient_sync(enabled)
        if isinstance(module, FSDPModule) and self.plan.strategy.zero in (1, 2):
            module.set_reshard_after_backward(enabled)
        return nullcontext()

    def _autocast(self) -> AbstractContextManager:
        """Autocast for DDP/plain mixed precision; FSDP2 casts through its ``MixedPrecisionPolicy``. Wrapped
        around the forward alone where the runtime calls the backward itself, as PyTorch's AMP recipe says: autocast
        caches each weight's compute-dtype copy until it exits, so a backward inside it would keep every copy until
        the last gradient exists (measured: 13 MiB more peak on the 4-rank DDP of ``benchmarks/memory_truth.py
        --models wide-short``); outside it each copy goes once its layer's backward has used it."""
        precision = self.plan.training.precision
        if precision == "fp32" or isinstance(self.module, FSDPModule):
            return nullcontext()
        return torch.autocast(self.device.type, dtype=COMPUTE_DTYPES[precision])

    def _mean_over_dp(self, local_loss: torch.Tensor) -> float:
        if self.mesh is None:
            return local_loss.item()
        group = data_mesh(self.mesh).get_group()  # dp (x cp: each cp rank's loss is over its share of the tokens)
        dist.all_reduce(local_loss, group=group)  # gloo has no AVG: sum, then divide
        return local_loss.item() / dist.get_world_size(group)


def reduce_partial_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Sum gradients left ``Partial`` (sequence-parallel norm weights) once, before the step: the optimizer's
    foreach maths would otherwise all-reduce each of them again in every operation that reads it (measured
    against torchtitan: 45 all-reduces per step instead of 17, benchmarks/results/torchtitan-overhead-*.md)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
                param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _inputs_and_targets(batch: object) -> tuple[Inputs, torch.Tensor]:
    """``batch`` as ``(inputs, targets)``, or a ``ConfigError`` saying how to pass it (a Hugging Face style dict is
    the common mistake). ``inputs``: a tensor, or the forms ``example_inputs`` takes (a tuple of tensors, the
    forward's positional arguments; a dict of tensors, its keyword arguments), each row one sample."""
    if isinstance(batch, dict):
        raise ConfigError(f"train_step takes a tuple (inputs, targets), got a dict with keys {sorted(map(str, batch))}; "
                          "pass e.g. (batch['input_ids'], batch['labels'])")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        what = f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        raise ConfigError(f"train_step takes a tuple (inputs, targets), got {what}; pass both, the targets shaped "
                          "like the logits without their class dimension")
    inputs, targets = batch
    if isinstance(inputs, (tuple, list)):
        inputs = tuple(inputs) if len(inputs) != 1 else inputs[0]  # one positional argument: the tensor itself
    several = isinstance(inputs, (tuple, dict)) and len(inputs) > 0
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) if several else [inputs]
    odd = next((value for value in values if not isinstance(value, torch.Tensor)), None)
    if odd is not None or (isinstance(inputs, dict) and not all(isinstance(key, str) for key in inputs)):
        raise ConfigError(f"train_step's inputs must be a torch.Tensor, or a tuple (positional) or dict (keyword "
                          f"arguments) of tensors with one row per sample; got {type(inputs).__name__}"
                          + (f" holding a {type(odd).__name__}" if several and odd is not None else ""))
    if not isinstance(targets, torch.Tensor):
        raise ConfigError(f"train_step's targets must be a torch.Tensor, got {type(targets).__name__}")
    return inputs, targets


def _call(module: nn.Module, inputs: Inputs) -> Any:
    """The forward on one micro-batch's inputs, as ``example_inputs`` is: a tuple positionally, a dict by name."""
    if isinstance(inputs, tuple):
        return module(*inputs)
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(inputs)


def _check_same_batch_on_every_rank(inputs: Inputs, targets: torch.Tensor) -> None:
    """Refuse, on every rank alike, a first batch that differs between ranks: each rank takes its own slice of the
    global batch, so per-rank batches (a ``DistributedSampler``'s shard) trained on rows no one meant, under tp and
    pp on one rank's inputs against another's targets, with a plausible loss. Once: it costs a gather."""
    fingerprints = all_gather([_fingerprint(tensor) for tensor in (*tree_leaves(inputs), targets)], dist.group.WORLD)
    differs = next((rank for rank, theirs in enumerate(fingerprints) if theirs != fingerprints[0]), None)
    if differs is not None:
        raise ConfigError(f"train_step got different batches on rank 0 and rank {differs}: every rank passes the same "
                          "GLOBAL batch and Tessera gives each rank its slice; load the whole batch on every rank (the "
                          "same data order and seed), not a per-rank shard")


def _fingerprint(tensor: torch.Tensor) -> tuple[int, ...]:
    """Shape and two exact integer sums of ``tensor``'s bits (one weighted by position, so reordered rows differ)."""
    flat = tensor.detach()
    flat = torch.view_as_real(flat) if flat.is_complex() else flat
    flat = flat.reshape(-1)
    if flat.is_floating_point():
        flat = flat.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    values = flat.long()
    weights = torch.arange(1, values.numel() + 1, device=values.device)  # no period: any two rows swapped differ
    return (*tensor.shape, int(values.sum()), int((values * weights).sum()))
