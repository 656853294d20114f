"""Pipeline parallelism: split the model at the plan's chunk boundaries and run a pipelining schedule.

**Splitting.** The root module's forward is traced with ``torch.fx`` keeping every planned layer a leaf
(``blocks.3`` is one ``call_module`` node; what happens inside it is not traced). Each node of the root's
glue code (``tok_emb(ids) + pos_emb(arange(T))``, RoPE table slicing...) goes to the earliest chunk where
all its inputs exist; a buffer read (``get_attr``) goes to the chunk of its first user. Chunk ``c`` then
becomes a ``GraphModule`` whose inputs are the values chunk ``c - 1`` hands over (chunk 0: the root's
arguments, default values kept) and whose outputs are the values later chunks still need. Optional arguments
with constant defaults (``mask=None``, ``scale=1.0``) are traced at their defaults, as a step calls the model
with its inputs only. So a value used several stages later (Llama's RoPE ``cos``/``sin``, computed
once from the root's buffers) travels along the pipeline with the hidden states. Values crossing a
boundary must be tensors; so must the last chunk's output (``torch.distributed.pipelining`` checks it), so a
model returning a dict (a Hugging Face ``ModelOutput`` traces as one) has its last chunk return the dict's
tensors as a tuple and the loss receives the dict again (:func:`return_dict_as_tuple`, :class:`DictOutputLoss`).

The chunk module holds the very same layer modules (not copies) under their original FQNs:
``stage.get_submodule("blocks.3")`` is ``model.blocks[3]`` and ``stage.named_parameters()`` yields
``blocks.3.attn.q.weight``, so checkpoints and optimizer state keep the user's names. Buffers a chunk reads
are shared likewise. Layers of chunks another rank runs are moved to the meta device (their memory freed).

**Tied weights** (an input embedding shared with the LM head: GPT-2, Gemma, OPT) stay tied, as in
Megatron-LM: each stage holding one of the layers keeps its own copy of the weight (equal at the start:
rank 0's weights are broadcast), and before every optimizer step the copies' gradients are summed over the
group of those stages in each pipeline (:class:`TiedGradients`), so every copy takes the step the single
parameter takes. Each copy keeps its layer's FQN (``emb.weight`` on the first stage, ``head.weight`` on the
last), as a single-process state dict lists both. Refused by name (:func:`check_ties`): ties with
``tp > 1``, in a model on the meta device, or between two chunks of one pipeline rank.

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

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from tessera.cost_models.types import Strategy
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.plan import Plan

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


# ------------------------------------------------------------------------------------------------ splitting


class _LayerTracer(fx.Tracer):
    """Traces the root's glue code only: every planned layer is one leaf ``call_module`` node."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaves or super().is_leaf_module(module, qualified_name)


def trace_layers(model: nn.Module, layer_fqns: Sequence[str]) -> fx.Graph:
    """fx graph of ``model.forward`` with each of ``layer_fqns`` a leaf; a clear error if it cannot be traced.

    Optional arguments (``mask=None``, ``scale=1.0``) are traced at their defaults (:func:`default_constants`):
    a step feeds the inputs only, so the chunks compute exactly what ``model(inputs)`` computes.
    """
    try:
        return _LayerTracer(set(layer_fqns)).trace(model, concrete_args=default_constants(model))
    except Exception as error:  # fx raises many types (TraceError, TypeError on control flow...)
        raise NotModelledError(
            f"pipeline parallelism splits the model's forward with torch.fx, which cannot trace "
            f"{type(model).__name__}: {error}; plan it with pp=1"
        ) from error


CONSTANT_DEFAULTS = (type(None), bool, int, float, str)
"""Default values traced as constants; other defaults (a tensor...) stay a placeholder's default value."""


def default_constants(model: nn.Module) -> dict[str, Any]:
    """The root forward's optional arguments whose defaults are plain constants, by name, with those defaults.

    Traced as constants, an unused ``mask=None`` is ``None`` wherever it goes (a block in a later chunk gets
    ``None``, not a value handed over between stages) and ``if mask is not None`` follows the default's branch.
    """
    return {
        name: param.default
        for name, param in inspect.signature(model.forward).parameters.items()
        if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
        and param.default is not param.empty and isinstance(param.default, CONSTANT_DEFAULTS)
    }


def node_chunks(graph: fx.Graph, chunk_of_layer: dict[str, int]) -> dict[fx.Node, int]:
    """Chunk of every node: a layer's from the plan, glue code's from its inputs, buffers' from their users."""
    chunks: dict[fx.Node, int] = {}
    last = max(chunk_of_layer.values())
    for node in graph.nodes:
        inputs = [chunks[n] for n in node.all_input_nodes if n in chunks]
        earliest = max(inputs, default=0)
        if node.op == "call_module":
            chunks[node] = _layer_chunk(node, chunk_of_layer, earliest)
        elif node.op == "output":
            chunks[node] = last
        elif node.op != "get_attr":
            chunks[node] = earliest
    for node in graph.nodes:
        if node.op == "get_attr":
            chunks[node] = min((chunks[user] for user in node.users), default=0)
    return chunks


