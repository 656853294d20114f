"""Tensor (and sequence) parallelism: DTensor ``parallelize_module`` styles derived from the model's structure.

Megatron-LM's split (Shoeybi et al. 2019): in every block, the linears that read the residual stream are
*column*-parallel (output features sharded over ``tp``) and the linear that writes back to it is
*row*-parallel (input features sharded; its partial sums are all-reduced). Attention splits by heads, so the
model must reshape with ``-1`` heads (it then runs on ``heads / tp`` local heads); the MLP splits its hidden
width. How each planned layer is split, by ``kind``:

- ``embedding``: every ``nn.Embedding`` in it is vocabulary-parallel (``RowwiseParallel``: the table's rows are
  sharded, each rank looks up the tokens it owns, the partial rows are all-reduced to a replicated output).
- ``block``: its column/row linear pairs (``LinearPair``) come from the caller (capture's data-flow analysis,
  ``LayerStats.tp_pairs``) when given, else from the module tree (:func:`find_linear_pairs`). Norms and the
  router of a mixture-of-experts layer stay replicated (every rank routes the same tokens; each expert is a
  pair like the dense MLP, as Megatron-Core splits experts). Any other parameter in a block is refused by
  name: we do not know how to split it.
- ``norm``: replicated (sequence-parallel with ``sp``).
- ``head``: a linear split column-wise over the vocabulary. Its output stays sharded, ``(B, T, V / tp)`` per
  rank, and :class:`VocabParallelLoss` computes the cross-entropy with ``loss_parallel``: no rank ever
  materialises the full logits.
- ``other``: must hold no parameters.

Sequence parallelism (Korthikanti et al. 2022): between blocks the residual stream is sharded over the
sequence, ``(B, T / tp, H)`` per rank; norms run on the local tokens (``SequenceParallel``); before a pair's
column linears the sequence is all-gathered (one hook on the module that holds the pair, e.g. ``attn``) and the
row linear reduce-scatters back onto the sequence instead of all-reducing. The embedding's output is
replicated and the first layer after it keeps its own slice of the sequence; the head all-gathers it again.

Tied weights (a head sharing the embedding's matrix) stay tied: both are sharded on the vocabulary (dim 0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tessera.cost_models.types import LinearPair, runtime_splits
from tessera.errors import ConfigError, NotModelledError
from tessera.models.moe import MoELayer
from tessera.planner.plan import PlannedLayer

NORMS = (nn.LayerNorm, nn.RMSNorm)
SEQUENCE_DIM = 1
"""Sequence dimension of activations ``(B, T, H)``."""
Styles = dict[str, ParallelStyle]


def is_norm(module: nn.Module) -> bool:
    """A per-token normalisation: ``LayerNorm``/``RMSNorm``, or a class named ``...Norm`` (``LlamaRMSNorm``)."""
    return isinstance(module, NORMS) or type(module).__name__.lower().endswith("norm")


def apply_tensor_parallel(
    model: nn.Module,
    layers: Sequence[PlannedLayer],
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    sequence_entry: str | None = None,
    pairs: Mapping[str, tuple[LinearPair, ...]] | None = None,
) -> None:
    """Shard ``layers`` of ``model`` (in place) over the 1-D tensor-parallel ``mesh``.

    ``layers`` are this rank's planned layers (``loss`` is skipped); ``sequence_entry`` is the model's first
    layer after the embeddings (:func:`sequence_entry` of the whole plan; with ``sequence_parallel`` the
    sequence is split where it enters that layer, if this rank holds it); ``pairs`` optionally maps a block's
    FQN to its column/row pairs. Raises ``NotModelledError`` naming the first layer or parameter that cannot
    be split, before anything is sharded.
    """
    tp = mesh.size()
    layers = [layer for layer in layers if layer.kind != "loss"]
    ties = _tied_parameters(model)
    plans = {layer.fqn: layer_styles(model, layer, tp=tp, sp=sequence_parallel, pairs=(pairs or {}).get(layer.fqn))
             for layer in layers}
    for fqn, styles in plans.items():
        if styles:
            parallelize_module(model.get_submodule(fqn), mesh, styles)
    if sequence_parallel:
        _add_sequence_hooks(model, layers, mesh, plans, entry=sequence_entry)
    _retie(model, ties)


def check_tensor_parallel(
    model: nn.Module, layers: Sequence[PlannedLayer], *, tp: int, sp: bool,
    pairs: Mapping[str, tuple[LinearPair, ...]] | None = None,
) -> None:
    """Raise ``NotModelledError`` naming the first layer of ``layers`` that ``tp`` cannot split.

    Run it on every rank over the WHOLE plan before anything is sharded or freed: a layer only another
    pipeline rank runs must fail here too, or this rank would wait forever for its failed peer.
    """
    fqns = [layer.fqn for layer in layers if layer.kind != "loss"]
    for name, _ in model.named_parameters():
        if not any(name.startswith(f"{fqn}.") for fqn in fqns):
            raise NotModelledError(
                f"parameter {name} belongs to no planned layer, so tensor parallelism does not know how to split "
                "it; re-plan this model (its layers must cover every parameter) or plan it with tp=1"
            )
    for layer in layers:
        if layer.kind != "loss":
            layer_styles(model, layer, tp=tp, sp=sp, pairs=(pairs or {}).get(layer.fqn))


def layer_styles(
    model: nn.Module, layer: PlannedLayer, *, tp: int, sp: bool, pairs: tuple[LinearPair, ...] | None
) -> Styles:
    """The ``parallelize_module`` plan (relative FQN -> style) for one planned layer."""
    module = model.get_submodule(layer.fqn)
    if layer.kind == "embedding":
        return _embedding_styles(layer.fqn, module, tp)
    if layer.kind == "block":
        return _block_styles(layer.fqn, module, tp=tp, sp=sp, pairs=pairs or find_linear_pairs(module))
    if layer.kind == "norm" and is_norm(module):
        return {"": SequenceParallel()} if sp else {}
    if layer.kind == "head" and isinstance(module, nn.Linear):
        _check_divisible(f"{layer.fqn} (vocabulary {module.out_features})", module.out_features, tp)
        first = Shard(SEQUENCE_DIM) if sp else Replicate()
        return {"": ColwiseParallel(input_layouts=first, output_layouts=Shard(-1), use_local_output=True)}
    _require_no_parameters(layer, module)
    return {}


def _embedding_styles(fqn: str, module: nn.Module, tp: int) -> Styles:
    styles: Styles = {}
    for name, child in module.named_modules():
        if isinstance(child, nn.Embedding):
            _check_divisible(f"{_join(fqn, name)} ({child.num_embeddings} rows)", child.num_embeddings, tp)
            styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    _require_covered(fqn, module, set(styles))
    return styles


def find_linear_pairs(block: nn.Module) -> tuple[LinearPair, ...]:
    """Column/row pairs read off the module tree: in each module holding ``nn.Linear`` children, the last
    one (in registration order) is the row and the others are its columns; the pair is ``attention`` when
    that module has an integer ``head_dim`` (GPT, Llama, Hugging Face attention), else ``mlp``.

    Registration order is only a heuristic for execution order; :func:`check_pair` verifies the shapes
    (columns read the width the row writes; the row reads what the first column writes) so a fused or
    reordered projection is refused rather than split wrongly.
    """
    found = []
    routers = set(replicated_modules(block))
    for name, container in block.named_modules():
        linears = [child_name for child_name, child in container.named_children()
                   if runtime_splits("tp", type(child)) and _join(name, child_name) not in routers]
        if linears:
            role = "attention" if isinstance(getattr(container, "head_dim", None), int) else "mlp"
            names = [_join(name, child_name) for child_name in linears]
            found.append(LinearPair(column=tuple(names[:-1]), row=names[-1], role=role))
    return tuple(found)


def _block_styles(fqn: str, block: nn.Module, *, tp: int, sp: bool, pairs: tuple[LinearPair, ...]) -> Styles:
    styles: Styles = {}
    row_output = Shard(SEQUENCE_DIM) if sp else Replicate()
    width = residual_width(block)
    for pair in pairs:
        check_pair(fqn, block, pair, tp, width=width)
        gathered_by_container = sp and _pair_container(pair) != ""
        column_input = Shard(SEQUENCE_DIM) if sp and not gathered_by_container else Replicate()
        styles.update({name: ColwiseParallel(input_layouts=column_input) for name in pair.column})
        styles[pair.row] = RowwiseParallel(output_layouts=row_output)
    norms = [name for name, child in block.named_modules() if name and is_norm(child)]
    replicated = replicated_modules(block)
    if sp and replicated:
        raise NotModelledError(f"sequence parallelism through the mixture-of-experts layer of {fqn} is not "
                               "implemented (experts see a dispatch buffer, not a sequence); plan with sp=false")
    if sp:
        styles.update({name: SequenceParallel() for name in norms})
    _require_covered(fqn, block, set(styles) | set(norms) | set(replicated))
    return styles


def replicated_modules(block: nn.Module) -> list[str]:
    """Linears a block keeps whole on every tensor-parallel rank: the routers of its mixture-of-experts layers."""
    return [_join(name, "router") for name, child in block.named_modules() if isinstance(child, MoELayer)]


def residual_width(block: nn.Module) -> int | None:
    """Width of the residual stream a block reads and writes: its norms' size (``None`` without norms)."""
    for module in block.modules():
        weight = getattr(module, "weight", None)
        if is_norm(module) and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return int(weight.shape[0])
    return None


