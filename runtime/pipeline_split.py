"""Cut the root forward into pipeline chunks at the plan's layer boundaries.

**Tracing** (:func:`trace_forward`). The root module's forward becomes a graph in which every planned layer
is one ``call_module`` node on its FQN (``blocks.3``; what happens inside it is not traced). ``torch.fx``
is tried first (:func:`trace_layers`: no inputs needed); where it cannot trace (most Hugging Face and
torchtitan models), ``torch.export`` at the plan's micro-batch shape, with the planned layers swapped back in
as module calls (``runtime.pipeline_export``). Optional arguments with constant defaults (``mask=None``,
``scale=1.0``) are traced at their defaults, as a step calls the model with its inputs only.

**Assignment** (:func:`node_chunks`). Each node of the root's glue code (``tok_emb(ids) + pos_emb(arange(T))``,
RoPE table slicing...) goes to the earliest chunk where all its inputs exist; a parameter read (``get_attr``)
goes to the chunk of its first user. Chunk ``c`` then becomes a ``GraphModule`` whose inputs are the values
chunk ``c - 1`` hands over (chunk 0: the root's arguments, default values kept) and whose outputs are the
values later chunks still need: Tessera's Llama's RoPE ``cos``/``sin``, sliced from root buffers by the
input's length, travel along the pipeline with the hidden states. Glue that depends on no input, no layer and
no trainable parameter (:func:`recomputed_nodes`: a buffer, and, in an export trace at a static shape,
Hugging Face's causal mask, rotary tables and position ids) is instead computed by every chunk that reads it,
so it never crosses a stage boundary. Values crossing a boundary must be tensors (:func:`check_split` names
one that is not, before anything is sharded).

**Modules** (:func:`build_chunk_module`). The chunk module holds the very same layer modules (not copies)
under their original FQNs: ``stage.get_submodule("blocks.3")`` is ``model.blocks[3]`` and
``stage.named_parameters()`` yields ``blocks.3.attn.q.weight``, so checkpoints and optimizer state keep the
user's names. Buffers a chunk reads are shared likewise, persistent or not as in the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from tessera.errors import ConfigError, NotModelledError
from tessera.runtime.pipeline_export import EXPORT, ExportedForward, export_forward, resolve
from tessera.runtime.pipeline_records import chunk_calls_return_inner_outputs

FX = "torch.fx"


@dataclass(frozen=True)
class TracedForward:
    """The root forward as a graph whose planned layers are ``call_module`` nodes, and how it was traced."""

    graph: fx.Graph
    front_end: str
    """``torch.fx`` or ``torch.export``."""
    exported: ExportedForward | None = None
    """What the export trace adds: lifted constants, the output structure, the traced input shape."""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    """Values of ``get_attr`` targets the model does not hold."""


def trace_forward(model: nn.Module, layer_fqns: Sequence[str], *, example: torch.Tensor) -> TracedForward:
    """``torch.fx`` first; where it fails, ``torch.export`` at ``example`` (a micro-batch of inputs)."""
    try:
        return TracedForward(trace_layers(model, layer_fqns), FX)
    except NotModelledError as fx_error:
        try:
            exported = export_forward(model, layer_fqns, example)
        except NotModelledError as export_error:
            raise NotModelledError(
                f"pipeline parallelism cuts stages from a trace of the root forward: torch.fx cannot trace "
                f"{type(model).__name__} ({fx_error.__cause__}) and {export_error}{_example_note(example)}; plan it "
                "with pp=1"
            ) from export_error
    return TracedForward(exported.graph, EXPORT, exported, exported.attributes)


def _example_note(example: torch.Tensor) -> str:
    """Why the example may be the cause: a plan carries no input spec, so the export runs at token ids."""
    if example.dtype != torch.long:
        return ""
    return (" (the export runs at a micro-batch of token ids: a model whose input is not token ids, e.g. one driven "
            "with inputs_embeds or pixel values, cannot be pipelined yet)")


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


# ------------------------------------------------------------------------------------------------ assignment


def node_chunks(graph: fx.Graph, chunk_of_layer: dict[str, int]) -> dict[fx.Node, int]:
    """Chunk of every node: a layer's from the plan, glue code's from its inputs, reads from their users."""
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


def recomputed_nodes(graph: fx.Graph, model: nn.Module, attributes: Mapping[str, Any] = {}) -> set[fx.Node]:
    """Glue every chunk reading it computes itself: reads of buffers and constants, and ATen ops without
    randomness or mutation whose inputs are all such nodes (no input, layer output or trainable parameter)."""
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            value = attributes[node.target] if node.target in attributes else resolve(model, node.target)
            if isinstance(value, torch.Tensor) and not value.requires_grad:
                free.add(node)
        elif node.op == "call_function" and _is_pure(node.target) and all(n in free for n in node.all_input_nodes):
            free.add(node)
    return free


def _is_pure(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def check_split(model: nn.Module, traced: TracedForward, chunk_of_layer: dict[str, int]) -> dict[fx.Node, int]:
    """The chunk of every node (:func:`node_chunks`), after checking that only tensors cross a boundary, where the
    trace knows the values (export). Run on every rank before anything is sharded: every boundary is checked,
    not only this rank's."""
    graph = traced.graph
    chunks = node_chunks(graph, chunk_of_layer)
    free = recomputed_nodes(graph, model, traced.attributes)
    for chunk in range(max(chunk_of_layer.values())):
        for node in _handover(graph, chunks, chunk, free):
            value = node.meta.get("val")
            if value is not None and not isinstance(value, torch.Tensor):
                reader = min(chunks[user] for user in node.users)
                raise NotModelledError(
                    f"pipeline chunk {reader} reads {node.name}, a {type(value).__name__} computed in chunk "
                    f"{chunk}; only tensors cross pipeline stages: move the split (re-plan) or plan with pp=1"
                )
    return chunks


