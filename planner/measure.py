"""Measure: per-layer FLOPs and bytes of one training step, on meta tensors (no real memory).

``measure_layers`` runs one forward + loss + backward with parameters and buffers replaced by meta tensors of the
planning dtype (``torch.func.functional_call``), so a model with real weights is measured without copying them.
Bare meta tensors first (fastest); a model that reads a tensor value, which a meta tensor does not have, is
measured again under ``FakeTensorMode``, where models that check whether they are being traced -- Hugging Face's
mask code does, and calls ``.item()`` otherwise -- take their tracing path. Per layer:

- FLOPs: ``FlopCounterMode`` (its module tracker attributes ops to modules in forward and backward); one counter
  spans both passes, and the backward share is the total minus a snapshot taken after the forward. The routed
  experts' share (``expert_*_flops``) is what the tracker attributes to the layer's modules named ``experts``
  (``...experts`` for packed experts, ``...experts.<i>`` for a ModuleList of them), each counted once.
- saved bytes: a ``saved_tensors_hooks`` ledger (``saved_bytes.Ledger``) charges each storage autograd saves to
  the layer running when it is first saved (views and repeats count once); parameter and buffer storages are
  never counted.
- selective-recompute bytes: what stays saved when each attention core (SDPA call) is recomputed -- see
  ``tessera.planner.kernels``; ``None`` for a layer without one. ``core_flops``: the cores' forward FLOPs.
- op-level selective recompute FLOPs: the forward FLOPs of every second matrix multiplication (``aten.mm``) of
  the layer, in call order: what torchtitan's op-level selective activation checkpointing re-runs
  (``cost_models.profiles``); the bytes that policy keeps: the layer's inputs, the outputs of the other matmuls
  (the first, third, ...) and of its attention cores (``saved_bytes.SavedOps``; ``Tally`` derives both). Neither
  is measured (0, ``None``) for a layer without ``aten.mm`` calls or one whose repeated elements were replayed
  (their matmuls are not seen one by one): such a layer keeps the attention-core policy, though torchtitan's
  would recompute (for instance) every ``aten.addmm`` of a biased linear.
- full-recompute bytes = bytes of the layer's tensor inputs (each storage charged to the first layer it enters);
  output bytes = bytes of its tensor outputs.
- under autocast (``autocast=True``, a second measurement capture makes of bf16/fp16 models): the same figures with
  fp32 weights and the forward and loss under ``torch.autocast``, as the runtime trains without FSDP
  (``LayerStats.autocast_saved_bytes_*``). Meta tensors have no autocast, so it runs on fake CPU tensors (which
  allocate nothing) under CPU autocast's policy. CUDA's also runs norms and softmax in fp32: the same for a pre-norm
  block's norms (they read the fp32 residual stream) and a fused attention kernel; a norm of a bf16 tensor (a
  qk-norm) or a hand-written softmax saves an fp32 input on a GPU that this counts in bf16. Autocast's weight copies are left
  out (``saved_bytes.WeightCopies``): the cost model prices them on their own.

Repeated blocks of a container are replayed after two identical ones (``tessera.planner.replay``), so a deep model
costs what a shallow one does. Attention is measured as the fused flash kernel (``tessera.planner.kernels``);
its backward FLOPs include the recomputed scores (2.5x the forward).

Inputs: by default token ids ``(1, seq_len)`` (so every number is for ONE sequence); or the example inputs given
to capture. Glue (ops in the root's own forward, outside every layer) is charged to the first layer. The loss is
its own layer ``LOSS``: ``F.cross_entropy`` over fp32-upcast logits (as Megatron-LM and torchtitan compute it) --
the output itself, its ``logits`` entry, or its first floating tensor -- against the integer input shaped like
the logits without their last dim (the token ids), else zeros.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from tessera.errors import CaptureError
from tessera.planner.backward_scopes import leave_in_backward, outputs_apart_from_inputs
from tessera.planner.front_ends import MASK_FREE_ATTENTION, first_line, user_frame
from tessera.planner.kernels import CORE_OPS, FusedKernels
from tessera.planner.replay import BlockReplay, ElementReplay
from tessera.planner.recompute_regions import RegionMarks
from tessera.planner.saved_bytes import Ledger, SavedOps, WeightCopies
from tessera.planner.tally import LOSS, Scope, Tally

ExampleInputs = tuple | dict | torch.Tensor | Callable[[int], "tuple | dict | torch.Tensor"]
"""Model inputs: positional args (tuple or one tensor), keyword args (dict), or a function of seq_len giving them."""


def example_inputs_at(example: ExampleInputs | None, seq_len: int | None) -> tuple[tuple, dict]:
    """Meta ``(args, kwargs)`` for ``seq_len``: token ids ``(1, seq_len)`` by default, else the example inputs."""
    if example is None:
        if seq_len is None:
            raise CaptureError("pass seq_len (token-id inputs) or example_inputs to measure a model")
        return (torch.zeros((1, seq_len), dtype=torch.int64, device="meta"),), {}
    value = example(seq_len) if callable(example) else example
    value = tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, value)
    if isinstance(value, dict):
        return (), dict(value)
    return (tuple(value) if isinstance(value, (tuple, list)) else (value,)), {}


def measure_layers(
    model: nn.Module,
    order: tuple[str, ...],
    *,
    dtype: torch.dtype,
    seq_len: int | None = None,
    inputs: ExampleInputs | None = None,
    reuse_repeated: bool = True,
) -> dict[str, Tally]:
    """FLOPs and bytes of every layer in ``order`` plus the loss, from one fake forward and backward.

    ``reuse_repeated`` replays repeated blocks instead of running them (``tessera.planner.replay``); False
    measures every block, which is what the replay is tested against.
    """
    measured = measure_at_lengths(
        model, order, dtype=dtype, lengths=(seq_len,), inputs=inputs, reuse_repeated=reuse_repeated
    )
    return measured[seq_len]


def measure_at_lengths(
    model: nn.Module,
    order: tuple[str, ...],
    *,
    dtype: torch.dtype,
    lengths: tuple[int | None, ...],
    inputs: ExampleInputs | None = None,
    reuse_repeated: bool = True,
    autocast: bool = False,
) -> dict[int | None, dict[str, Tally]]:
    """``measure_layers`` at each sequence length: on bare meta tensors, else under FakeTensorMode.

    ``autocast``: fp32 weights with the forward and loss under ``torch.autocast`` to ``dtype``, as the runtime
    trains where no FSDP unit casts the weights (``runtime.parallel_model``); autocast's copies of the weights are
    not counted (``cost_models.memory.autocast_copy_bytes`` prices them). Meta tensors have no autocast, so this
    runs on fake CPU tensors, under CPU autocast's casting policy."""
    options = {"dtype": dtype, "lengths": lengths, "inputs": inputs, "reuse_repeated": reuse_repeated}
    if autocast:
        return _measure_all(model, order, mode=FakeTensorMode(allow_non_fake_inputs=True), autocast=True, **options)
    try:
        return _measure_all(model, order, mode=None, **options)
    except CaptureError:  # e.g. .item() on meta: the fake run takes the model's tracing path
        return _measure_all(model, order, mode=FakeTensorMode(allow_non_fake_inputs=True), **options)