def check_pair(fqn: str, block: nn.Module, pair: LinearPair, tp: int, *, width: int | None = None) -> None:
    """Raise ``NotModelledError`` naming the layer if ``pair`` is not a column/row split ``tp`` can divide.

    Columns must read the width the row writes back (``width``, the residual stream, when known) and the
    row must read what the first column writes.
    """
    row = _linear(fqn, block, pair.row)
    columns = [_linear(fqn, block, name) for name in pair.column]
    shapes = ", ".join(f"{n} ({m.in_features}->{m.out_features})" for n, m in zip((*pair.column, pair.row), (*columns, row)))
    reads = {c.in_features for c in columns} | ({width} if width is not None else set())
    if not columns or reads != {row.out_features} or columns[0].out_features != row.in_features:
        raise NotModelledError(
            f"cannot split {fqn} for tensor parallelism: linears {shapes} are not column linears reading the "
            "width the row linear writes back (a fused or reordered projection?); pass the layer's tp_pairs "
            "or plan it with tp=1"
        )
    if pair.role == "attention":
        _check_heads(fqn, block, pair, columns, tp)
    for name, module in zip(pair.column, columns):
        _check_divisible(f"{fqn}.{name} ({module.out_features} output features)", module.out_features, tp)


def _check_heads(fqn: str, block: nn.Module, pair: LinearPair, columns: list[nn.Linear], tp: int) -> None:
    container = _pair_container(pair)
    head_dim = getattr(block.get_submodule(container), "head_dim", None)
    if not isinstance(head_dim, int):
        raise NotModelledError(
            f"cannot split attention {_join(fqn, container)} by heads: it has no integer head_dim attribute"
        )
    for name, module in zip(pair.column, columns):
        heads = module.out_features // head_dim
        if heads % tp:
            what = "query heads" if module is columns[0] else "key/value heads (grouped-query attention)"
            raise NotModelledError(
                f"{fqn}.{name} has {heads} {what}, not divisible by tp={tp}; plan with a tp that divides {heads}"
            )


