"""Front ends: turn a model into an fx Graph whose nodes name the module that ran them, without real memory.

Tried in order; the first that traces wins, and every one that fell back leaves a one-line reason in
``LayerGraph.fallback_reasons``:

1. ``torch.fx.symbolic_trace``: no inputs needed and the fastest (a 96-layer GPT in ~0.4 s). It stops at Python
   control flow on traced values (``if x.sum() > 0``), and Hugging Face models do not trace with it.
2. ``torch.export`` (``strict=False``) on meta example inputs: runs the Python forward with fake tensors, so
   shape-dependent Python works; data-dependent control flow does not. Hugging Face models need
   ``use_cache=False`` in their config (a ``DynamicCache`` output does not export).
3. ``make_fx`` under ``FakeTensorMode``: an aten-level trace with the module stack recorded.

Every front end sees only meta or fake tensors: a model with real weights is traced through a meta twin (a deep
copy whose parameters and buffers are meta tensors, so no weight is copied). Nodes carry
``meta["nn_module_stack"]`` (innermost module last); fx ``call_module`` / ``get_attr`` nodes name their module in
``target``. ``leaf_modules`` (classes or FQNs) apply to ``torch.fx`` only: a leaf is recorded as one call, so its
forward may hold Python the tracer cannot follow.

Repeated container elements (``torch.fx`` only): tracing inlines every module call, so a model of 61 blocks of
256 experts each costs 15,000+ traced sub-forwards. As ``tessera.planner.replay`` does for measurement, an element
of a ``ModuleList`` / ``ModuleDict`` / ``Sequential`` is traced only until the last two traced elements of its
group (same container, class and parameter/buffer shapes) produced the same graph (ops, targets relative to the
element, data flow) from the same kind of arguments; later elements called with that kind of arguments are
recorded as one ``call_module`` node, and ``Traced.replicas`` maps each to the traced element it repeats
(``Traced.outputs`` holds that element's output nodes). Graph analyses expand a replica from its representative
(``tessera.planner.layer_info.tp_pairs``); ``trace_model(..., replicate=False)`` traces every call.
"""

from __future__ import annotations

import copy
import os
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tessera.errors import CaptureError
from tessera.planner.replay import CONTAINERS
from tessera.planner.replay import _shape_key as shape_key

FX, EXPORT, MAKE_FX = "torch.fx.symbolic_trace", "torch.export", "make_fx"
FRONT_ENDS: tuple[str, ...] = (FX, EXPORT, MAKE_FX)
"""Front ends in the order they are tried."""
ALIASES = {"fx": FX, "symbolic_trace": FX, "export": EXPORT, "torch.export": EXPORT, "make_fx": MAKE_FX, FX: FX}
"""Names a user may pass in ``front_ends``."""
LeafModules = Sequence[type[nn.Module] | str]
NEXT_STEPS = (
    "Next step: make that code traceable (replace Python control flow on tensor values, e.g. `if x.sum() > 0:`, "
    "with torch.where), or mark the module as a leaf (capture(..., leaf_modules=(ThatModule,)); torch.fx only), "
    "or pass example_inputs=... if the model does not take (1, seq_len) token ids, or choose front ends with "
    "front_ends=('fx', 'export', 'make_fx')."
)


@dataclass(frozen=True)
class Traced:
    """The graph a front end produced, which front end it was, and why earlier ones fell back."""

    front_end: str
    graph: torch.fx.Graph
    fallback_reasons: tuple[str, ...]
    replicas: Mapping[str, str] = field(default_factory=dict)
    """FQN of an element recorded as one ``call_module`` node -> the traced element it repeats."""
    outputs: Mapping[str, tuple[torch.fx.Node, ...]] = field(default_factory=dict)
    """A repeated (traced) element -> the graph nodes of its outputs."""


