"""Capture: turn an ``nn.Module`` into a LayerGraph of measured per-layer statistics, never touching real weights.

Steps (one function each):

1. ``find_layers``: the planning units. Every child of the root is a layer, except that the elements of a
   ``ModuleList`` / ``ModuleDict`` / ``Sequential`` are layers themselves (``blocks.0``, ``blocks.1``...), and a
   parameter-less wrapper whose direct child is such a container is looked through (Hugging Face's
   ``model.layers.0``).
2. ``trace_layers``: a front end (today ``torch.fx.symbolic_trace``; ``FRONT_ENDS`` is the hook for
   ``torch.export`` / ``make_fx`` fallbacks) gives the execution order of layers and the data-flow edges between
   them. fx nodes are grouped by the layer that owns them; nodes in the root's own forward ("glue", e.g. the
   position add) pass their producers through, so ``tok_emb -> add -> blocks.0`` becomes ``tok_emb -> blocks.0``.
3. ``measure_layers``: one forward + cross-entropy + backward of ONE sequence on the meta device, with parameters
   and buffers replaced by meta tensors of the planning dtype (``torch.func.functional_call``), so a model with
   real CPU weights is measured without copying them. Per layer:

   - FLOPs: ``FlopCounterMode`` (its module tracker attributes ops to modules in forward and backward); one
     counter spans both passes, and the backward share is the total minus a snapshot taken after the forward.
   - saved bytes: ``saved_tensors_hooks`` charge each tensor autograd saves to the layer running when it is
     saved. Tensors are deduplicated by storage (meta tensors keep storage identity), so a tensor saved twice
     or views of one tensor count once, at the first saver; parameter and buffer storages are never counted.
   - full-recompute bytes = bytes of the layer's tensor inputs; output bytes = bytes of its tensor outputs.

   ``F.scaled_dot_product_attention`` without a mask is measured as the fused flash kernel
   (``aten._scaled_dot_product_flash_attention``), which is what CUDA and CPU dispatch to: on meta, SDPA would
   otherwise take the unfused math path that saves the (T, T) score matrix, overstating memory by orders of
   magnitude at long context. Its flash backward FLOPs include the recomputed scores (2.5x the forward).

Glue (ops and parameters in the root module's own forward, outside every layer) is charged to the first layer;
in the reference models it is free (a position add, the RoPE table slice). Layers the forward never calls are
left out. The loss is measured as its own layer ``loss``: ``F.cross_entropy`` over fp32-upcast logits (as
Megatron-LM and torchtitan compute it), targets shaped like the input.
"""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from tessera.cost_models.types import LayerKind, LayerStats
from tessera.errors import CaptureError
from tessera.planner.layer_graph import LayerGraph

LOSS = "loss"
"""FQN of the loss layer (computed outside the model)."""
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
_METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "layout", "requires_grad")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def capture(model: nn.Module, *, seq_len: int, dtype: torch.dtype = torch.bfloat16, name: str | None = None) -> LayerGraph:
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
    from tessera.models import build_model  # models imports only torch; keep planner import-light

    return capture(build_model(spec, device="meta"), seq_len=seq_len, dtype=dtype, name=spec)


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
        return _layer_flow(front_end, graph, layers)
    raise CaptureError(
        "; ".join(failures) + ". Next step: remove Python control flow that depends on tensor values from that "
        "forward (e.g. `if x.sum() > 0:` -> torch.where), or make the module traceable; see docs on capture."
    )


def _describe_failure(front_end: str, model: nn.Module, exc: Exception) -> str:
    where = getattr(exc, "_tessera_module", None) or f"the root module ({type(model).__name__})"
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
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


# ----------------------------------------------------------------------------------------------- measuring


@dataclass
class Tally:
    """Raw measurements of one layer for one sequence."""

    forward_flops: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0


@dataclass
class _Scope:
    """Which layer is running in the forward; glue goes to the first layer, after the model to the loss."""

    first: str
    stack: list[str] = field(default_factory=list)
    model_done: bool = False

    def current(self) -> str:
        if self.stack:
            return self.stack[-1]
        return LOSS if self.model_done else self.first


def measure_layers(
    model: nn.Module, order: tuple[str, ...], *, seq_len: int, dtype: torch.dtype, reuse_repeated: bool = True
) -> dict[str, Tally]:
    """FLOPs and bytes of every layer in ``order`` plus the loss, from one meta forward and backward.

    ``reuse_repeated`` replays repeated blocks instead of running them (see ``_BlockReplay``); False measures
    every block, which is what the replay is tested against.
    """
    state = _meta_state(model, dtype)
    resident = {id(s): s for s in (t.untyped_storage() for t in state.values())}  # refs keep ids unique
    tallies = {fqn: Tally() for fqn in (*order, LOSS)}
    scope = _Scope(first=order[0])
    ids = torch.zeros((1, seq_len), dtype=torch.int64, device="meta")  # (1, T); doubles as the targets
    root = type(model).__name__  # FlopCounterMode's module tracker names modules "<RootClass>.<fqn>"
    was_training = model.training
    model.train()  # plan for training: dropout and friends as in a training step
    try:
        with FlopCounterMode(display=False) as counter:
            replay = _BlockReplay(model, order, counter, root=root, enabled=reuse_repeated)
            with ExitStack() as stack:
                stack.enter_context(_FlashAttention())
                stack.enter_context(_io_hooks(model, tallies, scope, resident))
                stack.enter_context(_saved_tensor_meter(tallies, scope, resident))
                stack.enter_context(replay.installed(tallies))
                loss = _forward_and_loss(model, state, ids, scope, tallies)
            forward_counts = counter.get_flop_counts()
            _backward(loss)
        _attribute_flops(tallies, forward_counts, counter.get_flop_counts(), root=root, replayed=replay.replayed)
    finally:
        model.train(was_training)
    return tallies


