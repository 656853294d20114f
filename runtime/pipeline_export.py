"""The root forward of a model ``torch.fx`` cannot trace, as a graph whose planned layers are module calls.

``torch.fx`` stops at most Hugging Face and torchtitan forwards ("code: co_varnames is too small", Python
control flow on shapes); ``torch.export`` (non-strict) runs the Python forward on fake tensors, so shape-
dependent Python works. The forward is exported once, at the plan's micro-batch shape ``(micro_batch,
seq_len)`` (static per plan: every micro-batch a schedule feeds has it), with ``preserve_module_call_signature``
set to the planned layers: export then records, for each layer, which graph values it was called with and
returned, and the pytree structure of its arguments (``hidden_states``, ``attention_mask=...``,
``position_embeddings=(cos, sin)``, ``use_cache=False``...).

:func:`swap_in_layer` replaces each layer's inlined ATen ops by one ``call_module`` node on the layer's FQN,
called with those arguments rebuilt from that structure, and its outputs by ``getitem``/``getattr`` nodes on
the call. A pipeline chunk therefore calls the user's own eager module: activation recomputation, tensor
parallelism and FSDP act on it, and parameter FQNs stay the user's. What remains between the calls is the
root's glue as ATen ops: Hugging Face's causal-mask construction, rotary tables, position ids, the slice
before the head; ``runtime.pipeline`` assigns it to chunks as it does an fx graph's.

Also:

- ``use_cache=False`` is passed when the forward takes ``use_cache`` (training keeps no key/value cache, and
  a ``DynamicCache`` output cannot be exported); other optional arguments keep their defaults.
- The exported module's input guard (``_guards_fn``) is dropped; the first chunk checks the input shape
  instead (:func:`check_input_shapes`), since the graph holds the traced shape as constants.
- The model's output structure (a ``CausalLMOutputWithPast``...) is kept as the export's output spec: the
  last chunk returns the output's tensors as a tuple and the loss receives the rebuilt structure
  (``pipeline.TreeOutput``).
- A value computed inside a layer and read outside it (Hugging Face's router logits, recorded by hooks with
  ``output_router_logits=True``) is returned by the layer's call after its output when it is a submodule's output
  (``runtime.pipeline_records``); the export then runs a second time, with those submodules' signatures kept.
- A layer called more than once, or whose arguments are not tuples, lists, dicts and constants, or whose
  inner values other than submodule outputs are read outside it, is refused by name (``NotModelledError``).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.tools_common import legalize_graph
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, TreeSpec, tree_flatten_with_path, tree_unflatten

from tessera.errors import ConfigError, NotModelledError
from tessera.runtime.pipeline_records import (
    clear_inner_outputs,
    escaping_nodes,
    inner_outputs,
    recorded_submodules,
    return_inner_outputs,
    runs_in,
)

EXPORT = "torch.export"


@dataclass(frozen=True)
class ExportedForward:
    """The exported root forward, planned layers swapped back in as ``call_module`` nodes."""

    graph: fx.Graph
    """Glue ATen ops and one ``call_module`` node per planned layer; returns the output's leaves as a tuple."""
    attributes: dict[str, Any]
    """Values of ``get_attr`` targets the model does not hold (tensors export lifted into constants)."""
    output_spec: TreeSpec
    """Structure of the model's output; the graph returns its leaves."""
    output_constants: dict[int, Any] = field(default_factory=dict)
    """Leaves of the output that are not graph values, by leaf index (the graph does not return them)."""
    input_shapes: tuple[tuple[int, ...], ...] = ()
    """Shapes of the inputs the forward was exported at (the first chunk checks them)."""