def trace_model(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    front_ends: Sequence[str] | None = None,
    leaf_modules: LeafModules = (),
    replicate: bool = True,
) -> Traced:
    """Graph from the first front end that traces ``model`` on meta ``args`` / ``kwargs``; CaptureError if none.

    ``replicate``: record repeated container elements as one node each (torch.fx; see the module docstring).
    """
    reasons: list[str] = []
    twin: nn.Module | None = None  # made once, only if a front end that runs the forward is reached
    for name in resolve_front_ends(front_ends):
        if name != FX and twin is None:
            twin = meta_twin(model)
        try:
            if name == FX:
                tracer = _Tracer(leaf_modules, replicate=replicate)
                graph = tracer.trace(model)
                return Traced(name, graph, tuple(reasons), dict(tracer.repeats.replicas), dict(tracer.repeats.outputs))
            graph = _TRACERS[name](twin, args, kwargs, leaf_modules)
        except Exception as exc:  # any tracer failure: record it, try the next front end
            reasons.append(describe_failure(name, model, exc))
            continue
        return Traced(name, graph, tuple(reasons))
    raise CaptureError("; ".join(reasons) + ". " + _next_steps(reasons))


MASK_FREE_ATTENTION = (
    "Next step: this attention needs a mask object the training loop builds (torchtitan's flex and varlen backends "
    "take a BlockMask from model.get_attention_masks(...) as attention_masks=); plan the model with its SDPA backend "
    "(torchtitan: set each layer's attention.inner_attention = ScaledDotProductAttention.Config(); the FLOPs are the "
    "same causal attention), or pass example_inputs= a dict holding the mask."
)


def _next_steps(reasons: Sequence[str]) -> str:
    """What to do about the front ends' failures: the general advice, or, where an attention asked for a mask
    object it was not given, how to plan it."""
    return MASK_FREE_ATTENTION if any("BlockMask" in reason for reason in reasons) else NEXT_STEPS


def resolve_front_ends(front_ends: Sequence[str] | None) -> tuple[str, ...]:
    """Canonical front-end names; CaptureError naming the valid ones for an unknown name."""
    if front_ends is None:
        return FRONT_ENDS
    unknown = [name for name in front_ends if name not in ALIASES]
    if unknown or not front_ends:
        raise CaptureError(f"unknown front end(s) {unknown}; choose from {sorted(set(ALIASES))}")
    return tuple(dict.fromkeys(ALIASES[name] for name in front_ends))


_AUTOCAST_SHIM_LOCK = threading.Lock()
_autocast_shim_users = 0  # captures inside meta_autocast_off now, over every thread
_original_autocast_init = torch.autocast.__init__
_original_autocast_enter = torch.autocast.__enter__
_original_autocast_exit = torch.autocast.__exit__


def _autocast_init_meta_off(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                            cache_enabled: bool | None = None) -> None:  # torch.autocast.__init__'s parameters
    self._tessera_meta_off = device_type == "meta"
    if self._tessera_meta_off:
        return _original_autocast_init(self, "cpu", dtype, False, cache_enabled)
    return _original_autocast_init(self, device_type, dtype, enabled, cache_enabled)


def _autocast_enter_meta_off(self):  # a region switched off on meta is entered as nothing: torch.export would record
    if getattr(self, "_tessera_meta_off", False):  # it as a higher-order op per call (77 s for 48 MoE routers)
        return self
    return _original_autocast_enter(self)


def _autocast_exit_meta_off(self, *exc):
    if getattr(self, "_tessera_meta_off", False):
        return False
    return _original_autocast_exit(self, *exc)


_SHIM = {"__init__": (_autocast_init_meta_off, _original_autocast_init),
         "__enter__": (_autocast_enter_meta_off, _original_autocast_enter),
         "__exit__": (_autocast_exit_meta_off, _original_autocast_exit)}