def _pair_container(pair: LinearPair) -> str:
    """The module holding all of a pair's linears, relative to the block ('' if the block itself)."""
    parents = {name.rpartition(".")[0] for name in (*pair.column, pair.row)}
    return parents.pop() if len(parents) == 1 else ""


def _linear(fqn: str, block: nn.Module, name: str) -> nn.Linear:
    module = block.get_submodule(name)
    if not runtime_splits("tp", type(module)):  # the rule capture checks too (cost_models.types.RUNTIME_SPLITS)
        raise NotModelledError(f"{fqn}.{name} is a {type(module).__name__}, not nn.Linear; tensor parallelism "
                               "splits only nn.Linear pairs")
    return module


def _check_divisible(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise NotModelledError(f"{what} is not divisible by tp={tp}; plan with a tp that divides {size}")


def _require_covered(fqn: str, module: nn.Module, styled: set[str]) -> None:
    for name, _ in module.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(owner == s or owner.startswith(f"{s}.") or s == "" for s in styled):
            raise NotModelledError(
                f"tensor parallelism does not know how to split parameter {_join(fqn, name)} (owned by "
                f"{type(module.get_submodule(owner)).__name__}); only linear pairs, embeddings, norms and the head "
                "are split; plan this model with tp=1"
            )


def _require_no_parameters(layer: PlannedLayer, module: nn.Module) -> None:
    name = next((n for n, _ in module.named_parameters()), None)
    if name is not None:
        raise NotModelledError(
            f"layer {layer.fqn} (kind {layer.kind}, {type(module).__name__}) has parameters ({_join(layer.fqn, name)}) "
            "but no known tensor-parallel sharding; plan this model with tp=1"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# ------------------------------------------------------------------------------------------ sequence parallelism


def check_sequence_parallel(seq_len: int, tp: int) -> None:
    """Sequence parallelism shards ``(B, T, H)`` activations evenly over ``T``."""
    if seq_len % tp:
        raise ConfigError(f"sequence parallelism needs seq_len={seq_len} divisible by tp={tp}; pick another seq_len or sp=false")


def sequence_entry(layers: Sequence[PlannedLayer]) -> str | None:
    """FQN of the first block (else norm or head): where the replicated residual stream is split over the
    sequence. Parameter-free ``other`` layers (a rotary-embedding module) do not carry the stream."""
    return next((layer.fqn for layer in layers if layer.kind in ("block", "norm", "head")), None)


def _add_sequence_hooks(model: nn.Module, layers: Sequence[PlannedLayer], mesh: DeviceMesh, plans: dict[str, Styles],
                        *, entry: str | None) -> None:
    """Scatter the sequence entering ``entry`` (when this rank holds it); gather it before each pair's columns.

    The scatter hook must run after an activation-checkpoint pre-hook on ``entry`` (apply recomputation
    first): checkpointing then records the replicated input and its recomputation re-runs the scatter,
    instead of scattering an already scattered input a second time.
    """
    if entry in plans:
        model.get_submodule(entry).register_forward_pre_hook(
            _replace_hidden(lambda x: _scatter_sequence(x, mesh)), with_kwargs=True)
    for layer in layers:
        if layer.kind != "block":
            continue
        block = model.get_submodule(layer.fqn)
        columns = [name for name, style in plans[layer.fqn].items() if isinstance(style, ColwiseParallel)]
        for container in {_container_of(name) for name in columns} - {""}:
            block.get_submodule(container).register_forward_pre_hook(
                _replace_hidden(lambda x: _gather_sequence(x, mesh)), with_kwargs=True)


def _container_of(name: str) -> str:
    return name.rpartition(".")[0]


def _replace_hidden(transform: Callable[[torch.Tensor], Any]):
    """A forward pre-hook applying ``transform`` to the hidden states (first positional or ``hidden_states``)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": transform(kwargs["hidden_states"])}
        raise NotModelledError(f"{type(module).__name__} received no positional input or hidden_states keyword to "
                               "shard over the sequence")

    return hook


def _scatter_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Replicated (B, T, H) -> this rank's (B, T / tp, H); backward all-gathers the gradient."""
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(SEQUENCE_DIM)]).to_local()  # (B, T/tp, H)


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Local (B, T / tp, H) -> replicated DTensor (B, T, H); backward reduce-scatters the (partial) gradient."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
    return x.redistribute(mesh, [Replicate()])  # (B, T, H), kept a DTensor for the column linears