def export_forward(model: nn.Module, layer_fqns: Sequence[str], example: torch.Tensor) -> ExportedForward:
    """Export ``model(example)`` with each of ``layer_fqns`` one ``call_module`` node (module docstring); where a
    submodule's output escapes its layer, again with that submodule's signature kept (``runtime.pipeline_records``)."""
    clear_inner_outputs(model)  # a layer traced before returns its inner outputs too: trace the user's forward
    try:
        program = _export(model, layer_fqns, example)
    except NotModelledError as first:
        weighted = [fqn for fqn in layer_fqns if next(model.get_submodule(fqn).parameters(), None) is not None]
        if len(weighted) == len(layer_fqns):
            raise
        # Keeping a weightless layer's signature can fail where its call is fine (Gemma 3's rotary_emb, called with
        # a string): it is then traced as glue, which every chunk reading it recomputes.
        try:
            program, layer_fqns = _export(model, weighted, example), weighted
        except NotModelledError:
            raise first from None
    recorded = recorded_submodules(program.graph_module.graph, layer_fqns)
    if recorded:
        program = _export(model, [*layer_fqns, *recorded], example)
    module = program.module()
    _drop_input_guards(module.graph, keep_inputs=1)
    signatures = {entry.fqn: entry.signature for entry in program.module_call_graph}
    by_name = {node.name: node for node in module.graph.nodes}  # export's value names -> nodes, kept current
    for fqn in layer_fqns:
        _refuse_repeated_calls(fqn, signatures)
        if fqn in signatures:
            _keep_submodule(module, model, fqn)
            extras = swap_in_layer(module.graph, fqn, signatures, by_name)
            if extras:
                return_inner_outputs(model, fqn, extras)
    module.graph.eliminate_dead_code()
    legalize_graph(module)
    output_constants = _return_graph_values_only(module.graph)
    return ExportedForward(
        graph=module.graph, attributes=_lifted_attributes(model, module), output_spec=signatures[""].out_spec,
        output_constants=output_constants, input_shapes=(tuple(example.shape),),
    )


def _export(model: nn.Module, fqns: Sequence[str], example: torch.Tensor) -> torch.export.ExportedProgram:
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    try:
        return torch.export.export(model, (example,), kwargs, strict=False, preserve_module_call_signature=tuple(fqns))
    except Exception as error:  # export raises many types (UserError, TypeError, data-dependent guards...)
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise NotModelledError(f"torch.export cannot trace {type(model).__name__} at input shape "
                               f"{tuple(example.shape)}: {first[:300]}") from error


def _keep_submodule(exported: fx.GraphModule, model: nn.Module, fqn: str) -> None:
    """The exported module drops layers without parameters or buffers (GPT-2's ``transformer.drop``): put the
    user's module back at ``fqn`` so the layer's call node has a module to name."""
    try:
        exported.get_submodule(fqn)
    except AttributeError:
        exported.add_submodule(fqn, model.get_submodule(fqn))


def _drop_input_guards(graph: fx.Graph, *, keep_inputs: int) -> None:
    """Remove the exported module's input guard and the placeholders of keyword constants (``use_cache``)."""
    for node in list(graph.find_nodes(op="call_module", target="_guards_fn")):
        graph.erase_node(node)
    for node in graph.find_nodes(op="placeholder")[keep_inputs:]:
        if node.users:
            raise NotModelledError(f"the exported forward reads its keyword argument {node.name}; pipeline "
                                   "chunks feed the inputs only")
        graph.erase_node(node)


def _refuse_repeated_calls(fqn: str, signatures: dict) -> None:
    if any(name.startswith(f"{fqn}@") for name in signatures):
        raise NotModelledError(f"the model's forward calls {fqn} more than once; a pipeline stage runs each planned "
                               "layer once (re-plan with that module inside a larger layer, or pp=1)")


# ------------------------------------------------------------------------------------------------ one layer


def swap_in_layer(graph: fx.Graph, fqn: str, signatures: dict, by_name: dict[str, fx.Node]) -> list:
    """Replace the ops ``fqn`` ran by one call of the module ``fqn`` with the arguments export recorded; returns the
    submodule outputs read outside the layer, which the call then returns after the layer's own output
    (``pipeline_records.InnerOutput``; the caller makes the layer return them).

    ``signatures`` are export's module call signatures by FQN; ``by_name`` maps the names in them to nodes; the
    names of this layer's outputs are pointed at the nodes that now read them off the call.
    """
    signature = signatures[fqn]
    nodes = [node for node in graph.nodes if runs_in(node, fqn)]
    if not nodes:
        return []
    flat = [_argument(arg, by_name, fqn) for arg in signature.inputs]
    args, kwargs = tree_unflatten(flat, signature.in_spec)
    anchor = max((*nodes, *(value for value in flat if isinstance(value, fx.Node))), key=_position(graph))
    with graph.inserting_after(anchor):
        call = graph.call_module(fqn, tuple(args), dict(kwargs))
    missing = {value for value in flat if isinstance(value, fx.Node)} - set(call.all_input_nodes)
    if missing:
        raise NotModelledError(f"{fqn} takes its arguments in a structure a pipeline chunk cannot rebuild "
                               f"({signature.in_spec.type.__name__}); pipeline it as part of a larger layer")
    outputs = {index: by_name[arg.name] for index, arg in enumerate(signature.outputs) if not hasattr(arg, "value")}
    extras = inner_outputs(fqn, escaping_nodes(nodes, list(outputs.values())), signatures)
    returned = call
    if extras:  # the call returns (the layer's output, *extras)
        with graph.inserting_after(call):
            returned = graph.call_function(operator.getitem, (call, 0))
            for index, extra in enumerate(extras, start=1):
                extra.node.replace_all_uses_with(graph.call_function(operator.getitem, (call, index)))
    values = _output_values(graph, returned, signature.out_spec, len(signature.outputs))
    for index, node in outputs.items():
        node.replace_all_uses_with(values[index])
        by_name[signature.outputs[index].name] = values[index]
    for node in reversed(nodes):
        graph.erase_node(node)
    return extras