@contextmanager
def meta_autocast_off() -> Iterator[None]:
    """``torch.autocast(device_type=x.device.type, ...)`` inside a forward (torchtitan's MoE router computes its gate
    so, in fp32) raises on a meta tensor: meta has no autocast. While capturing, such a region runs with autocast
    off (a meta gate then stays in the planning dtype: its bytes are a router's, a rounding error of a block).
    The patch is process-wide, so it is counted: captures overlapping in threads (or nested) install it once and
    the last to leave restores torch's own."""
    global _autocast_shim_users
    with _AUTOCAST_SHIM_LOCK:
        if _autocast_shim_users == 0:
            for name, (shim, _) in _SHIM.items():
                setattr(torch.autocast, name, shim)
        _autocast_shim_users += 1
    try:
        yield
    finally:
        with _AUTOCAST_SHIM_LOCK:
            _autocast_shim_users -= 1
            if _autocast_shim_users == 0:
                for name, (_, original) in _SHIM.items():
                    setattr(torch.autocast, name, original)


def meta_twin(model: nn.Module) -> nn.Module:
    """``model`` itself when it is all meta, else a deep copy whose parameters, buffers and other tensor attributes are
    meta tensors."""
    params = list(model.parameters())
    buffers = list(model.buffers())
    if all(t.is_meta for t in (*params, *buffers)):
        return model
    memo: dict[int, object] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in params}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in buffers})
    # Other tensors a module keeps (a MoE layer's last aux_loss, a graph's output, which deepcopy refuses) too.
    memo.update({id(value): torch.empty_like(value, device="meta") for module in model.modules()
                 for value in vars(module).values() if isinstance(value, torch.Tensor) and id(value) not in memo})
    return copy.deepcopy(model, memo)


# ----------------------------------------------------------------------------------------------- front ends


class _Tracer(torch.fx.Tracer):
    """``symbolic_trace``'s tracer with user leaf modules; remembers the innermost module a tracing error came from."""

    def __init__(self, leaf_modules: LeafModules, *, replicate: bool = False) -> None:
        super().__init__()
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.repeats = _Repeats(self, enabled=replicate)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types) or module_qualified_name in self.leaf_names:
            return True
        if module_qualified_name == self.repeats.leaf_now:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> object:
        try:
            return self.repeats.call(m, lambda: super(_Tracer, self).call_module(m, forward, args, kwargs), args, kwargs)
        except Exception as exc:
            _blame(exc, self.path_of_module(m), m)
            raise


class _Repeats:
    """Which container elements a ``_Tracer`` traces and which it records as one node (module docstring)."""

    def __init__(self, tracer: _Tracer, *, enabled: bool) -> None:
        self.tracer, self.enabled = tracer, enabled
        self.leaf_now: str | None = None
        self.traced: dict[tuple, list[tuple[str, tuple, tuple]]] = {}  # group -> [(fqn, arguments, graph)]
        self.replicas: dict[str, str] = {}
        self.outputs: dict[str, tuple[torch.fx.Node, ...]] = {}

    def call(self, m: nn.Module, trace: Callable[[], object], args: tuple, kwargs: dict) -> object:
        fqn = self.tracer.path_of_module(m)
        group = self._group(fqn, m) if self.enabled else None
        if group is None or self.tracer.is_leaf_module(m, fqn):  # a leaf anyway: nothing to repeat
            return trace()
        arguments = _describe_arguments((args, kwargs))
        done = self.traced.setdefault(group, [])
        if len(done) >= 2 and done[-1][1:] == done[-2][1:] and done[-1][1] == arguments and fqn not in self.outputs:
            self.replicas[fqn], self.leaf_now = done[-1][0], fqn
            try:
                return trace()  # a leaf now: one call_module node
            finally:
                self.leaf_now = None
        graph = self.tracer.graph
        before = len(graph.nodes)
        out = trace()
        nodes = list(islice(reversed(graph.nodes), len(graph.nodes) - before))[::-1]
        done.append((fqn, arguments, _describe_nodes(nodes, fqn)))
        self.outputs[fqn] = tuple(x.node for x in tree_leaves(out) if isinstance(x, torch.fx.Proxy))
        return out

    def _group(self, fqn: str, m: nn.Module) -> tuple | None:
        """(container, shape key) of a container element, None for any other module."""
        parent = fqn.rpartition(".")[0]
        if not fqn or not isinstance(self.tracer.root.get_submodule(parent), CONTAINERS):
            return None
        return parent, shape_key(m)