# ------------------------------------------------------------------------------------------ loss and tied weights


class VocabParallelLoss:
    """Wraps ``loss_fn(outputs, targets)`` for a vocabulary-parallel head.

    The local ``(B, T, V / tp)`` logits (the output, or its ``logits`` attribute) become a ``DTensor``
    sharded on the vocabulary, so ``F.cross_entropy`` under ``loss_parallel()`` computes the exact loss
    without gathering them. Call it (and ``backward``) inside ``loss_parallel()``. Returns a plain scalar
    tensor (the loss is replicated on every tensor-parallel rank)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mesh: DeviceMesh) -> None:
        self.loss_fn = loss_fn
        self.mesh = mesh

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, torch.Tensor):
            outputs = self._sharded(outputs)
        else:  # a model output object (Hugging Face's ``CausalLMOutput``): shard its ``logits`` in place
            outputs.logits = self._sharded(outputs.logits)
        loss = self.loss_fn(outputs, targets)
        # A copy, not the DTensor's local view: pipelining detaches the loss in place after backward.
        return loss.to_local().clone() if isinstance(loss, DTensor) else loss

    def _sharded(self, local_logits: torch.Tensor) -> DTensor:
        return DTensor.from_local(local_logits, self.mesh, [Shard(-1)], run_check=False)  # (B, T, V) on V


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module FQN, parameter name) that share one parameter object."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((module_fqn, name))
    return [group for group in owners.values() if len({fqn for fqn, _ in group}) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    for (first_fqn, first_name), *others in ties:
        shared = getattr(model.get_submodule(first_fqn), first_name)
        for fqn, name in others:
            current = getattr(model.get_submodule(fqn), name)
            if isinstance(current, DTensor) and isinstance(shared, DTensor) and current.placements != shared.placements:
                raise NotModelledError(f"tied parameters {first_fqn}.{first_name} and {fqn}.{name} are split "
                                       "differently by tensor parallelism; untie them or plan with tp=1")
            setattr(model.get_submodule(fqn), name, shared)