def _position(graph: fx.Graph):
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


def _argument(arg, by_name: dict[str, fx.Node], fqn: str) -> Any:
    if hasattr(arg, "value"):  # ConstantArgument: None, False, 1e-6...
        return arg.value
    if arg.name not in by_name:
        raise NotModelledError(f"torch.export dropped the value {arg.name} that {fqn} is called with; pipeline this "
                               "model with pp=1")
    return by_name[arg.name]


def _output_values(graph: fx.Graph, call: fx.Node, spec: TreeSpec, count: int) -> dict[int, fx.Node]:
    """Leaf index -> a node reading it: ``getitem``/``getattr`` on the module call along the leaf's path in ``spec``
    (inserted after the call in any order: :func:`export_forward` sorts the graph once all layers are in)."""
    template = tree_unflatten(list(range(count)), spec)
    leaves, _ = tree_flatten_with_path(template)
    values: dict[int, fx.Node] = {}
    with graph.inserting_after(call):
        for path, index in leaves:
            value = call
            for key in path:
                value = _step(graph, value, key)
            values[index] = value
    return values


def _step(graph: fx.Graph, value: fx.Node, key) -> fx.Node:
    if isinstance(key, SequenceKey):
        return graph.call_function(operator.getitem, (value, key.idx))
    if isinstance(key, MappingKey):
        return graph.call_function(operator.getitem, (value, key.key))
    if isinstance(key, GetAttrKey):
        return graph.call_function(getattr, (value, key.name))
    raise NotModelledError(f"a layer returns a structure with a {type(key).__name__} entry, which a pipeline "
                           "chunk cannot take apart; pipeline it as part of a larger layer")


# ------------------------------------------------------------------------------------------------ the rest


def _return_graph_values_only(graph: fx.Graph) -> dict[int, Any]:
    """The graph returns its output's graph values; the other leaves (constants) are returned by index."""
    output = graph.find_nodes(op="output")[0]
    leaves = output.args[0]
    output.args = (tuple(leaf for leaf in leaves if isinstance(leaf, fx.Node)),)
    return {index: leaf for index, leaf in enumerate(leaves) if not isinstance(leaf, fx.Node)}


def _lifted_attributes(model: nn.Module, module: fx.GraphModule) -> dict[str, Any]:
    """``get_attr`` targets of the graph that the model does not hold, with their values from the export."""
    found = {}
    for node in module.graph.find_nodes(op="get_attr"):
        if resolve(model, node.target) is None:
            found[node.target] = resolve(module, node.target)
    return found


def resolve(root: nn.Module, target: str) -> Any:
    """The attribute at dotted path ``target`` of ``root``, or ``None``."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def check_input_shapes(module: nn.Module, shapes: Sequence[tuple[int, ...]]) -> None:
    """Make the first chunk refuse inputs of other shapes than it was exported at (a forward pre-hook)."""

    def check(_module: nn.Module, args: tuple) -> None:
        got = tuple(tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor))
        if got != tuple(shapes):
            raise ConfigError(f"pipeline chunk 0 was traced with torch.export at input shape {shapes[0]} (the plan's "
                              f"micro-batch x seq_len) and is given {got[0] if got else 'no tensor'}; pass batches "
                              "of the planned seq_len")

    module.register_forward_pre_hook(check)