def _describe_arguments(value: object) -> tuple:
    """Kind of each argument leaf: a traced value, or the plain value itself (others by type)."""
    plain = (int, float, bool, str, type(None))
    return tuple(
        "proxy" if isinstance(x, torch.fx.Proxy) else x if isinstance(x, plain) else type(x).__qualname__
        for x in tree_leaves(value)
    )


def _describe_nodes(nodes: list[torch.fx.Node], fqn: str) -> tuple:
    """The graph an element's forward produced, with module names relative to the element and arguments as
    positions among these nodes (``-1``: a node from outside)."""
    index = {node: i for i, node in enumerate(nodes)}

    def relative(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            return ("node", index.get(value, -1))
        if isinstance(value, str) and (value == fqn or value.startswith(fqn + ".")):
            return ("self", value[len(fqn):])
        return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)

    return tuple(
        (node.op, relative(str(node.target)) if node.op in ("call_module", "get_attr") else str(node.target),
         tuple(relative(a) for a in tree_leaves(node.args)), tuple(node.kwargs), tuple(relative(a) for a in tree_leaves(node.kwargs)))
        for node in nodes
    )


def _trace_fx(model: nn.Module, _args: tuple, _kwargs: dict, leaf_modules: LeafModules) -> torch.fx.Graph:
    return _Tracer(leaf_modules).trace(model)


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, _leaf: LeafModules) -> torch.fx.Graph:
    with _module_blame(model), _evaluating(model):
        return torch.export.export(model, args, kwargs, strict=False).graph


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode while its data flow is traced, each module's mode put back after. The layers call each
    other alike; what only training does is left out of the trace: torchtitan's MoE counts its routed tokens in a
    no_grad region per block, each of which torch.export turns into a higher-order op, recompiling the graph every
    time (Qwen3-30B-A3B: 34 s of a 45 s plan here)."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _trace_make_fx(model: nn.Module, args: tuple, kwargs: dict, _leaf: LeafModules) -> torch.fx.Graph:
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(*flat: object) -> object:
        return model(*flat[: len(args)], **dict(zip(kwargs, flat[len(args) :])))

    forward._orig_mod = model  # make_fx records the module stack relative to this root
    trace = make_fx(forward, tracing_mode="fake", record_module_stack=True, _allow_non_fake_inputs=True)
    with _module_blame(model):
        return trace(*args, *kwargs.values()).graph


_TRACERS: dict[str, Callable[[nn.Module, tuple, dict, LeafModules], torch.fx.Graph]] = {
    FX: _trace_fx,
    EXPORT: _trace_export,
    MAKE_FX: _trace_make_fx,
}


# ----------------------------------------------------------------------------------------------- failures


def _blame(exc: BaseException, path: str, module: nn.Module) -> None:
    if not hasattr(exc, "_tessera_module"):  # innermost module wins
        exc._tessera_module = f"{path or '<root>'} ({type(module).__name__})"  # type: ignore[attr-defined]


@contextmanager
def _module_blame(model: nn.Module) -> Iterator[None]:
    """Track the running module (global forward hooks) so an exception can name the innermost one."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    stack: list[nn.Module] = []

    def pre(module: nn.Module, _args: tuple) -> None:
        if id(module) in names:
            stack.append(module)

    def post(module: nn.Module, _args: tuple, _out: object) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post),
    ]
    try:
        yield
    except Exception as exc:
        if stack:
            _blame(exc, names[id(stack[-1])], stack[-1])
        raise
    finally:
        for hook in hooks:
            hook.remove()


def describe_failure(front_end: str, model: nn.Module, exc: BaseException) -> str:
    """One line: which front end, which module, the user's line of code, and the error's first line."""
    where = getattr(exc, "_tessera_module", None) or f"the root module ({type(model).__name__})"
    return f"{front_end} cannot trace {where}{user_frame(exc)}: {type(exc).__name__}: {first_line(exc)}"


def user_frame(exc: BaseException) -> str:
    """`` at file:line `code` `` of the last frame outside torch and Tessera's planner ('' if none)."""
    library = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(library)]
    return f" at {frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an error message, at most 300 characters."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:300]