# ------------------------------------------------------------------------------------------------ modules


def build_chunk_module(
    model: nn.Module, graph: fx.Graph, chunks: dict[fx.Node, int], chunk: int, *,
    attributes: Mapping[str, Any] = {},
) -> fx.GraphModule:
    """A module computing chunk ``chunk`` alone: inputs are what chunk ``chunk - 1`` hands over.

    ``attributes`` holds ``get_attr`` values the model does not hold (an export's lifted constants).
    """
    free = recomputed_nodes(graph, model, attributes)
    inputs = _handover(graph, chunks, chunk - 1, free) if chunk > 0 else graph.find_nodes(op="placeholder")
    final = graph.find_nodes(op="output")[0]
    own = [n for n in graph.nodes if chunks[n] == chunk and n not in free and n.op not in ("placeholder", "output")]
    reads = _free_inputs([*own, final] if chunks[final] == chunk else own, free)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:  # the first chunk's placeholders are the root's, default values kept (``node_copy``)
        env[node] = new.node_copy(node) if chunk == 0 else new.placeholder(node.name)
    for node in graph.nodes:
        if node in reads or node in own:
            env[node] = new.node_copy(node, env.__getitem__)
    if chunks[final] == chunk:
        new.output(fx.map_arg(final.args[0], env.__getitem__))
    else:
        new.output(tuple(env[node] for node in _handover(graph, chunks, chunk, free)))
    module = _graph_module(model, new, attributes, name=f"PipelineChunk{chunk}")
    chunk_calls_return_inner_outputs(module)  # its layers hand on what the root reads from inside them
    return module


def _handover(graph: fx.Graph, chunks: dict[fx.Node, int], chunk: int, free: set[fx.Node]) -> list[fx.Node]:
    """Values computed in chunks ``<= chunk`` that a later chunk reads, in graph order (recomputed ones aside)."""
    return [
        node
        for node in graph.nodes
        if node.op != "output" and node not in free and chunks[node] <= chunk
        and any(chunks[user] > chunk for user in node.users)
    ]


def _free_inputs(nodes: Sequence[fx.Node], free: set[fx.Node]) -> set[fx.Node]:
    """The recomputed nodes ``nodes`` read, directly or through other recomputed nodes."""
    found: set[fx.Node] = set()
    stack = [n for node in nodes for n in node.all_input_nodes if n in free]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(n for n in node.all_input_nodes if n in free)
    return found


def _graph_module(model: nn.Module, graph: fx.Graph, attributes: Mapping[str, Any], *, name: str) -> fx.GraphModule:
    """``GraphModule`` over the model's own modules and tensors (and ``attributes``); a buffer it reads stays
    persistent or not as in the model (``GraphModule`` registers every one as persistent); an export's
    lifted constant is not persistent."""
    targets = {node.target for node in graph.nodes if node.op in ("get_attr", "call_module")}
    root = {target: attributes[target] if target in attributes else resolve(model, target) for target in targets}
    buffers = {target: _is_persistent(model, target) for target, value in root.items()
               if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)}
    module = fx.GraphModule(root, graph, class_name=name)
    for target, persistent in buffers.items():
        owner, _, leaf = target.rpartition(".")
        module.get_submodule(owner).register_buffer(leaf, root[target], persistent=persistent)
    _order_like(module, model)
    module.training = model.training
    return module


def _order_like(module: nn.Module, original: nn.Module | None) -> None:
    """Children of the chunk's container modules in the model's order (``GraphModule`` adds them by path
    depth), so a chunk lists its parameters in the order the model does."""
    if not isinstance(original, nn.Module) or module is original:
        return
    order = {name: index for index, name in enumerate(original._modules)}
    module._modules = dict(sorted(module._modules.items(), key=lambda item: order.get(item[0], len(order))))
    for name, child in module._modules.items():
        _order_like(child, original._modules.get(name))


def _is_persistent(model: nn.Module, target: str) -> bool:
    owner_name, _, leaf = target.rpartition(".")
    owner = resolve(model, owner_name) if owner_name else model
    return isinstance(owner, nn.Module) and leaf in owner._buffers and leaf not in owner._non_persistent_buffers_set