def _layer_chunk(node: fx.Node, chunk_of_layer: dict[str, int], earliest: int) -> int:
    target = str(node.target)
    if target not in chunk_of_layer:
        raise NotModelledError(
            f"the model's forward calls module {target}, which the plan does not list as a layer; pipeline "
            "stages are cut between planned layers only (re-plan this model)"
        )
    chunk = chunk_of_layer[target]
    if chunk < earliest:
        raise ConfigError(
            f"plan puts {target} in pipeline chunk {chunk} but it reads a value computed in chunk {earliest}; "
            "chunks must follow the model's data flow"
        )
    return chunk


def build_chunk_module(model: nn.Module, graph: fx.Graph, chunks: dict[fx.Node, int], chunk: int) -> fx.GraphModule:
    """A module computing chunk ``chunk`` alone: inputs are what chunk ``chunk - 1`` hands over."""
    inputs = _handover(graph, chunks, chunk - 1) if chunk > 0 else [n for n in graph.nodes if n.op == "placeholder"]
    outputs = _handover(graph, chunks, chunk)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:  # the first chunk's placeholders are the root's, default values kept (``node_copy``)
        env[node] = new.node_copy(node) if chunk == 0 else new.placeholder(node.name)
    for node in graph.nodes:
        if chunks[node] == chunk and node.op not in ("placeholder", "output"):
            env[node] = new.node_copy(node, env.__getitem__)
    final = next(n for n in graph.nodes if n.op == "output")
    if chunks[final] == chunk:
        new.output(fx.map_arg(final.args[0], env.__getitem__))
    else:
        new.output(tuple(env[node] for node in outputs))
    module = fx.GraphModule(model, new, class_name=f"PipelineChunk{chunk}")
    _keep_buffers_non_persistent(model, module)
    return module


def _handover(graph: fx.Graph, chunks: dict[fx.Node, int], chunk: int) -> list[fx.Node]:
    """Values computed in chunks ``<= chunk`` that a later chunk reads, in graph order."""
    return [
        node
        for node in graph.nodes
        if node.op != "output" and chunks[node] <= chunk and any(chunks[user] > chunk for user in node.users)
    ]


def _keep_buffers_non_persistent(model: nn.Module, module: fx.GraphModule) -> None:
    """GraphModule registers copied buffers as persistent; keep the original's choice (RoPE tables are not)."""
    for name, _ in list(module.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        original, copy = model.get_submodule(owner_name), module.get_submodule(owner_name)
        if leaf in original._non_persistent_buffers_set and copy is not original:
            copy._non_persistent_buffers_set.add(leaf)


def free_remote_layers(model: nn.Module, plan: Plan, local: Sequence[int]) -> None:
    """Move the layers of chunks other ranks run to the meta device (frees their memory; shapes stay).

    A parameter tied to a local layer's (:func:`cross_chunk_ties`) is kept: ``Module.to`` gives the remote
    layer a new meta parameter (a real tensor is never moved in place to meta), so this rank keeps its copy.
    """
    for layer in plan.layers:
        if layer.kind != "loss" and layer.chunk not in local:
            model.get_submodule(layer.fqn).to("meta")


# ------------------------------------------------------------------------------------------------ tied weights


@dataclass(frozen=True)
class TiedWeight:
    """One parameter shared by layers of different pipeline chunks (an input embedding and the LM head)."""

    fqns: tuple[str, ...]
    """Its FQN in each chunk holding it, in chunk order (``tok_emb.weight``, ``head.weight``)."""
    chunks: tuple[int, ...]
    """The chunk of each FQN."""

    def pp_ranks(self, pp: int) -> tuple[int, ...]:
        """Pipeline ranks holding a copy (chunk ``c`` runs on ``c % pp``)."""
        return tuple(sorted({chunk % pp for chunk in self.chunks}))


def cross_chunk_ties(model: nn.Module, plan: Plan) -> list[TiedWeight]:
    """Parameters shared by layers of different chunks, found by identity on the unsplit model."""
    owners: dict[int, dict[int, str]] = {}  # id(param) -> chunk -> first FQN there
    for layer in plan.layers:
        if layer.kind == "loss":
            continue
        for name, param in model.get_submodule(layer.fqn).named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), {}).setdefault(layer.chunk, f"{layer.fqn}.{name}")
    return [
        TiedWeight(tuple(by_chunk[c] for c in sorted(by_chunk)), tuple(sorted(by_chunk)))
        for by_chunk in owners.values() if len(by_chunk) > 1
    ]


