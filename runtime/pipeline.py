"""Pipeline parallelism: split the model at the plan's chunk boundaries and run a pipelining schedule.

**Splitting** (``runtime.pipeline_split``). The root forward is traced into a graph whose planned layers are
``call_module`` nodes: with ``torch.fx`` where it traces, else with ``torch.export`` at the plan's micro-batch
shape, the planned layers swapped back in as calls of the user's eager modules (``runtime.pipeline_export``:
Hugging Face and torchtitan models). The root's glue goes to the earliest chunk where its inputs exist, or is
recomputed by every chunk reading it when it depends on no input (a causal mask or rotary tables traced at a
static shape); each chunk becomes a ``GraphModule`` holding the user's own layer modules under their FQNs.
Values crossing a boundary must be tensors; so must the last chunk's output (``torch.distributed.pipelining``
checks it), so a model returning a structure (a dict, a Hugging Face ``ModelOutput``) has its last chunk
return the structure's tensors as a tuple and the loss receives the structure again
(:func:`return_dict_as_tuple` for an fx trace, :class:`TreeOutput` for an export trace,
:class:`StructuredOutputLoss`). Layers of chunks another rank runs are moved to the meta device.

**Tied weights** (``runtime.pipeline_ties``): an input embedding shared with the LM head keeps a copy on
each end stage, its gradients summed over those stages before every optimizer step (Megatron-LM), also
under tensor parallelism when both copies are split alike.

**Placement.** With ``pp`` ranks and ``V`` chunks per rank (``interleaved:V``), chunk ``c`` runs on
pipeline rank ``c % pp`` (Megatron-LM's interleaving; ``V = 1`` is one chunk per rank).

**Schedules.** ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B`` (``ScheduleGPipe`` with fewer
micro-batches than stages, which ``Schedule1F1B`` refuses), ``interleaved`` ->
``ScheduleInterleaved1F1B``, ``zero-bubble`` -> ``ScheduleInterleavedZeroBubble`` (backward split into input
and weight gradients; it accepts one chunk per rank). A step feeds the rank's data-parallel slice of the
global batch; the schedule cuts it into ``global_batch / (dp * micro_batch)`` micro-batches, computes the
loss of each on the last stage, and scales gradients by ``1 / micro-batches``: the step equals one
single-device step on the mean loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import TreeSpec, tree_map, tree_unflatten

from tessera.cost_models.types import Strategy
from tessera.errors import ConfigError
from tessera.planner.plan import Plan
from tessera.runtime.pipeline_export import check_input_shapes  # noqa: F401 (the splitting API, used from here)
from tessera.runtime.pipeline_split import (  # noqa: F401
    TracedForward,
    build_chunk_module,
    check_split,
    node_chunks,
    trace_forward,
    trace_layers,
)

SINGLE_STAGE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE = {"interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}


def local_chunks(plan: Plan, pp_rank: int) -> list[int]:
    """Chunk indices pipeline rank ``pp_rank`` runs, in order (chunk ``c`` runs on rank ``c % pp``)."""
    return [chunk for chunk in range(len(plan.chunk_fqns())) if chunk % plan.strategy.pp == pp_rank]


def check_chunks(plan: Plan) -> None:
    """The plan must have ``pp * V`` chunks, each holding at least one module layer."""
    strategy = plan.strategy
    chunks = plan.chunk_fqns()
    expected = strategy.pp * strategy.virtual_stages
    if len(chunks) != expected:
        raise ConfigError(
            f"plan has {len(chunks)} pipeline chunks but strategy {strategy.to_string()!r} needs pp * virtual_stages "
            f"= {expected}; re-plan (the plan's chunks must match its strategy)"
        )
    for index in range(expected):
        if not any(layer.chunk == index and layer.kind != "loss" for layer in plan.layers):
            raise ConfigError(f"pipeline chunk {index} of the plan holds no layer; re-plan with fewer stages")


def layer_chunks(plan: Plan) -> dict[str, int]:
    """Planned layer FQN -> its pipeline chunk."""
    return {layer.fqn: layer.chunk for layer in plan.layers if layer.kind != "loss"}


def trace_plan(model: nn.Module, plan: Plan) -> TracedForward:
    """The root forward traced for splitting at the plan's layers, its chunk boundaries checked (every
    boundary, so call it on every rank before anything is sharded: a refusal is raised alike everywhere).

    ``torch.export``, where ``torch.fx`` fails, runs at one micro-batch of token ids ``(micro_batch, seq_len)``:
    the inputs a step feeds the first chunk (a model taking other inputs cannot be pipelined yet).
    """
    first = next(model.parameters(), None)
    example = torch.zeros(plan.strategy.micro_batch, plan.training.seq_len, dtype=torch.long,
                          device=first.device if first is not None else None)
    traced = trace_forward(model, list(layer_chunks(plan)), example=example)
    check_split(model, traced, layer_chunks(plan))
    return traced


# ------------------------------------------------------------------------------------------------ placement


def free_remote_layers(model: nn.Module, plan: Plan, local: Sequence[int]) -> None:
    """Move the layers of chunks other ranks run to the meta device (frees their memory; shapes stay).

    A parameter tied to a local layer's (:func:`cross_chunk_ties`) is kept: ``Module.to`` gives the remote
    layer a new meta parameter (a real tensor is never moved in place to meta), so this rank keeps its copy. A
    layer without parameters stays whole everywhere: its buffers are small (rotary tables), and an export that
    traces it as glue (``pipeline_export``) has every chunk reading its output recompute it from them.
    """
    for layer in plan.layers:
        module = model.get_submodule(layer.fqn) if layer.kind != "loss" else None
        if module is not None and layer.chunk not in local and next(module.parameters(), None) is not None:
            module.to("meta")


# ------------------------------------------------------------------------------------------------ schedules


def build_stages(
    modules: Sequence[nn.Module], chunks: Sequence[int], *, num_chunks: int, device: torch.device, group,
    schedule: str = "1f1b",
) -> list[PipelineStage]:
    """One ``PipelineStage`` per local chunk; shapes are inferred on the first step. A chunk's outputs are sent
    contiguous: gloo's send refuses a strided view (a model carrying ``x.transpose(1, 2)`` between blocks). Under
    zero-bubble the last chunk returns its outputs as views: PyTorch detaches a last stage's outputs in place after
    the input-gradient pass (views excepted), and an output an op had saved as its own result (a model returning a
    hidden state beside its logits) then failed the weight-gradient pass; the final pass frees the graph anyway."""
    for module, chunk in zip(modules, chunks):
        last_split = schedule == "zero-bubble" and chunk == num_chunks - 1
        module.register_forward_hook(_outputs_as_views if last_split else _contiguous_outputs)
    return [
        _BufferKeepingStage(module, chunk, num_chunks, device, group=group) for module, chunk in zip(modules, chunks)
    ]


class _BufferKeepingStage(PipelineStage):
    """A stage whose shape inference leaves its module's buffers as they were. On the first step PyTorch runs each
    stage's forward and backward once more to learn the shapes it sends (its RNG forked, its buffers not): a layer
    that counts in its forward (torchtitan's MoE routing counts, ``tokens_per_expert_E``) or keeps running
    statistics would count that pass too. The buffers are put back once that pass's backward is done (a buffer its
    forward saved for backward must keep its version until then). (Private methods of torch 2.13's
    ``PipelineStage``, which Tessera pins.)"""

    _kept: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _forward_metadata_inference(self, args, kwargs=None, has_backward: bool = False):
        self._kept = _buffer_values(self.submod)
        try:
            return super()._forward_metadata_inference(args, kwargs, has_backward)
        finally:
            if not has_backward:
                self._put_buffers_back()

    def _backward_metadata_inference(self, *args, **kwargs):  # a recomputed block runs its forward again
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self._put_buffers_back()

    def _put_buffers_back(self) -> None:
        if self._kept is not None:
            _restore_buffers(self.submod, self._kept)
            self._kept = None


def _buffer_values(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each real buffer of ``module``: the tensor itself and a copy of its values."""
    return {name: (buffer, _local(buffer).clone()) for name, buffer in module.named_buffers() if not buffer.is_meta}