def _measure_all(
    model: nn.Module,
    order: tuple[str, ...],
    *,
    mode: FakeTensorMode | None,
    dtype: torch.dtype,
    lengths: tuple[int | None, ...],
    inputs: ExampleInputs | None,
    reuse_repeated: bool,
    autocast: bool = False,
) -> dict[int | None, dict[str, Tally]]:
    """Every length with one set of stand-in parameters (fake when ``mode`` is given, else meta; fake CPU fp32
    weights under ``autocast``)."""
    device = "cpu" if autocast else "meta"
    state = _meta_state(model, torch.float32 if autocast else dtype, mode, device=device)
    resident = {id(s): s for s in (t.untyped_storage() for t in state.values())}  # refs keep ids unique
    was_training = model.training
    model.train()  # plan for training: dropout and friends as in a training step
    try:
        return {
            s: _measure_once(
                model, order, mode=mode, state=state, resident=resident, inputs=example_inputs_at(inputs, s),
                dtype=dtype, reuse_repeated=reuse_repeated, autocast=autocast, device=device,
            )
            for s in lengths
        }
    finally:
        model.train(was_training)
        for tensor in state.values():
            tensor.grad = None


def _measure_once(
    model: nn.Module,
    order: tuple[str, ...],
    *,
    mode: FakeTensorMode | None,
    state: dict[str, torch.Tensor],
    resident: dict[int, object],
    inputs: tuple[tuple, dict],
    dtype: torch.dtype,
    reuse_repeated: bool,
    autocast: bool = False,
    device: str = "meta",
) -> dict[str, Tally]:
    """One forward + loss + backward with every meter installed (the forward and loss under ``autocast`` to
    ``dtype``: activations start in fp32 then)."""
    tallies = {fqn: Tally() for fqn in (*order, LOSS)}
    scope = Scope(first=order[0])
    ledger = Ledger(tallies, scope, resident)
    root = type(model).__name__  # FlopCounterMode's module tracker names modules "<RootClass>.<fqn>"
    meta_inputs = tree_map(lambda x: _stand_in(x, mode, torch.float32 if autocast else dtype, device), inputs)
    with (mode or nullcontext(), outputs_apart_from_inputs(), FlopCounterMode(display=False) as counter,
          leave_in_backward(model, order, counter)):
        replay = BlockReplay(model, order if reuse_repeated else (), counter, root=root)
        elements = ElementReplay(model, order if reuse_repeated else (), counter, ledger, root=root)
        regions = RegionMarks(model, order)
        with ExitStack() as stack:
            stack.enter_context(FusedKernels(ledger, model))
            stack.enter_context(_io_hooks(model, tallies, scope, resident))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t))
            stack.enter_context(replay.installed(lambda fqn: tallies[fqn].saved_bytes))
            stack.enter_context(elements.installed())
            saved_ops = stack.enter_context(SavedOps(scope, tallies, resident))
            stack.enter_context(regions.installed())
            if autocast:
                stack.enter_context(WeightCopies(resident))
                stack.enter_context(torch.autocast("cpu", dtype=dtype))
            loss = _forward_and_loss(model, state, meta_inputs, scope, tallies)
        forward_counts = counter.get_flop_counts()
        _backward(loss)
    total_counts = counter.get_flop_counts()
    elements.add_backward(forward_counts, total_counts)
    replayed_in = {fqn for fqn in order for element, _, _ in elements.replayed if element.startswith(fqn + ".")}
    _finalize(tallies, ledger, forward_counts, total_counts, root=root, replayed=replay.replayed,
              partly_replayed=replayed_in, regions=regions, linear_inputs=saved_ops.linear_inputs)
    return tallies


