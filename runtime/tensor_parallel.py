"""Tensor (and sequence) parallelism: DTensor ``parallelize_module`` styles for each planned layer of any model.

Megatron-LM's split (Shoeybi et al. 2019): in every block, the linears that read the residual stream are
*column*-parallel (output features sharded over ``tp``) and the linear that writes back to it is
*row*-parallel (input features sharded; its partial sums are all-reduced). Attention splits by heads, so each rank
runs its ``heads / tp`` local heads; the MLP splits its hidden width. How each planned layer is split, by ``kind``:

- ``embedding``: every ``nn.Embedding`` in it whose forward takes the indices first is
  vocabulary-parallel (``RowwiseParallel``: rows sharded, each rank looks up the tokens it owns, the partial rows
  are all-reduced to a replicated output); one with its own forward taking something else first (OPT's learned
  positions, called with the attention mask) or doing its own vocabulary-parallel lookup on a local weight
  (torchtitan's ``Embedding``, which needs torchtitan's runtime for its partial output) is kept whole. A plan's ``replicated`` keeps any embedding whole.
- ``block``: each linear's style comes from ``cost_models.tp_rules.block_splits``: the user's ``tp_plan``, else the
  plan the model declares (Hugging Face ``base_model_tp_plan``), else the caller's pairs, else the module tree
  (fused ``q|k|v`` and ``gate|up`` projections packed, Hugging Face ``Conv1D`` included). They become
  :class:`~tessera.runtime.tp_styles.ColumnSplit` / :class:`~tessera.runtime.tp_styles.RowSplit`. An attention
  whose heads are split gets its local head counts (``tp_rules.localise_attention``). Norms and the router of a
  mixture-of-experts layer stay replicated (every rank routes the same tokens; each expert is a pair like the
  dense MLP, as Megatron-Core splits experts, unless the experts are folded onto their own grid and stay whole:
  ``MoELayer.tp_whole_linears``, ``runtime.expert_parallel``). Any other parameter in a block is refused by name.
- ``norm``: replicated (sequence-parallel with ``sp``). A norm inside an attention whose heads are split (Qwen3's
  per-head ``q_norm``/``k_norm``, Hugging Face's ``replicated_with_grad_allreduce``) runs on the local heads and its
  weight gradient is summed over tp (the sequence-parallel style's ``Partial`` gradient); one normalising across
  heads (OLMo 2's ``q_norm``) is refused.
- ``head``: a linear split column-wise over the vocabulary. Its output stays sharded, ``(B, T, V / tp)`` per
  rank, and :class:`VocabParallelLoss` computes the cross-entropy with ``loss_parallel``: no rank ever
  materialises the full logits.
- ``other``: must hold no parameters.

Sequence parallelism (Korthikanti et al. 2022): between blocks the residual stream is sharded over the
sequence, ``(B, T / tp, H)`` per rank; norms run on the local tokens (``SequenceParallel``, local outputs, so a
norm's output may be added to the residual stream, as Gemma 2's post-norms are); before a module's column linears
the sequence is all-gathered (one hook on the module that holds them, e.g. ``attn``) and the row linear
reduce-scatters back onto the sequence instead of all-reducing. The embedding's output is replicated and the first
layer after it keeps its own slice of the sequence; the head all-gathers it again.

Tied weights (a head sharing the embedding's matrix: GPT-2, Gemma, OPT) stay tied: both are sharded on the
vocabulary (dim 0) and the head is given the embedding's parameter object again.
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

from tessera.cost_models.tp_rules import (
    COLUMN_STYLES,
    REPLICATED_STYLES,
    ROW_STYLES,
    LinearSplit,
    block_splits,
    check_plan,
    check_plan_matches,
    declared_tp_plan,
    derive_pairs,
    head_dim_of,
    is_norm,
    kv_groups,
    linear_dims,
    localise_attention,
    moe_containers,
    moe_parts,
    plan_style,
    attention_of,
    head_norm_problem,
    head_norms,
    head_split_attentions,
    uncovered_parameter,
)
from tessera.cost_models.layer_stats import LinearPair
from tessera.cost_models.tp_embeddings import embedding_kept_whole, tied_parameters
from tessera.errors import NotModelledError
from tessera.models.moe import MoELayer
from tessera.runtime.hf_experts import ShardedExperts, check_experts_tensor_parallel
from tessera.planner.plan import PlannedLayer
from tessera.runtime.tp_sequence import (
    SEQUENCE_DIM,
    TOKEN_DIM,
    add_sequence_hooks,
    check_head_follows_on_its_stage,
    check_sequence_parallel,
    sequence_entry,
    sequence_sharded,
)
from tessera.runtime.tp_experts import split_moe_container
from tessera.runtime.tp_styles import ColumnSplit, RowSplit, check_local_heads

__all__ = ["apply_tensor_parallel", "check_sequence_parallel", "check_tensor_parallel",
           "find_linear_pairs", "layer_styles", "resolve_tp_plan", "sequence_entry", "VocabParallelLoss"]

Styles = dict[str, ParallelStyle]
TpPlan = Mapping[str, str]
"""Module glob (``*`` = one FQN component, relative to the root model) -> style name (``cost_models.tp_rules``)."""


def apply_tensor_parallel(
    model: nn.Module,
    layers: Sequence[PlannedLayer],
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    sequence_entry: str | None = None,
    pairs: Mapping[str, tuple[LinearPair, ...]] | None = None,
    tp_plan: TpPlan | None = None,
) -> None:
    """Shard ``layers`` of ``model`` (in place) over the 1-D tensor-parallel ``mesh``.

    ``layers`` are this rank's planned layers (``loss`` is skipped); ``sequence_entry`` is the model's first
    layer after the embeddings (:func:`sequence_entry` of the whole plan; with ``sequence_parallel`` the
    sequence is split where it enters that layer, if this rank holds it); ``pairs`` optionally maps a block's
    FQN to its column/row pairs; ``tp_plan`` (module glob -> style, Hugging Face's vocabulary) overrides what the
    model declares. Raises ``NotModelledError`` naming the first layer or parameter that cannot be split, before
    anything is sharded.
    """
    tp = mesh.size()
    layers = [layer for layer in layers if layer.kind != "loss"]
    plan = resolve_tp_plan(model, tp_plan)
    ties = tied_parameters(model)
    sharded = sequence_sharded(layers, sequence_entry) if sequence_parallel else set()
    plans = {layer.fqn: layer_styles(model, layer, tp=tp, sp=layer.fqn in sharded, pairs=(pairs or {}).get(layer.fqn),
                                     tp_plan=plan) for layer in layers}
    for fqn, styles in plans.items():
        if styles:
            parallelize_module(model.get_submodule(fqn), mesh, styles)
    for layer in layers:
        if layer.kind == "block":
            block = model.get_submodule(layer.fqn)
            for name, styles in _moe_styles(layer.fqn, block, tp=tp, tp_plan=plan).items():
                split_moe_container(block.get_submodule(name), mesh, styles, sp=layer.fqn in sharded)
    for attention in _head_split_attentions(model, layers, plans):
        localise_attention(attention, tp)
    if sequence_parallel:
        add_sequence_hooks(model, layers, mesh, plans, entry=sequence_entry)
    _retie(model, ties, [layer.fqn for layer in layers])


def check_tensor_parallel(
    model: nn.Module, layers: Sequence[PlannedLayer], *, tp: int, sp: bool,
    pairs: Mapping[str, tuple[LinearPair, ...]] | None = None, tp_plan: TpPlan | None = None,
) -> None:
    """Raise ``NotModelledError`` naming the first layer of ``layers`` that ``tp`` cannot split.

    Run it on every rank over the WHOLE plan before anything is sharded or freed: a layer only another
    pipeline rank runs must fail here too, or this rank would wait forever for its failed peer.
    """
    fqns = [layer.fqn for layer in layers if layer.kind != "loss"]
    names: dict[int, list[str]] = {}  # a tied parameter is covered by any of its names (BART's model.shared)
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for aliases in names.values():
        if not any(alias.startswith(f"{fqn}.") for alias in aliases for fqn in fqns):
            raise NotModelledError(
                f"parameter {aliases[0]} belongs to no planned layer, so tensor parallelism does not know how to split "
                "it; re-plan this model (its layers must cover every parameter) or plan it with tp=1"
            )
    plan = resolve_tp_plan(model, tp_plan)
    sharded = sequence_sharded(layers, sequence_entry(layers)) if sp else set()
    for layer in layers:
        if layer.kind != "loss":
            layer_styles(model, layer, tp=tp, sp=layer.fqn in sharded, pairs=(pairs or {}).get(layer.fqn), tp_plan=plan)
        if layer.kind == "block":
            _moe_styles(layer.fqn, model.get_submodule(layer.fqn), tp=tp, tp_plan=plan)
    if sp:
        check_head_follows_on_its_stage(layers)


def resolve_tp_plan(model: nn.Module, tp_plan: TpPlan | None) -> dict[str, str]:
    """The user's ``tp_plan`` (its styles checked), else the plan the model declares (``{}`` if none)."""
    if tp_plan is not None:
        check_plan(tp_plan)
        check_plan_matches(tp_plan, model)
        return dict(tp_plan)
    return declared_tp_plan(model)


def layer_styles(
    model: nn.Module, layer: PlannedLayer, *, tp: int, sp: bool, pairs: tuple[LinearPair, ...] | None,
    tp_plan: TpPlan | None = None,
) -> Styles:
    """The ``parallelize_module`` plan (relative FQN -> style) for one planned layer; ``sp``: the layer is in the
    sequence-sharded region (from the first block to the layer before the head)."""
    module = model.get_submodule(layer.fqn)
    if layer.kind == "embedding":
        return _embedding_styles(layer.fqn, module, tp, tp_plan or {})
    if layer.kind == "block":
        splits = block_splits(module, layer.fqn, plan=tp_plan, pairs=pairs, skip=replicated_modules(module))
        return _block_styles(layer.fqn, module, splits, tp=tp, sp=sp)
    if layer.kind == "norm" and is_norm(module):
        return {"": _sequence_parallel()} if sp else {}
    if layer.kind == "head" and isinstance(module, nn.Linear):
        _check_divisible(f"{layer.fqn} (vocabulary {module.out_features})", module.out_features, tp)
        # the sequence is gathered where it leaves the layer before (root code may reshape it: GPT-2's view)
        return {"": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)}
    _require_no_parameters(layer, module)
    return {}


