"""Values a planned layer computes inside one of its submodules and the root forward reads: the layer returns them.

Hugging Face models record some submodules' outputs with forward hooks while their root forward runs
(``output_router_logits=True``: each MoE router's logits, which the root turns into the load-balancing ``aux_loss``
and returns as ``router_logits``). In an export trace such a value is computed inside a planned layer and read
outside it, so that layer would not be one pipeline call. :func:`recorded_submodules` names the submodules whose
outputs escape their layer (the export is then repeated with their call signatures kept);
:func:`inner_outputs` says which output of which submodule each escaping value is; :func:`return_inner_outputs`
makes the layer return those values after its own output, by a forward hook on each submodule (it keeps the value)
and one on the layer (it appends them), so a chunk hands them on to the chunk that reads them like any other value,
and their gradient (the aux loss's) flows back into the layer (through its output, where FSDP2's and recomputation's
hooks see it). A value the layer's own forward computes, not a submodule's output, cannot be returned this way and
is refused by name.

The layer appends them only while a pipeline chunk runs (:func:`chunk_calls_return_inner_outputs`): called
directly, the user's model returns what it always did. The hooks stay on the user's modules;
:func:`clear_inner_outputs` removes them before a model is traced again.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from tessera.errors import NotModelledError, RuntimeSetupError

_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = weakref.WeakKeyDictionary()
"""Root model -> the hooks :func:`return_inner_outputs` put on its modules."""
_IN_CHUNK: ContextVar[bool] = ContextVar("tessera_pipeline_chunk_running", default=False)


@dataclass(frozen=True)
class InnerOutput:
    """One value a layer returns after its own output: leaf ``leaf`` of submodule ``submodule``'s output."""

    submodule: str
    """FQN relative to the layer (``mlp.gate``)."""
    leaf: int
    """Index in the submodule output's flattened leaves."""
    node: fx.Node
    """The graph value (read outside the layer) it stands for."""


def escaping_nodes(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> list[fx.Node]:
    """Nodes of a layer's region, other than its outputs, that a node outside the region reads."""
    inside = set(nodes)
    return [node for node in nodes if node not in outputs and any(user not in inside for user in node.users)]


def innermost_module(node: fx.Node) -> str:
    """FQN of the innermost module whose call computed ``node`` (export's ``nn_module_stack``), ``""`` for the root."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed([path for path, _ in stack.values()]), "")


def recorded_submodules(graph: fx.Graph, layer_fqns: Sequence[str]) -> list[str]:
    """FQNs of submodules of planned layers that compute a value read outside their layer (in an export graph,
    before the layers are swapped in)."""
    found: dict[str, None] = {}
    for fqn in layer_fqns:
        nodes = [node for node in graph.nodes if runs_in(node, fqn)]
        for node in escaping_nodes(nodes, []):
            inner = innermost_module(node)
            if inner.startswith(f"{fqn}."):
                found[inner] = None
    return list(found)


def inner_outputs(fqn: str, escaping: Sequence[fx.Node], signatures: Mapping[str, object]) -> list[InnerOutput]:
    """Which submodule output each of ``escaping`` (values of layer ``fqn`` read outside it) is; refuses one that is
    no submodule's output."""
    found = []
    for node in escaping:
        inner = innermost_module(node)
        signature = signatures.get(inner) if inner.startswith(f"{fqn}.") else None
        names = [getattr(arg, "name", None) for arg in signature.outputs] if signature is not None else []
        if node.name not in names:
            raise NotModelledError(f"a value computed inside {fqn} ({node.name}) is read outside it, not as one of "
                                   "its outputs or a submodule's; the layer cannot be one pipeline call (plan a "
                                   "larger layer, or pp=1)")
        found.append(InnerOutput(inner.removeprefix(f"{fqn}."), names.index(node.name), node))
    return found


def return_inner_outputs(model: nn.Module, fqn: str, extras: Sequence[InnerOutput]) -> None:
    """Make layer ``fqn`` of ``model`` return ``(its output, *extras' values)`` (module docstring)."""
    layer = model.get_submodule(fqn)
    kept: dict[int, object] = {}
    handles = _HOOKS.setdefault(model, [])
    for index, extra in enumerate(extras):
        def keep(_module, _args, output, index=index, leaf=extra.leaf) -> None:
            kept[index] = tree_flatten(output)[0][leaf]

        handles.append(layer.get_submodule(extra.submodule).register_forward_hook(keep))

    def append(_module, _args, output) -> tuple | None:
        if not _IN_CHUNK.get():  # the user's own call (or a recomputation): the output as it always was
            kept.clear()
            return None
        if len(kept) != len(extras):
            missing = [extra.submodule for index, extra in enumerate(extras) if index not in kept]
            raise RuntimeSetupError(f"pipeline layer {fqn} returns the outputs of {', '.join(missing)}, but they did "
                                    "not run (replaced after tracing?); trace the model after changing its modules")
        values = [kept.pop(index) for index in range(len(extras))]
        return (output, *values)

    handles.append(layer.register_forward_hook(append))


def chunk_calls_return_inner_outputs(chunk: nn.Module) -> None:
    """While ``chunk`` runs, layers with inner outputs return them (``always_call``: reset even if it raises)."""
    tokens = []
    chunk.register_forward_pre_hook(lambda _module, _args: tokens.append(_IN_CHUNK.set(True)))
    chunk.register_forward_hook(lambda _module, _args, _output: _IN_CHUNK.reset(tokens.pop()), always_call=True)


def clear_inner_outputs(model: nn.Module) -> None:
    """Remove the hooks :func:`return_inner_outputs` put on ``model``'s modules (before it is traced again)."""
    for handle in _HOOKS.pop(model, []):
        handle.remove()


def runs_in(node: fx.Node, fqn: str) -> bool:
    """Whether ``node`` was computed during a call of module ``fqn`` (export's ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(path == fqn for path, _ in stack.values())