# ----------------------------------------------------------------------------------------------- forward / loss


def _forward_and_loss(
    model: nn.Module, state: dict[str, torch.Tensor], inputs: tuple[tuple, dict], scope: Scope, tallies: dict
) -> torch.Tensor:
    args, kwargs = inputs
    try:
        output = functional_call(model, state, args, kwargs, tie_weights=False)  # _meta_state names every tie
        scope.model_done = True
        logits = _logits(output)
        targets = _targets(logits, tree_leaves(inputs))
        tallies[LOSS].input_bytes = _tensor_bytes((logits, targets), {})
        loss = _TesseraLoss()(logits, targets)
        tallies[LOSS].output_bytes = _tensor_bytes(loss, {})
        return loss
    except Exception as exc:
        raise _measure_error(scope.current(), "forward", exc) from exc


class _TesseraLoss(nn.Module):
    """The loss as a module of its own, so the FLOP counter scopes its backward (``_finalize``): the model's root
    scope is entered in backward only once every floating output has its gradient, so a model returning more than
    its logits (``(logits, hidden)``) runs part of its backward outside that scope."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dim() < 2:
            return logits.float().mean()  # no class dim: a plain reduction stands in for the loss
        # fp32 upcast: a large-vocabulary softmax is computed in fp32 (Megatron-LM, torchtitan)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())  # ()


LOSS_SCOPE = _TesseraLoss.__name__
"""The FLOP counter's key for the loss module."""


def _logits(output: object) -> torch.Tensor:
    """The tensor the loss reads: the output, its ``logits`` entry or attribute, or its first floating tensor."""
    if isinstance(output, torch.Tensor):
        return output
    named = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(named, torch.Tensor):
        return named
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise CaptureError(f"the model returned {type(output).__name__} without a floating tensor to take a loss of")
    return floats[0]