def _sequence_parallel() -> SequenceParallel:
    """A norm on the local tokens whose output is a plain tensor (it may meet the plain residual stream)."""
    return SequenceParallel(sequence_dim=TOKEN_DIM, use_local_output=True)


def _embedding_styles(fqn: str, module: nn.Module, tp: int, plan: TpPlan) -> Styles:
    styles: Styles = {}
    kept: set[str] = set()
    for name, child in module.named_modules():
        if not isinstance(child, nn.Embedding):
            continue
        if embedding_kept_whole(child, plan_style(plan, _join(fqn, name))):
            kept.add(name)
            continue
        _check_divisible(f"{_join(fqn, name)} ({child.num_embeddings} rows)", child.num_embeddings, tp)
        styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    _require_covered(fqn, module, set(styles) | kept)
    return styles


def find_linear_pairs(block: nn.Module) -> tuple[LinearPair, ...]:
    """Column/row pairs read off the module tree (``cost_models.tp_rules.derive_pairs``), routers left out."""
    return derive_pairs(block, skip=replicated_modules(block))


def _block_styles(fqn: str, block: nn.Module, splits: Sequence[LinearSplit], *, tp: int, sp: bool) -> Styles:
    styles: Styles = {}
    for split in splits:
        _check_split(fqn, block, split, tp)
        row_output = Shard(_sequence_dim(split.role)) if sp else Replicate()
        if split.style in COLUMN_STYLES:
            gathered_by_container = sp and _container_of(split.name) != ""
            column_input = Shard(_sequence_dim(split.role)) if sp and not gathered_by_container else Replicate()
            styles[split.name] = ColumnSplit(parts=split.parts, input_layouts=column_input,
                                             gather_output=split.style == "colwise_gather_output")
        elif split.style in ROW_STYLES:
            split_input = split.style == "rowwise_split_input"
            styles[split.name] = RowSplit(input_layouts=Replicate() if split_input else None, output_layouts=row_output)
    kept = {split.name for split in splits if split.style in REPLICATED_STYLES}
    norms = [name for name, child in block.named_modules() if name and is_norm(child)]
    replicated = replicated_modules(block)
    if sp and replicated:
        raise NotModelledError(f"sequence parallelism through the mixture-of-experts layer of {fqn} is not "
                               "implemented (experts see a dispatch buffer, not a sequence); plan with sp=false")
    # a norm of the local heads (Qwen3's q_norm) sums its weight gradient over tp, as a sequence-parallel one does
    styles.update({name: _sequence_parallel() for name in (norms if sp else head_norms(block, splits))})
    _require_covered(fqn, block, set(styles) | set(norms) | set(replicated) | kept | set(moe_containers(block)))
    _check_heads(fqn, block, splits, tp)
    return styles


