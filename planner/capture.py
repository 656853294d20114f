"""Capture: turn an ``nn.Module`` into a LayerGraph of measured per-layer statistics, never touching real weights.

Steps (one function each):

1. ``find_layers``: the planning units. Every child of the root is a layer, except that the elements of a
   ``ModuleList`` / ``ModuleDict`` / ``Sequential`` are layers themselves (``blocks.0``, ``blocks.1``...), and a
   parameter-less wrapper whose direct child is such a container is looked through (Hugging Face's
   ``model.layers.0``). Known limit: a root-level MoE layer (router + ``experts`` list) would be looked
   through too; inside a block, where MoE layers live in the reference models, it is not.
2. ``trace_layers``: a front end (today ``torch.fx.symbolic_trace``; ``FRONT_ENDS`` is the hook for
   ``torch.export`` / ``make_fx`` fallbacks) gives the execution order of layers and the data-flow edges between
   them. fx nodes are grouped by the layer that owns them; nodes in the root's own forward ("glue", e.g. the
   position add) pass their producers through, so ``tok_emb -> add -> blocks.0`` becomes ``tok_emb -> blocks.0``.
3. ``measure_layers`` (in ``tessera.planner.measure``): FLOPs, saved bytes, input and output bytes of every layer
   and the loss, from one forward + cross-entropy + backward of ONE sequence on the meta device.
4. ``LayerStats`` per layer: the measurements, the parameters it owns, and a signature shared by identical blocks.

Glue (ops and parameters in the root module's own forward, outside every layer) is charged to the first layer;
in the reference models it is free (a position add, the RoPE table slice). Layers the forward never calls are
left out. The loss is its own layer ``loss``, after the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from tessera.cost_models.types import LayerKind, LayerStats
from tessera.errors import CaptureError, ModelSpecError
from tessera.models import build_model
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.measure import _CONTAINERS, LOSS, Tally, measure_layers

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
_METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "layout", "requires_grad")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def capture(
    model: nn.Module, *, seq_len: int, dtype: torch.dtype = torch.bfloat16, name: str | None = None
) -> LayerGraph:
    """Trace and measure ``model`` for one sequence of ``seq_len`` tokens (input ``(1, seq_len)`` int64 ids).

    Works on a model on meta or with real weights (weights are never copied or used). ``name`` defaults to
    ``model.name`` or the class name. Raises CaptureError naming the module and the op that failed.
    """
    layers = find_layers(model)
    flow = trace_layers(model, layers)
    tallies = measure_layers(model, flow.order, seq_len=seq_len, dtype=dtype)
    owned = _owned_params(model, flow.order, layers)
    elements = _container_elements(model, layers)
    kinds = {fqn: _kind(layers[fqn], is_head=fqn == flow.head, in_container=fqn in elements) for fqn in flow.order}
    stats = [_layer_stats(fqn, layers[fqn], kinds[fqn], tallies[fqn], owned[fqn]) for fqn in flow.order]
    stats.append(_layer_stats(LOSS, None, "loss", tallies[LOSS], 0))
    return LayerGraph(
        model_name=name or getattr(model, "name", None) or type(model).__name__,
        seq_len=seq_len,
        dtype=_DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        front_end=flow.front_end,
        layers=tuple(stats),
        edges=flow.edges,
    )


def capture_preset(spec: str, *, seq_len: int, dtype: torch.dtype = torch.bfloat16) -> LayerGraph:
    """Build the model preset ``spec`` on meta (no memory) and capture it."""
    model = build_model(spec, device="meta")
    if seq_len > model.config.seq_len:  # meta would not notice positions past the embedding or RoPE table
        raise ModelSpecError(
            f"{spec} covers {model.config.seq_len} positions but seq_len={seq_len} was asked for; "
            f"use '{spec.partition(':')[0]}:seq={seq_len}' (with the preset's other overrides) for a longer context"
        )
    return capture(model, seq_len=seq_len, dtype=dtype, name=spec)


# ----------------------------------------------------------------------------------------------- layers


def find_layers(root: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """Planning units of ``root``: FQN -> module, in registration order (see the module docstring)."""
    found: dict[str, nn.Module] = {}
    for name, child in root.named_children():
        fqn = prefix + name
        if isinstance(child, _CONTAINERS):
            found.update({f"{fqn}.{n}": m for n, m in child.named_children()})
        elif _is_wrapper(child):
            found.update(find_layers(child, fqn + "."))
        else:
            found[fqn] = child
    return found


def _is_wrapper(module: nn.Module) -> bool:
    has_container = any(isinstance(c, _CONTAINERS) for c in module.children())
    return has_container and not any(True for _ in module.parameters(recurse=False))


def _container_elements(root: nn.Module, layers: dict[str, nn.Module]) -> set[str]:
    """Layers that are elements of a ModuleList / ModuleDict / Sequential."""
    return {fqn for fqn in layers if "." in fqn and isinstance(root.get_submodule(fqn.rpartition(".")[0]), _CONTAINERS)}


def _kind(module: nn.Module, *, is_head: bool, in_container: bool) -> LayerKind:
    """Role of a layer; a container element is a ``block`` when it is composite (not a bare Linear or GELU)."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, _NORMS) or type(module).__name__.lower().endswith("norm"):
        return "norm"
    if is_head:
        return "head"
    if in_container and any(True for _ in module.children()):
        return "block"
    return "other"