def _targets(logits: torch.Tensor, leaves: list) -> torch.Tensor:
    """The integer input shaped like the logits without their class dim (token ids), else zeros."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and leaf.shape == logits.shape[:-1]:
            return leaf
    return torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)


def _backward(loss: torch.Tensor) -> None:
    try:
        loss.backward()
    except Exception as exc:
        raise _measure_error("(a layer's backward)", "backward", exc) from exc


def _measure_error(fqn: str, phase: str, exc: Exception) -> CaptureError:
    if isinstance(exc, CaptureError):
        return exc
    reason = f"{type(exc).__name__}: {first_line(exc)}"
    advice = MASK_FREE_ATTENTION if "BlockMask" in reason else (
        "Next step: the op needs a meta kernel (register one with torch.library) or the module must not read "
        "tensor values (e.g. .item(), .tolist()) in forward.")
    return CaptureError(f"measuring {fqn!r} on meta / fake tensors failed in the {phase} pass{user_frame(exc)}: "
                        f"{reason}. {advice}")


def _meta_state(
    model: nn.Module, dtype: torch.dtype, mode: FakeTensorMode | None, *, device: str = "meta"
) -> dict[str, torch.Tensor]:
    """Meta (or fake) stand-ins for every parameter and buffer (floating ones in ``dtype``); ties kept.

    One name per (module, attribute): a module registered at two paths (one block object twice in a ``ModuleList``)
    is swapped once, since ``functional_call`` swapping it under both names restores the second path's stand-in
    last and leaves the user's model on meta (torch 2.13). A tensor shared by two modules keeps both names."""
    memo: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    owners: set[tuple[int, str]] = set()
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        path, _, attribute = name.rpartition(".")
        owner = (id(model.get_submodule(path)), attribute)
        if owner in owners:
            continue
        owners.add(owner)
        if id(tensor) not in memo:
            stand_in = _stand_in(tensor, mode, dtype, device)
            memo[id(tensor)] = stand_in.requires_grad_(isinstance(tensor, nn.Parameter) and tensor.requires_grad)
        state[name] = memo[id(tensor)]
    return state


def _stand_in(value: object, mode: FakeTensorMode | None, dtype: torch.dtype, device: str = "meta") -> object:
    """A meta tensor (a fake one on ``device`` under ``mode``) shaped like ``value``, floating ones in ``dtype``;
    others as is. Fake CPU tensors are made inside the mode, which allocates nothing."""
    if not isinstance(value, torch.Tensor):
        return value
    kind = dtype if value.is_floating_point() else value.dtype
    if mode is None:
        stand_in = torch.empty(value.shape, dtype=kind, device="meta")
    elif device == "meta":
        stand_in = mode.from_tensor(torch.empty(value.shape, dtype=kind, device="meta"))
    else:
        with mode:
            stand_in = torch.empty(value.shape, dtype=kind, device=device)
    return stand_in.requires_grad_(value.requires_grad)


def _tensor_bytes(value: object, resident: Mapping[int, object]) -> int:
    """Bytes of the tensors in a (nested) value, skipping parameters and buffers."""
    return sum(
        t.numel() * t.element_size()
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in resident
    )


# ----------------------------------------------------------------------------------------------- hooks