def _moe_styles(fqn: str, block: nn.Module, *, tp: int, tp_plan: TpPlan | None) -> dict[str, Styles]:
    """Each MoE container of ``block`` (``tp_rules.moe_containers``, relative name) -> the styles of its shared
    experts (relative to it: column/row pairs, outputs whole); raises ``NotModelledError`` if tp cannot split its
    experts. Routers and gates get no style: they stay whole (``runtime.tp_experts``)."""
    found: dict[str, Styles] = {}
    for name in moe_containers(block):
        container, where = block.get_submodule(name), _join(fqn, name)
        if not isinstance(container.experts, ShardedExperts):  # split over (ep, tp) already: checked before
            check_experts_tensor_parallel({_join(where, "experts"): container.experts}, tp)
        styles: Styles = {}
        for shared in moe_parts(container).shared:
            child, child_fqn = container.get_submodule(shared), _join(where, shared)
            splits = block_splits(child, child_fqn, plan=tp_plan)
            styles.update({_join(shared, k): v for k, v in _block_styles(child_fqn, child, splits, tp=tp, sp=False).items()})
        found[name] = styles
    return found


def _sequence_dim(role: str) -> int:
    return SEQUENCE_DIM if role == "attention" else TOKEN_DIM


def replicated_modules(block: nn.Module) -> list[str]:
    """Linears a block keeps whole on every tensor-parallel rank: the routers of its mixture-of-experts layers, and
    the experts of a layer that places them on its own expert mesh (``MoELayer.tp_whole_linears``)."""
    return [_join(name, linear) for name, child in block.named_modules() if isinstance(child, MoELayer)
            for linear in child.tp_whole_linears()]


