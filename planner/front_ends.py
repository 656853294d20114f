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
"""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tessera.errors import CaptureError

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


def trace_model(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    front_ends: Sequence[str] | None = None,
    leaf_modules: LeafModules = (),
) -> Traced:
    """Graph from the first front end that traces ``model`` on meta ``args`` / ``kwargs``; CaptureError if none."""
    reasons: list[str] = []
    twin: nn.Module | None = None  # made once, only if a front end that runs the forward is reached
    for name in resolve_front_ends(front_ends):
        if name != FX and twin is None:
            twin = meta_twin(model)
        try:
            graph = _TRACERS[name](model if name == FX else twin, args, kwargs, leaf_modules)
        except Exception as exc:  # any tracer failure: record it, try the next front end
            reasons.append(describe_failure(name, model, exc))
            continue
        return Traced(name, graph, tuple(reasons))
    raise CaptureError("; ".join(reasons) + ". " + NEXT_STEPS)


def resolve_front_ends(front_ends: Sequence[str] | None) -> tuple[str, ...]:
    """Canonical front-end names; CaptureError naming the valid ones for an unknown name."""
    if front_ends is None:
        return FRONT_ENDS
    unknown = [name for name in front_ends if name not in ALIASES]
    if unknown or not front_ends:
        raise CaptureError(f"unknown front end(s) {unknown}; choose from {sorted(set(ALIASES))}")
    return tuple(dict.fromkeys(ALIASES[name] for name in front_ends))


def meta_twin(model: nn.Module) -> nn.Module:
    """``model`` itself when it is all meta, else a deep copy whose parameters and buffers are meta tensors."""
    params = list(model.parameters())
    buffers = list(model.buffers())
    if all(t.is_meta for t in (*params, *buffers)):
        return model
    memo: dict[int, object] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in params}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in buffers})
    return copy.deepcopy(model, memo)


# ----------------------------------------------------------------------------------------------- front ends


class _Tracer(torch.fx.Tracer):
    """``symbolic_trace``'s tracer with user leaf modules; remembers the innermost module a tracing error came from."""

    def __init__(self, leaf_modules: LeafModules) -> None:
        super().__init__()
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types) or module_qualified_name in self.leaf_names:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> object:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            _blame(exc, self.path_of_module(m), m)
            raise


def _trace_fx(model: nn.Module, _args: tuple, _kwargs: dict, leaf_modules: LeafModules) -> torch.fx.Graph:
    return _Tracer(leaf_modules).trace(model)


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, _leaf: LeafModules) -> torch.fx.Graph:
    with _module_blame(model):
        return torch.export.export(model, args, kwargs, strict=False).graph


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
