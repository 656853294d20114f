"""Where FlopCounterMode's module tracker scopes each layer's backward, made right for models Tessera did not write.

The tracker (``torch.utils.module_tracker``) enters a module's backward when its outputs' gradients arrive and leaves
it when its positional inputs' gradients are computed. Capture (``planner.measure``) charges every backward op to
the modules open at the time, so a scope that opens late or never closes moves FLOPs between layers (negative ones
in the end). :func:`outputs_apart_from_inputs` keeps a module's inputs and outputs distinct tensors, so the two hooks
fire in order; :func:`leave_in_backward` closes the scopes the tracker cannot: layers whose inputs need no gradient,
and modules whose inputs came as keywords.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode


@contextmanager
def outputs_apart_from_inputs() -> Iterator[None]:
    """A module's tensor arguments needing a gradient reach it as views (keyword ones: :func:`leave_in_backward`),
    and one returning an input itself (``Dropout(p=0)``, ``Identity``) hands it back as a view: the FLOP counter scopes a module's backward from its output's gradient
    to its input's, and where one tensor is both (a module returning its input; a block applied twice in a row,
    ``block(block(x))``) the two hooks can fire in the wrong order, leaving the module's scope open for the rest of
    the backward (a BERT classifier's dropout was charged the whole encoder's backward; the repeated block's first
    call was charged to the layer before it). Entered before the counter, whose hooks then see the views."""

    def inputs_apart(module: nn.Module, args: tuple) -> tuple | None:
        # Top-level tensors only: a list or dict argument is handed on as it is (a module appending to it, U-Net's
        # skip features, must append to the caller's).
        if not any(_needs_grad(arg) for arg in args):
            return None
        return tuple(_apart(arg) for arg in args)

    def apart(module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        inputs = {id(leaf) for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
        if not any(id(leaf) in inputs for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)):
            return None
        return tree_map(lambda x: x.view_as(x) if isinstance(x, torch.Tensor) and id(x) in inputs else x, output)

    handles = (nn.modules.module.register_module_forward_pre_hook(inputs_apart),
               nn.modules.module.register_module_forward_hook(apart, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def leave_in_backward(model: nn.Module, order: tuple[str, ...], counter: FlopCounterMode) -> Iterator[None]:
    """End a layer's backward in FlopCounterMode's module tracker once the call's own backward nodes have run, for a
    layer whose inputs need no gradient (a token embedding). The tracker leaves a module when its inputs' gradients
    are computed, so such a layer is never left: every backward op after it -- a vision tower whose output was
    merged with the token embeddings; T5's encoder, after the decoder's call of the shared embedding -- would be
    counted to it as well. The tracker watches positional inputs only, so a
    module whose inputs needing a gradient all came as keywords (``block(x=hidden)``) is left once they have theirs."""
    handles = []
    starts: dict[int, list[int]] = {}  # module -> the autograd sequence number at each open call's start

    def leave(module: nn.Module) -> Callable[..., None]:
        # The tracker's own name (a private field of torch's ModuleTracker): for a module registered at several
        # paths (T5's shared embedding) it keeps the last path it walked, not named_modules()' first.
        name = counter.mod_tracker._known_modules.get(module)
        return lambda *_: name is not None and counter.mod_tracker.parents.discard(name)

    def leave_after(nodes: list, module: nn.Module) -> None:
        waiting, done_leaving = [len(nodes)], leave(module)

        def done(_grad_inputs: object, _grad_outputs: object) -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                done_leaving()

        handles.extend(node.register_hook(done) for node in nodes)

    def pre(module: nn.Module, _args: tuple) -> None:
        starts.setdefault(id(module), []).append(torch._C._autograd._get_sequence_nr())

    def post(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        since = starts[id(module)].pop()
        if not any(_needs_grad(t) for t in tree_leaves((args, kwargs))):
            leave_after(_first_backward_nodes(output, since), module)

    def keyword_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not any(_needs_grad(t) for t in tree_leaves(kwargs)):
            return None
        kwargs = {key: _apart(value) for key, value in kwargs.items()}  # apart from a caller's output, as positional
        if not any(_needs_grad(t) for t in tree_leaves(args)):
            keyword = [t for t in tree_leaves(kwargs) if _needs_grad(t)]
            handles.append(register_multi_grad_hook(keyword, leave(module)))
        return args, kwargs

    handles.extend(model.get_submodule(fqn).register_forward_pre_hook(pre) for fqn in order)
    handles.extend(model.get_submodule(fqn).register_forward_hook(post, with_kwargs=True) for fqn in order)
    handles.extend(module.register_forward_pre_hook(keyword_inputs, with_kwargs=True) for module in model.modules())
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _first_backward_nodes(output: object, since: int) -> list:
    """The autograd nodes a call whose inputs need no gradient ends its backward with: of the nodes it created
    (sequence number ``since`` on), those leading on to no other of them (a token embedding's own node; a vision
    tower's first convolution). A tensor it read from elsewhere (an encoder's output set as an attribute) leads
    out of the call: its nodes are the caller's."""

    def own(node: object) -> bool:
        return node is not None and type(node).__name__ != "AccumulateGrad" and node._sequence_nr() >= since

    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and own(t.grad_fn)]
    seen, first = set(), []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        inner = [n for n, _ in node.next_functions if own(n)]
        if not inner:
            first.append(node)
        stack.extend(inner)
    return first


def _needs_grad(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _apart(value: object) -> object:
    """``value`` as a view of itself when it is a tensor needing a gradient (a node of its own), else as it is."""
    return value.view_as(value) if _needs_grad(value) else value
