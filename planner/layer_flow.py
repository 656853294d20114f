"""Which modules are the planning units, and in what order and along which edges data flows between them: steps 1
and 2 of capture (``tessera.planner.capture``'s module docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tessera.errors import CaptureError
from tessera.planner import layer_info
from tessera.planner.front_ends import LeafModules, trace_model
from tessera.planner.measure import LOSS, ExampleInputs, example_inputs_at
from tessera.planner.replay import CONTAINERS

_METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "layout", "requires_grad")


# ----------------------------------------------------------------------------------------------- layers


def find_layers(root: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """Planning units of ``root``: FQN -> module, in registration order (``tessera.planner.capture``'s module
    docstring)."""
    found: dict[str, nn.Module] = {}
    for name, child in root.named_children():
        fqn = prefix + name
        if isinstance(child, CONTAINERS):
            found.update({f"{fqn}.{n}": m for n, m in child.named_children()})
        elif _is_wrapper(child):
            found.update(find_layers(child, fqn + "."))
        else:
            found[fqn] = child
    return found


def _is_wrapper(module: nn.Module) -> bool:
    has_container = any(isinstance(m, CONTAINERS) for m in module.modules())
    return has_container and not any(True for _ in module.parameters(recurse=False))


# ----------------------------------------------------------------------------------------------- tracing


@dataclass(frozen=True)
class LayerFlow:
    """What a front end tells about the layers: execution order, data flow, and the logits layer."""

    front_end: str
    order: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]
    head: str | None
    fallback_reasons: tuple[str, ...] = ()


def revisited(flow: LayerFlow) -> tuple[str, str] | None:
    """``(layer, later)`` where ``layer`` reads what a layer after its first call computes: it runs again later (one
    block object applied at both ends of the model), which no pipeline stage can hold. None otherwise."""
    position = {fqn: i for i, fqn in enumerate(flow.order)}
    return next(((dst, src) for src, dst in flow.edges
                 if src in position and dst in position and position[src] > position[dst]), None)


def trace_layers(
    model: nn.Module,
    layers: dict[str, nn.Module],
    *,
    seq_len: int = 8,
    example_inputs: ExampleInputs | None = None,
    front_ends: Sequence[str] | None = None,
    leaf_modules: LeafModules = (),
) -> LayerFlow:
    """Layer order and edges from the first front end that traces ``model``; CaptureError if none does."""
    return traced_flow_and_pairs(model, layers, example_inputs, seq_len, front_ends, leaf_modules)[0]


def traced_flow_and_pairs(
    model: nn.Module,
    layers: dict[str, nn.Module],
    example_inputs: ExampleInputs | None,
    seq_len: int,
    front_ends: Sequence[str] | None,
    leaf_modules: LeafModules,
) -> tuple[LayerFlow, dict[str, tuple]]:
    """The layer flow and the tensor-parallel pairs per layer (``layer_info.tp_pairs``)."""
    args, kwargs = example_inputs_at(example_inputs, seq_len)
    traced = trace_model(model, args, kwargs, front_ends=front_ends, leaf_modules=leaf_modules)
    flow = _layer_flow(traced.front_end, traced.graph, layers, traced.fallback_reasons)
    if not flow.order:
        raise CaptureError(
            f"{type(model).__name__} calls no child module in forward, so there is nothing to plan per layer; "
            "wrap its computation in submodules (embedding, blocks, head)"
        )
    try:
        pairs = layer_info.tp_pairs(traced.graph, model, layers, replicas=traced.replicas, outputs=traced.outputs)
    except layer_info.NotReplicable:  # a repeated element's pairs depend on its surroundings: trace every call
        traced = trace_model(model, args, kwargs, front_ends=front_ends, leaf_modules=leaf_modules, replicate=False)
        flow = _layer_flow(traced.front_end, traced.graph, layers, traced.fallback_reasons)
        pairs = layer_info.tp_pairs(traced.graph, model, layers)
    return flow, pairs


def _reads_metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("size", "dim", "numel", "get_device")
    if node.op == "call_function" and "sym_size" in str(node.target):
        return True
    return node.op == "call_function" and node.target is getattr and node.args[1] in _METADATA_ATTRS


def _layer_flow(
    front_end: str, graph: torch.fx.Graph, layers: dict[str, nn.Module], reasons: tuple[str, ...]
) -> LayerFlow:
    order: dict[str, None] = {}
    edges: dict[tuple[str, str], None] = {}
    producers: dict[torch.fx.Node, frozenset[str]] = {}  # layers whose outputs reach this node
    head_sources: frozenset[str] = frozenset()
    for node in graph.nodes:
        incoming = frozenset().union(*(producers.get(n, frozenset()) for n in node.all_input_nodes))
        owner = layer_info.enclosing(layer_info.node_path(node), layers)
        if node.op == "output":
            head_sources = incoming
            edges.update(((src, LOSS), None) for src in sorted(incoming))
        elif owner is None:
            # Glue passes its producers through, except reads of metadata (x.dtype, x.size(1)): no data flows.
            producers[node] = frozenset() if _reads_metadata(node) else incoming
        else:
            order.setdefault(owner)
            edges.update(((src, owner), None) for src in sorted(incoming) if src != owner)
            producers[node] = frozenset({owner})
    heads = [fqn for fqn in order if fqn in head_sources and layer_info.has_linear(layers[fqn])]
    return LayerFlow(front_end, tuple(order), tuple(edges), heads[-1] if heads else None, reasons)