def _restore_buffers(module: nn.Module, kept: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put back the tensors ``_buffer_values`` saw (a forward may have replaced one) and their values."""
    with torch.no_grad():
        for name, (buffer, values) in kept.items():
            owner, _, attribute = name.rpartition(".")
            if module.get_buffer(name) is not buffer:
                setattr(module.get_submodule(owner), attribute, buffer)
            if not torch.equal(_local(buffer), values):
                _local(buffer).copy_(values)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _contiguous_outputs(_module: nn.Module, _args: tuple, output: Any) -> Any:
    return tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, output)


def _outputs_as_views(_module: nn.Module, _args: tuple, output: Any) -> Any:
    return tree_map(lambda x: x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x, output)


def single_stage_schedule(strategy: Strategy, *, micro_batches: int) -> type[_PipelineSchedule]:
    """The schedule class for one chunk per rank. ``Schedule1F1B`` refuses fewer micro-batches than stages, so
    1F1B then runs as GPipe: the same ``m + pp - 1`` slots (with ``m < pp`` 1F1B's warm-up already runs every
    forward of stage 0 before its first backward), but every stage holds all ``m`` micro-batches, which
    ``cost_models.pipeline.in_flight_micro_batches`` charges."""
    if strategy.schedule == "1f1b" and micro_batches < strategy.pp:
        return ScheduleGPipe
    return SINGLE_STAGE[strategy.schedule]


def build_schedule(
    stages: list[PipelineStage], strategy: Strategy, *, micro_batches: int, loss_fn: Callable
) -> _PipelineSchedule:
    """The plan's schedule over this rank's stages, running ``micro_batches`` per step.

    PyTorch's own limits (interleaved and zero-bubble: a multiple of the rounds) surface as ``ConfigError``
    naming the schedule and the numbers.
    """
    if strategy.schedule in SINGLE_STAGE and len(stages) != 1:
        raise ConfigError(f"schedule {strategy.schedule} runs one chunk per rank, this rank has {len(stages)}")
    try:
        if strategy.schedule in SINGLE_STAGE:
            schedule = single_stage_schedule(strategy, micro_batches=micro_batches)
            return schedule(stages[0], micro_batches, loss_fn=loss_fn)
        return MULTI_STAGE[strategy.schedule](stages, micro_batches, loss_fn=loss_fn)
    except ValueError as error:
        raise ConfigError(
            f"schedule {strategy.schedule} cannot run {micro_batches} micro-batches per step on pp={strategy.pp} "
            f"({error}); choose a micro-batch size (or global batch) that gives a suitable count"
        ) from error


# ------------------------------------------------------------------------------------------------ the loss


@dataclass(frozen=True)
class DictOutput:
    """What the last chunk of an fx trace returned before :func:`return_dict_as_tuple`."""

    keys: tuple[str, ...]
    """Keys of its tensor values, in the order the chunk now returns them."""
    constants: dict[str, Any]
    """Its other values (``None`` fields...), put back into the dict as they are."""

    def rebuild(self, values: tuple) -> dict:
        """The dict the model returned, from the chunk's tuple of tensors."""
        return {**self.constants, **dict(zip(self.keys, values))}


@dataclass(frozen=True)
class TreeOutput:
    """The model's output structure in an export trace, whose last chunk returns the structure's tensors."""

    spec: TreeSpec
    """The output's pytree structure (``CausalLMOutputWithPast(logits=*)``...)."""
    constants: dict[int, Any] = field(default_factory=dict)
    """Leaves that are not tensors, by leaf index."""

    def rebuild(self, values: tuple) -> Any:
        """The output the model returns (its own type), from the chunk's tuple of tensors."""
        tensors = iter(values)
        leaves = [self.constants[i] if i in self.constants else next(tensors) for i in range(self.spec.num_leaves)]
        return tree_unflatten(leaves, self.spec)


def return_dict_as_tuple(module: nn.Module) -> DictOutput | None:
    """Make the last chunk return the tensors of its dict output as a tuple; what the dict held, else ``None``.

    ``torch.distributed.pipelining`` accepts only a tensor or a tuple of tensors out of a stage, the last one
    included, and a model returning a dict (a Hugging Face ``ModelOutput`` traces as one with fx) is common;
    the loss gets the dict back from :class:`StructuredOutputLoss`. Tensor and tuple outputs are left as they are.
    """
    if not isinstance(module, fx.GraphModule):
        return None
    output = next(node for node in module.graph.nodes if node.op == "output")
    value = output.args[0]
    if not isinstance(value, dict):
        return None
    keys = tuple(key for key, item in value.items() if isinstance(item, fx.Node))
    output.args = (tuple(value[key] for key in keys),)
    module.recompile()
    return DictOutput(keys, {key: item for key, item in value.items() if key not in keys})


class StructuredOutputLoss:
    """``loss_fn(output, targets)`` on the last stage, ``output`` rebuilt (a dict, a ``ModelOutput``...) from the
    tuple of tensors the stage returns."""

    def __init__(self, loss_fn: Callable, output: DictOutput | TreeOutput) -> None:
        self.loss_fn = loss_fn
        self.output = output

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        values = outputs if isinstance(outputs, tuple) else (outputs,)  # shape inference unpacks a 1-tuple
        return self.loss_fn(self.output.rebuild(values), targets)


DictOutputLoss = StructuredOutputLoss
"""The name the fx path's tests know it by."""