def _check_split(fqn: str, block: nn.Module, split: LinearSplit, tp: int) -> None:
    dims = linear_dims(block.get_submodule(split.name))
    if dims is None:
        raise NotModelledError(f"{fqn}.{split.name} is a {type(block.get_submodule(split.name)).__name__}, not a "
                               "linear (nn.Linear or Conv1D); tensor parallelism splits only linears")
    if split.style not in COLUMN_STYLES | ROW_STYLES | REPLICATED_STYLES:
        raise NotModelledError(f"{fqn}.{split.name}: style {split.style!r} does not apply to a linear in a block; "
                               "use colwise, packed_colwise, colwise_gather_output, rowwise, rowwise_split_input "
                               "or replicated")
    features = dims[1] // split.parts if split.style in COLUMN_STYLES else dims[0]
    what = "output features per packed block" if split.parts > 1 else (
        "output features" if split.style in COLUMN_STYLES else "input features")
    if split.style not in REPLICATED_STYLES:
        _check_divisible(f"{fqn}.{split.name} ({features} {what})", features, tp)


def _check_heads(fqn: str, block: nn.Module, splits: Sequence[LinearSplit], tp: int) -> None:
    """Head-split columns of an attention: whole heads per rank, and a forward that finds its local heads."""
    problem = head_norm_problem(block, fqn, splits)
    if problem is not None:
        raise NotModelledError(problem)
    for container in head_split_attentions(block, splits):
        attention = block.get_submodule(container)
        head_dim = head_dim_of(attention)
        check_local_heads(_join(fqn, container), attention)
        columns = [s for s in splits if s.style in ("colwise", "packed_colwise") and attention_of(block, s.name) == container]
        for index, split in enumerate(columns):
            out = linear_dims(block.get_submodule(split.name))[1]
            groups = kv_groups(block.get_submodule(_container_of(split.name)), out)
            heads = groups or out // split.parts // head_dim
            if heads % tp:
                what = "key/value groups" if groups else "query heads" if index == 0 and split.parts == 1 else (
                    "heads per packed block" if split.parts > 1 else "key/value heads (grouped-query attention)")
                raise NotModelledError(f"{fqn}.{split.name} has {heads} {what}, not divisible by tp={tp}; plan with "
                                       f"a tp that divides {heads}")