# ----------------------------------------------------------------------------------------------- tracing


@dataclass(frozen=True)
class LayerFlow:
    """What a front end tells about the layers: execution order, data flow, and the logits layer."""

    front_end: str
    order: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]
    head: str | None


class _Tracer(torch.fx.Tracer):
    """``symbolic_trace``'s tracer, remembering the innermost module a tracing error came from."""

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> object:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, "_tessera_module"):  # innermost module wins
                exc._tessera_module = f"{self.path_of_module(m)} ({type(m).__name__})"  # type: ignore[attr-defined]
            raise


def _trace_fx(model: nn.Module) -> torch.fx.Graph:
    return _Tracer().trace(model)


FRONT_ENDS: tuple[tuple[str, Callable[[nn.Module], torch.fx.Graph]], ...] = (("torch.fx.symbolic_trace", _trace_fx),)
"""Front ends tried in order; each returns an fx Graph whose nodes carry ``nn_module_stack`` metadata.
Fallbacks (``torch.export`` non-strict, ``make_fx``) are appended here."""


def trace_layers(model: nn.Module, layers: dict[str, nn.Module]) -> LayerFlow:
    """Layer order and edges from the first front end that traces ``model``; CaptureError if none does."""
    failures = []
    for front_end, trace in FRONT_ENDS:
        try:
            graph = trace(model)
        except Exception as exc:  # any tracer failure: report all front ends, then give up
            failures.append(_describe_failure(front_end, model, exc))
            continue
        flow = _layer_flow(front_end, graph, layers)
        if not flow.order:
            raise CaptureError(
                f"{type(model).__name__} calls no child module in forward, so there is nothing to plan per layer; "
                "wrap its computation in submodules (embedding, blocks, head)"
            )
        return flow
    raise CaptureError(
        "; ".join(failures) + ". Next step: remove Python control flow that depends on tensor values from that "
        "forward (e.g. `if x.sum() > 0:` -> torch.where), or make the module traceable; see docs on capture."
    )


def _describe_failure(front_end: str, model: nn.Module, exc: Exception) -> str:
    where = getattr(exc, "_tessera_module", None) or f"the root module ({type(model).__name__})"
    library = (os.path.dirname(torch.__file__), __file__)  # the user's frame is the last one outside these
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(library)]
    at = f" at {frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    return f"{front_end} cannot trace {where}{at}: {type(exc).__name__}: {exc}"


def _owner(node: torch.fx.Node, names: set[str]) -> str | None:
    """Layer owning an fx node, by longest FQN prefix (None for glue in the root's forward)."""
    if node.op in ("call_module", "get_attr"):
        path = str(node.target)
    else:
        stack = node.meta.get("nn_module_stack") or {}
        path = next(reversed(stack.values()))[0] if stack else ""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in names:
            return ".".join(parts[:end])
    return None


def _reads_metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("size", "dim", "numel", "get_device")
    return node.op == "call_function" and node.target is getattr and node.args[1] in _METADATA_ATTRS


def _layer_flow(front_end: str, graph: torch.fx.Graph, layers: dict[str, nn.Module]) -> LayerFlow:
    names = set(layers)
    order: dict[str, None] = {}
    edges: dict[tuple[str, str], None] = {}
    producers: dict[torch.fx.Node, frozenset[str]] = {}  # layers whose outputs reach this node
    head_sources: frozenset[str] = frozenset()
    for node in graph.nodes:
        incoming = frozenset().union(*(producers[n] for n in node.all_input_nodes))
        owner = _owner(node, names)
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
    heads = [fqn for fqn in order if fqn in head_sources and isinstance(layers[fqn], nn.Linear)]
    return LayerFlow(front_end, tuple(order), tuple(edges), heads[-1] if heads else None)


# ----------------------------------------------------------------------------------------------- records


def _owned_params(model: nn.Module, order: tuple[str, ...], layers: dict[str, nn.Module]) -> dict[str, int]:
    """Parameters per layer, each tensor counted once at its first owner in model order; glue to the first."""
    seen: set[int] = set()
    owned = {}
    for fqn in order:
        fresh = [p for p in layers[fqn].parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        owned[fqn] = sum(p.numel() for p in fresh)
    owned[order[0]] += sum(p.numel() for p in model.parameters(recurse=False) if id(p) not in seen)
    return owned


def _layer_stats(fqn: str, module: nn.Module | None, kind: LayerKind, tally: Tally, params: int) -> LayerStats:
    return LayerStats(
        fqn=fqn,
        kind=kind,
        signature=_signature(module, kind, tally, params),
        param_count=params,
        forward_flops=tally.forward_flops,
        backward_flops=tally.backward_flops,
        saved_bytes_no_recompute=tally.saved_bytes,
        saved_bytes_full_recompute=tally.input_bytes,
        output_bytes=tally.output_bytes,
    )


def _signature(module: nn.Module | None, kind: str, tally: Tally, params: int) -> str:
    """Short stable hash of class, parameter shapes and measured numbers: identical blocks share it."""
    shapes = [(n, list(p.shape)) for n, p in module.named_parameters()] if module is not None else []
    key = [type(module).__name__, kind, shapes, params, asdict(tally)]
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()[:12]