def check_ties(ties: Sequence[TiedWeight], strategy: Strategy, *, on_meta: bool) -> None:
    """Refuse the tied-weight combinations the runtime does not keep exact, naming the weight and the fix."""
    for tie in ties:
        names = " and ".join(tie.fqns)
        if strategy.tp > 1:
            raise NotModelledError(f"{names} are tied across pipeline stages, which the runtime keeps in sync only "
                                   "with tp=1; untie them, or plan with tp=1 or pp=1")
        if on_meta:
            raise NotModelledError(f"{names} are tied across pipeline stages in a model on the meta device; build "
                                   "the model on its device, or plan with pp=1")
        if len(tie.pp_ranks(strategy.pp)) < len(tie.chunks):
            raise NotModelledError(f"{names} are tied between chunks {tie.chunks} and two of them run on one "
                                   f"pipeline rank under {strategy.to_string()!r}; plan other chunks or pp=1")


def tie_group(mesh: DeviceMesh, pp_ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """The process group of this rank's copies of a tied weight: the ``pp_ranks`` of its pipeline (the ranks
    equal on every other mesh axis; Megatron-LM's embedding group). Every rank calls it (groups are
    created collectively); ``None`` on a rank holding no copy."""
    pp = mesh.mesh.shape[mesh.mesh_dim_names.index("pp")]
    pipelines = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, pp)  # (replicas, pp)
    groups = [[int(row[r]) for r in pp_ranks] for row in pipelines]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


class TiedGradients:
    """Optimizer pre-step hook: sum each tied weight's gradient over its copies, so every copy takes the same
    step as the single tied parameter would.

    Each stage's gradient is its layers' part of the full gradient (already averaged over data parallelism
    and scaled by ``1 / micro-batches``, both linear), so the sum is exactly the unsplit model's gradient. A
    gradient sharded by FSDP is summed shard by shard: both copies are sharded alike over the same ``dp``.
    """

    def __init__(self, params: Sequence[tuple[nn.Parameter, dist.ProcessGroup]]) -> None:
        self.params = list(params)

    def __call__(self, optimizer: torch.optim.Optimizer, *_) -> None:
        for param, group in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=group)


def local_tied_parameters(
    ties: Sequence[TiedWeight], modules: Sequence[nn.Module], mesh: DeviceMesh, *, pp: int, pp_rank: int
) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """This rank's copy of each tied weight with its group (collective: call on every rank, ties in order)."""
    params = {name.removeprefix("module."): p for m in modules for name, p in m.named_parameters()}
    found = []
    for tie in ties:
        group = tie_group(mesh, tie.pp_ranks(pp))
        if group is None or pp_rank not in tie.pp_ranks(pp):
            continue
        found.append((next(params[fqn] for fqn in tie.fqns if fqn in params), group))
    return found


# ------------------------------------------------------------------------------------------------ schedules


def build_stages(
    modules: Sequence[nn.Module], chunks: Sequence[int], *, num_chunks: int, device: torch.device, group
) -> list[PipelineStage]:
    """One ``PipelineStage`` per local chunk; shapes are inferred on the first step."""
    return [
        PipelineStage(module, chunk, num_chunks, device, group=group) for module, chunk in zip(modules, chunks)
    ]


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
    """What the last chunk returned before :func:`return_dict_as_tuple`."""

    keys: tuple[str, ...]
    """Keys of its tensor values, in the order the chunk now returns them."""
    constants: dict[str, Any]
    """Its other values (``None`` fields...), put back into the dict as they are."""


def return_dict_as_tuple(module: nn.Module) -> DictOutput | None:
    """Make the last chunk return the tensors of its dict output as a tuple; what the dict held, else ``None``.

    ``torch.distributed.pipelining`` accepts only a tensor or a tuple of tensors out of a stage, the last one
    included, and a model returning a dict (a Hugging Face ``ModelOutput`` traces as one) is common; the loss
    gets the dict back from :class:`DictOutputLoss`. Tensor and tuple outputs are left as they are.
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


class DictOutputLoss:
    """``loss_fn(dict_output, targets)`` on the last stage of a model that returns a dict (a plain ``dict``)."""

    def __init__(self, loss_fn: Callable, output: DictOutput) -> None:
        self.loss_fn = loss_fn
        self.output = output

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        values = outputs if isinstance(outputs, tuple) else (outputs,)  # shape inference unpacks a 1-tuple
        return self.loss_fn({**self.output.constants, **dict(zip(self.output.keys, values))}, targets)