def _head_split_attentions(model: nn.Module, layers: Sequence[PlannedLayer], plans: dict[str, Styles]) -> list[nn.Module]:
    found = []
    for layer in layers:
        if layer.kind != "block":
            continue
        block = model.get_submodule(layer.fqn)
        splits = [LinearSplit(name, "packed_colwise" if style.parts > 1 else "colwise")
                  for name, style in plans[layer.fqn].items() if isinstance(style, ColumnSplit) and not style.gather_output]
        found += [block.get_submodule(name) for name in head_split_attentions(block, splits)]
    return found


def _check_divisible(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise NotModelledError(f"{what} is not divisible by tp={tp}; plan with a tp that divides {size}")


def _require_covered(fqn: str, module: nn.Module, styled: set[str]) -> None:
    problem = uncovered_parameter(module, fqn, styled)
    if problem is not None:
        raise NotModelledError(problem)


def _require_no_parameters(layer: PlannedLayer, module: nn.Module) -> None:
    name = next((n for n, _ in module.named_parameters()), None)
    if name is not None:
        raise NotModelledError(
            f"layer {layer.fqn} (kind {layer.kind}, {type(module).__name__}) has parameters ({_join(layer.fqn, name)}) "
            "but no known tensor-parallel sharding; plan this model with tp=1"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _container_of(name: str) -> str:
    return name.rpartition(".")[0]


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


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]], planned: Sequence[str]) -> None:
    """Make each tied group one parameter again after sharding: the owners inside ``planned`` layers (which were
    split) must agree; an owner outside them (BART's ``model.shared``, an alias of the embeddings) takes theirs."""
    for group in ties:
        values = [(fqn, name, getattr(model.get_submodule(fqn), name)) for fqn, name in group]
        deciding = [value for value in values if any(value[0] == p or value[0].startswith(f"{p}.") for p in planned)]
        first_fqn, first_name, shared = (deciding or values)[0]
        for fqn, name, current in deciding[1:]:
            split_alike = isinstance(current, DTensor) == isinstance(shared, DTensor)
            if not split_alike or (isinstance(current, DTensor) and current.placements != shared.placements):
                raise NotModelledError(f"tied parameters {first_fqn}.{first_name} and {fqn}.{name} are split "
                                       "differently by tensor parallelism; untie them or plan with tp=1")
        for fqn, name, _ in values:
            setattr(model.get_submodule(fqn), name, shared)