@contextmanager
def _io_hooks(
    model: nn.Module, tallies: dict[str, Tally], scope: Scope, resident: dict[int, object]
) -> Iterator[None]:
    """Track the running layer and record each layer's input and output bytes and output width.

    An input storage is charged to the first layer it enters: tensors every block receives (Hugging Face's mask
    and rotary ``position_embeddings``) are held once, however many checkpointed blocks keep them."""
    handles = []
    inputs_seen: dict[int, object] = {}  # storage id -> storage (the reference keeps ids unique)
    for fqn in tallies:
        if fqn == LOSS:
            continue
        module = model.get_submodule(fqn)

        def pre(_m: nn.Module, args: tuple, kwargs: dict, fqn: str = fqn) -> None:
            scope.stack.append(fqn)
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            tallies[fqn].input_bytes += _tensor_bytes(tensors, ChainMap(inputs_seen, resident))
            inputs_seen.update((id(t.untyped_storage()), t.untyped_storage()) for t in tensors)

        def post(_m: nn.Module, _args: tuple, output: object, fqn: str = fqn) -> None:
            scope.stack.pop()
            tallies[fqn].output_bytes += _tensor_bytes(output, resident)
            first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
            tallies[fqn].output_width = first.shape[-1] if first is not None and first.dim() >= 2 else 0

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _finalize(
    tallies: dict[str, Tally], ledger: Ledger, forward: dict, total: dict, *, root: str, replayed: dict[str, str],
    partly_replayed: set[str], regions: RegionMarks, linear_inputs: Callable[[str], list[tuple[int, int]]],
) -> None:
    """Per-layer FLOPs from FlopCounterMode's per-module counts (backward = total - forward snapshot), selective
    bytes from the ledger; replayed blocks copy their representative; glue goes to the first layer; the loss is
    what ran outside the root."""

    def flops(counts: dict, key: str) -> int:
        return sum(counts.get(key, {}).values())

    layers = [fqn for fqn in tallies if fqn != LOSS]
    kept = ledger.selective_bytes()
    charged: dict[str, dict[int, int]] = {}
    for key, layer in ledger.owner.items():
        charged.setdefault(layer, {})[key] = ledger.nbytes[key]
    for fqn in layers:
        tally = tallies[fqn]
        tally.forward_flops = flops(forward, f"{root}.{fqn}")
        tally.backward_flops = flops(total, f"{root}.{fqn}") - tally.forward_flops
        tally.core_flops = sum(forward.get(f"{root}.{fqn}", {}).get(op, 0) for op in CORE_OPS)
        if fqn in partly_replayed:  # a replayed element's matmuls are not seen one by one: not measured
            tally.mm_calls, tally.addmm_output_bytes, tally.linear_flops = [], 0, 0
            tally.fused_gate_saving_bytes = 0  # its replayed elements' gates were not seen: none known
        experts = _expert_keys(total, f"{root}.{fqn}")
        tally.expert_forward_flops = sum(flops(forward, key) for key in experts)
        tally.expert_backward_flops = sum(flops(total, key) for key in experts) - tally.expert_forward_flops
        if tally.saved_bytes_selective is not None:
            tally.saved_bytes_selective = kept.get(fqn, 0)
        tally.region_saved_bytes = regions.saved_bytes(fqn, charged.get(fqn, {}), gated=ledger.gated)
        tally.region_linear_input_bytes = regions.bytes_made(linear_inputs(fqn))
        tally.region_flops = {region: sum(flops(forward, f"{root}.{name}") for name in names)
                              for region, names in regions.region_modules(fqn).items()}
        if fqn in partly_replayed:  # the replayed experts' storages were not made here, so not marked: not measured
            for figures in (tally.region_saved_bytes, tally.region_linear_input_bytes, tally.region_flops):
                figures.update(dict.fromkeys(("mlp", "shared_experts", "moe_act"), 0))
    glue_fwd = flops(forward, root) - sum(tallies[fqn].forward_flops for fqn in layers)
    loss_bwd = flops(total, LOSS_SCOPE) - flops(forward, LOSS_SCOPE)
    model_bwd = flops(total, "Global") - flops(forward, "Global") - loss_bwd  # not the root's scope: see _TesseraLoss
    glue_bwd = model_bwd - sum(tallies[fqn].backward_flops for fqn in layers)
    for fqn, rep in replayed.items():
        measured = tallies[rep]
        tallies[fqn] = replace(measured, input_bytes=tallies[fqn].input_bytes, output_bytes=tallies[fqn].output_bytes)
    tallies[layers[0]].forward_flops += glue_fwd
    tallies[layers[0]].backward_flops += glue_bwd
    tallies[LOSS].forward_flops = flops(forward, "Global") - flops(forward, root)
    tallies[LOSS].backward_flops = loss_bwd


def _expert_keys(counts: dict, prefix: str) -> set[str]:
    """FlopCounterMode module keys of the routed experts under ``prefix``: ``...experts`` (packed) or
    ``...experts.<i>`` (a ModuleList), the outermost of each, so every op counts once."""
    found = set()
    for key in counts:
        if not key.startswith(prefix + "."):
            continue
        parts = key[len(prefix) + 1 :].split(".")
        if "experts" in parts:
            end = parts.index("experts") + 1
            end += end < len(parts) and parts[end].isdigit()
            found.add(f"{prefix}.{'.'.join(parts[:end])}")
    return found