def _forward_and_loss(
    model: nn.Module, state: dict[str, torch.Tensor], ids: torch.Tensor, scope: _Scope, tallies: dict[str, Tally]
) -> torch.Tensor:
    try:
        logits = functional_call(model, state, (ids,))  # (1, T, V)
        scope.model_done = True
        tallies[LOSS].input_bytes = _tensor_bytes((logits, ids), {})
        # fp32 upcast: a large-vocabulary softmax is computed in fp32 (Megatron-LM, torchtitan).
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())  # ()
        tallies[LOSS].output_bytes = _tensor_bytes(loss, {})
        return loss
    except CaptureError:
        raise
    except Exception as exc:
        raise _measure_error(scope.current(), "forward", exc) from exc


def _backward(loss: torch.Tensor) -> None:
    try:
        loss.backward()
    except Exception as exc:
        raise _measure_error("(a layer's backward)", "backward", exc) from exc


def _measure_error(fqn: str, phase: str, exc: Exception) -> CaptureError:
    return CaptureError(
        f"measuring {fqn!r} on the meta device failed in the {phase} pass: {type(exc).__name__}: {exc}. "
        "Next step: the op needs a meta kernel (register one with torch.library) or the module must not read "
        "tensor values (e.g. .item(), .tolist()) in forward."
    )


def _meta_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta stand-ins for every parameter and buffer (floating ones cast to ``dtype``); tied tensors stay tied."""
    memo: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) not in memo:
            target = dtype if tensor.is_floating_point() else tensor.dtype
            meta = torch.empty_like(tensor, device="meta", dtype=target)
            memo[id(tensor)] = meta.requires_grad_(isinstance(tensor, nn.Parameter) and tensor.requires_grad)
        state[name] = memo[id(tensor)]
    return state


def _tensor_bytes(value: object, resident: dict[int, object]) -> int:
    """Bytes of the tensors in a (nested) value, skipping parameters and buffers."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return sum(
        t.numel() * t.element_size()
        for t in leaves
        if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in resident
    )


@contextmanager
def _io_hooks(model: nn.Module, tallies: dict[str, Tally], scope: _Scope, resident: dict[int, object]) -> Iterator[None]:
    """Track the running layer and record each layer's input and output bytes."""
    handles = []
    for fqn in tallies:
        if fqn == LOSS:
            continue
        module = model.get_submodule(fqn)

        def pre(_m: nn.Module, args: tuple, kwargs: dict, fqn: str = fqn) -> None:
            scope.stack.append(fqn)
            tallies[fqn].input_bytes += _tensor_bytes((args, kwargs), resident)

        def post(_m: nn.Module, _args: tuple, output: object, fqn: str = fqn) -> None:
            scope.stack.pop()
            tallies[fqn].output_bytes += _tensor_bytes(output, resident)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _saved_tensor_meter(tallies: dict[str, Tally], scope: _Scope, resident: dict[int, object]) -> Iterator[None]:
    """Charge each storage autograd saves to the running layer, once."""
    seen: dict[int, object] = {}  # id -> storage; holding the storage keeps the id unique

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in resident and id(storage) not in seen:
            seen[id(storage)] = storage
            tallies[scope.current()].saved_bytes += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def _attribute_flops(tallies: dict[str, Tally], forward: dict, total: dict, *, root: str, replayed: dict[str, str]) -> None:
    """Per-layer FLOPs from FlopCounterMode's per-module counts (backward = total - forward snapshot).

    Replayed blocks copy their representative; glue goes to the first layer; the loss is what ran outside the root.
    """

    def flops(counts: dict, key: str) -> int:
        return sum(counts.get(key, {}).values())

    layers = [fqn for fqn in tallies if fqn != LOSS]
    for fqn in layers:
        tallies[fqn].forward_flops = flops(forward, f"{root}.{fqn}")
        tallies[fqn].backward_flops = flops(total, f"{root}.{fqn}") - tallies[fqn].forward_flops
    glue_fwd = flops(forward, root) - sum(tallies[fqn].forward_flops for fqn in layers)
    glue_bwd = flops(total, root) - flops(forward, root) - sum(tallies[fqn].backward_flops for fqn in layers)
    for fqn, rep in replayed.items():
        tallies[fqn].forward_flops = tallies[rep].forward_flops
        tallies[fqn].backward_flops = tallies[rep].backward_flops
        tallies[fqn].saved_bytes = tallies[rep].saved_bytes
    tallies[layers[0]].forward_flops += glue_fwd
    tallies[layers[0]].backward_flops += glue_bwd
    tallies[LOSS].forward_flops = flops(forward, "Global") - flops(forward, root)
    tallies[LOSS].backward_flops = flops(total, "Global") - flops(total, root) - tallies[LOSS].forward_flops


