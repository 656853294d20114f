"""Measure: per-layer FLOPs and bytes of one training step of one sequence, on the meta device.

``measure_layers`` runs one forward + cross-entropy + backward with parameters and buffers replaced by meta
tensors of the planning dtype (``torch.func.functional_call``), so a model with real weights is measured without
copying them. Per layer:

- FLOPs: ``FlopCounterMode`` (its module tracker attributes ops to modules in forward and backward); one counter
  spans both passes, and the backward share is the total minus a snapshot taken after the forward.
- saved bytes: ``saved_tensors_hooks`` charge each tensor autograd saves to the layer running when it is saved.
  Tensors are deduplicated by storage (meta tensors keep storage identity), so a tensor saved twice or views of
  one tensor count once, at the first saver; parameter and buffer storages are never counted.
- full-recompute bytes = bytes of the layer's tensor inputs; output bytes = bytes of its tensor outputs.

Repeated blocks of a container are run twice and then replayed (``_BlockReplay``): later identical blocks return
fresh meta outputs shaped like the first's and copy its numbers, so a deep model costs what a shallow one does.

``F.scaled_dot_product_attention`` without a mask is routed to the fused flash kernel
(``aten._scaled_dot_product_flash_attention``), which is what CUDA and CPU dispatch to: on meta, SDPA would
otherwise take the unfused math path that saves the (T, T) score matrix, overstating memory by orders of
magnitude at long context. Its flash backward FLOPs include the recomputed scores (2.5x the forward).

Glue (ops in the root's own forward, outside every layer) is charged to the first layer. The loss is measured as
its own layer ``LOSS``: ``F.cross_entropy`` over fp32-upcast logits (as Megatron-LM and torchtitan compute it),
targets shaped like the input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from tessera.errors import CaptureError

LOSS = "loss"
"""FQN of the loss layer (computed outside the model)."""
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
"""Module containers whose elements are layers (capture's layer discovery uses the same tuple)."""


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
def _io_hooks(
    model: nn.Module, tallies: dict[str, Tally], scope: _Scope, resident: dict[int, object]
) -> Iterator[None]:
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


def _attribute_flops(
    tallies: dict[str, Tally], forward: dict, total: dict, *, root: str, replayed: dict[str, str]
) -> None:
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
    def forward(ctx, like: tuple[torch.Tensor, ...], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        ctx.inputs = [(x.shape, x.dtype) for x in inputs]
        fresh = tuple(torch.empty_like(t, device="meta") for t in like)
        ctx.mark_non_differentiable(*(t for t, old in zip(fresh, like) if not old.requires_grad))
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

    def __init__(
        self, model: nn.Module, order: tuple[str, ...], counter: FlopCounterMode, *, root: str, enabled: bool
    ) -> None:
        self.model, self.counter, self.root = model, counter, root
        self.groups: dict[tuple, list[str]] = {}
        for fqn in order if enabled else ():
            parent, _, _ = fqn.rpartition(".")
            if parent and isinstance(model.get_submodule(parent), _CONTAINERS):
                self.groups.setdefault((parent, _shape_key(model.get_submodule(fqn))), []).append(fqn)
        self.seen: dict[str, tuple] = {}  # fqn -> (inputs, outputs, forward numbers), described
        self.outputs: dict[str, object] = {}  # fqn -> what its forward returned (meta: costs nothing)
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
                return _replay(self.outputs[group[0]], args, kwargs)
            out = forward(*args, **kwargs)
            flops = sum(self.counter.get_flop_counts().get(f"{self.root}.{fqn}", {}).values())
            self.seen[fqn] = (inputs, _describe(out), flops, tallies[fqn].saved_bytes)
            self.outputs[fqn] = out
            return out

        return run


def _shape_key(module: nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return type(module).__qualname__, tuple((n, tuple(t.shape), t.dtype) for n, t in tensors)


def _replay(like: object, args: tuple, kwargs: dict) -> object:
    """Output shaped like ``like`` (fresh tensors, other leaves as they were), differentiable wrt the inputs."""
    leaves, spec = torch.utils._pytree.tree_flatten(like)
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    leaves_in = torch.utils._pytree.tree_leaves((args, kwargs))
    grad_inputs = [x for x in leaves_in if isinstance(x, torch.Tensor) and x.requires_grad]
    fresh = iter(_Replay.apply(tensors, *grad_inputs))
    rebuilt = [next(fresh) if isinstance(x, torch.Tensor) else x for x in leaves]
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
    # The flash kernel broadcasts fewer key/value heads itself (GQA), so enable_gqa needs no handling.
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]  # (B, nh, T, hd)