# ----------------------------------------------------------------------------------------------- replay


def _describe(value: object) -> tuple:
    """Hashable description of a (nested) value: structure, tensor metadata, plain values (others by id)."""
    leaves, spec = torch.utils._pytree.tree_flatten(value)
    plain = (int, float, bool, str, type(None))
    return spec, tuple(
        ("tensor", tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor)
        else x if isinstance(x, plain) else ("object", id(x))
        for x in leaves
    )


class _Replay(torch.autograd.Function):
    """Stand-in for a repeated block: fresh meta outputs shaped like the representative's, gradients flow back."""

    @staticmethod
    def forward(ctx, outputs: tuple, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        ctx.inputs = [(x.shape, x.dtype) for x in inputs]
        fresh = tuple(torch.empty(shape, dtype=dt, device="meta") for _, shape, dt, _ in outputs)
        ctx.mark_non_differentiable(*(t for t, meta in zip(fresh, outputs) if not meta[3]))
        return fresh

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:  # noqa: ANN001
        return (None, *(torch.empty(shape, dtype=dt, device="meta") for shape, dt in ctx.inputs))


class _BlockReplay:
    """Measure repeated blocks once: a block is replayed when its container's first two elements of the same
    class and parameter/buffer shapes took the same inputs, returned the same outputs and measured the same
    forward FLOPs and saved bytes, and it takes those inputs too. Its numbers are then copied from the first.

    Replay makes a 126-block model cost what a 2-block one does; a block whose behaviour depends on its index
    alone with a period other than 2 (same shapes, different code path) would be mis-measured.
    """

    def __init__(self, model: nn.Module, order: tuple[str, ...], counter: FlopCounterMode, *, root: str, enabled: bool) -> None:
        self.model, self.counter, self.root = model, counter, root
        self.groups: dict[tuple, list[str]] = {}
        for fqn in order if enabled else ():
            parent, _, _ = fqn.rpartition(".")
            if parent and isinstance(model.get_submodule(parent), _CONTAINERS):
                self.groups.setdefault((parent, _shape_key(model.get_submodule(fqn))), []).append(fqn)
        self.seen: dict[str, tuple] = {}  # fqn -> (inputs, outputs, forward numbers)
        self.replayed: dict[str, str] = {}  # replayed fqn -> representative fqn

    @contextmanager
    def installed(self, tallies: dict[str, Tally]) -> Iterator[None]:
        """Wrap the forward of every element of a repeated group (instance attribute, removed on exit)."""
        wrapped = [(fqn, group) for group in self.groups.values() if len(group) > 2 for fqn in group]
        modules = [self.model.get_submodule(fqn) for fqn, _ in wrapped]
        for (fqn, group), module in zip(wrapped, modules):
            module.forward = self._wrap(fqn, group, module.forward, tallies)
        try:
            yield
        finally:
            for module in modules:
                del module.forward

    def _wrap(self, fqn: str, group: list[str], forward: Callable, tallies: dict[str, Tally]) -> Callable:
        def run(*args: object, **kwargs: object) -> object:
            inputs = _describe((args, kwargs))
            first, second = (self.seen.get(g) for g in group[:2])
            if first is not None and first == second and first[0] == inputs:
                self.replayed[fqn] = group[0]
                return _replay(first[1], args, kwargs)
            out = forward(*args, **kwargs)
            flops = sum(self.counter.get_flop_counts().get(f"{self.root}.{fqn}", {}).values())
            self.seen[fqn] = (inputs, _describe(out), flops, tallies[fqn].saved_bytes)
            return out

        return run


def _shape_key(module: nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return type(module).__qualname__, tuple((n, tuple(t.shape), t.dtype) for n, t in tensors)


def _replay(outputs: tuple, args: tuple, kwargs: dict) -> object:
    spec, leaves = outputs
    metas = tuple(leaf for leaf in leaves if isinstance(leaf, tuple) and leaf[:1] == ("tensor",))
    grad_inputs = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.requires_grad]
    fresh = iter(_Replay.apply(metas, *grad_inputs))
    rebuilt = [next(fresh) if isinstance(leaf, tuple) and leaf[:1] == ("tensor",) else leaf for leaf in leaves]
    return torch.utils._pytree.tree_unflatten(rebuilt, spec)


class _FlashAttention(TorchFunctionMode):
    """Route unmasked ``F.scaled_dot_product_attention`` to the flash kernel, which has meta kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _flash_sdpa(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _flash_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    if attn_mask is not None or query.dim() != 4:
        return None  # flash takes no mask; the stock path measures it (with its unfused memory)
    # (B, nh, T, hd); the flash kernel broadcasts fewer key/value heads itself (GQA).
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


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
