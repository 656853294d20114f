"""How tensor parallelism splits each linear of a model: one structural rule for the planner and the runtime.

The runtime (``runtime.tensor_parallel``) applies what this module decides, and capture
(``planner.capabilities``) asks it whether tp is available for a model at all, so the two cannot disagree. It reads
module trees and declared plans only (no graph, no process group, no tp degree: divisibility is the caller's check).

Where a block's split comes from, first found wins:

1. a **plan** mapping module globs to style names (Hugging Face's vocabulary, ``*`` matching one FQN component):
   the user's ``tp_plan=``, else what the model declares (Hugging Face ``config.base_model_tp_plan``, whose
   globs are relative to the base model: they are prefixed with ``base_model_prefix``);
2. column/row pairs the caller passes (capture's data-flow ``LayerStats.tp_pairs``);
3. the module tree (:func:`derive_splits`): the linears (``nn.Linear`` and Hugging Face's ``Conv1D``, whose weight is
   stored ``(in, out)``) of each module form one Megatron pair; a module holding only column linears (torchtitan's
   ``qkv_linear``) joins its parent's. The *row* is the last linear after the first that writes the residual width
   (the block's norm size; without norms, the last linear); the others are its columns. A column writing exactly
   ``parts`` times what the row reads is a packed projection: three equal blocks ``q|k|v`` in an attention (GPT-2's
   ``c_attn``), two ``gate|up`` in an MLP; one in a module declaring ``r_dim`` is laid out per key/value group
   (torchtitan's fused ``wqkv``: plainly column-parallel); anything else that does not match is refused by name.

Mixture-of-experts blocks whose experts are stacked in 3-D parameters (Hugging Face's sparse MoE blocks,
``models.moe.stacked_experts_problem``) are split as a unit, not as linear pairs (:func:`moe_containers`): the
module holding the experts (``mlp``) keeps its router and any other single linear (Qwen2-MoE's
``shared_expert_gate``) whole, splits a shared expert like a dense MLP, and splits every expert over ``tp``
(:func:`expert_tp_dims`: gate/up column-wise, down row-wise, Megatron-Core's expert tensor parallelism); the
experts module's declared ``moe_tp_experts`` style is this split.

Styles used here: ``colwise`` (output features sharded), ``packed_colwise`` (each rank gets the same slice of each
of ``parts`` packed blocks, so its local q/k/v or gate/up stay matched), ``colwise_gather_output`` (sharded
weights, output all-gathered: for a forward that slices its output at fixed offsets, as Phi-3's ``qkv_proj``),
``rowwise`` (input features sharded, partial sums reduced), ``rowwise_split_input`` (the replicated input sliced
locally first), ``replicated`` (kept whole). Others of Hugging Face's vocabulary (``local_*``,
``packed_rowwise``, ...) are refused with their name; ``moe_tp_experts`` names the experts split.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tessera.cost_models.layer_stats import LinearPair
from tessera.errors import ConfigError, NotModelledError
from tessera.models.moe import stacked_experts_problem

COLUMN_STYLES = frozenset({"colwise", "packed_colwise", "colwise_gather_output"})
ROW_STYLES = frozenset({"rowwise", "rowwise_split_input"})
REPLICATED_STYLES = frozenset({"replicated", "replicated_with_grad_allreduce"})
LINEAR_STYLES = COLUMN_STYLES | ROW_STYLES | REPLICATED_STYLES
"""Styles a linear inside a block may have."""
HEAD_SPLIT_STYLES = frozenset({"colwise", "packed_colwise"})
"""Column styles that leave each rank its own heads (not gathered)."""
EMBEDDING_STYLES = frozenset({"embedding_rowwise"})
NORM_STYLES = frozenset({"sequence_parallel"})
MOE_TP_STYLE = "moe_tp_experts"
"""Hugging Face's style name for a stacked experts module split over tp (:func:`expert_tp_dims`; the only split the
runtime applies to one, so a plan naming it changes nothing)."""
STYLES = COLUMN_STYLES | ROW_STYLES | REPLICATED_STYLES | EMBEDDING_STYLES | NORM_STYLES | {MOE_TP_STYLE}
"""Style names a plan may use (the others of Hugging Face's vocabulary are refused by name)."""

PACKED_PARTS = {"attention": 3, "mlp": 2}
"""Equal blocks a packed column holds when its role's modules are fused: q|k|v, gate|up."""


@dataclass(frozen=True)
class LinearSplit:
    """How one linear of a block is split: ``name`` relative to the block, a style of ``STYLES``, and for
    ``packed_colwise`` the number of equal blocks packed along its output."""

    name: str
    style: str
    parts: int = 1
    role: str = "mlp"
    """``attention`` when the linear belongs to a module with an integer ``head_dim``/``head_size`` (heads split)."""


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear: ``nn.Linear``, or Hugging Face's ``Conv1D`` (weight stored (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if is_conv1d(module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's linear with a transposed weight), by class name (no import)."""
    return type(module).__name__ == "Conv1D"


def head_dim_of(module: nn.Module) -> int | None:
    """The per-head width an attention module declares (``head_dim``, or GPT-NeoX's ``head_size``)."""
    for name in ("head_dim", "head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# --------------------------------------------------------------------------------------------------- plans


def declared_tp_plan(model: nn.Module) -> dict[str, str]:
    """The plan a Hugging Face model declares (``config.base_model_tp_plan``), globs made relative to ``model``."""
    declared = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not isinstance(declared, Mapping):
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    if not (isinstance(prefix, str) and prefix and isinstance(getattr(model, prefix, None), nn.Module)):
        prefix = ""
    return {f"{prefix}.{glob}" if prefix else glob: str(style) for glob, style in declared.items()}


def check_plan(plan: Mapping[str, str]) -> None:
    """Raise ``NotModelledError`` naming the first style of ``plan`` the runtime does not apply."""
    for glob, style in plan.items():
        if style not in STYLES:
            raise NotModelledError(
                f"tensor-parallel plan entry {glob!r}: style {style!r} is not implemented (the runtime applies "
                f"{', '.join(sorted(STYLES))}); pass tp_plan= with those styles or plan with tp=1"
            )


def check_plan_matches(plan: Mapping[str, str], model: nn.Module) -> None:
    """Raise ``ConfigError`` naming the entries of a user's ``plan`` that match no module of ``model``: a glob with a
    typo (a missing ``model.`` prefix) would otherwise leave those linears to the declared plan or the module tree."""
    names = [name for name, _ in model.named_modules()]
    unmatched = [glob for glob in plan if not any(_glob(glob).fullmatch(name) for name in names)]
    if unmatched:
        raise ConfigError(f"tp_plan entries {', '.join(repr(g[:80]) for g in unmatched[:3])} match no module of the model "
                          f"(globs match whole dotted names, e.g. {names[-1]!r}, '*' one part); fix them or drop them")


def plan_style(plan: Mapping[str, str], fqn: str) -> str | None:
    """The style ``plan`` gives module ``fqn`` (the first glob matching it whole), or None."""
    return next((style for glob, style in plan.items() if _glob(glob).fullmatch(fqn)), None)


def _glob(pattern: str) -> re.Pattern:
    return re.compile(".".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


# ------------------------------------------------------------------------------------------- a block's splits


def block_splits(
    block: nn.Module, fqn: str, *, plan: Mapping[str, str] | None = None, pairs: Sequence[LinearPair] | None = None,
    skip: Iterable[str] = (),
) -> tuple[LinearSplit, ...]:
    """How each linear of ``block`` (at ``fqn`` in the model) is split; ``skip``: linears kept whole (routers).

    Raises ``NotModelledError`` naming the linear when no rule fits. See the module docstring for the order.
    """
    skip, containers = set(skip), moe_containers(block)
    linears = [name for name, module in block.named_modules() if linear_dims(module) is not None and name not in skip
               and not _inside(name, containers)]
    if plan:
        styled = {name: plan_style(plan, _join(fqn, name)) for name in linears}
        if any(styled.values()):
            return tuple(LinearSplit(name, style, parts=_packed_parts(block, name, styled), role=_role(block, name))
                         for name, style in styled.items() if style)
    if pairs:
        pairs = [pair for pair in pairs if not _inside(pair.row, containers)]
        return tuple(split for pair in pairs for split in _pair_splits(block, fqn, pair))
    skip |= {name for name in linears_of(block) if _inside(name, containers)}
    return tuple(split for pair in derive_pairs(block, skip=skip) for split in _pair_splits(block, fqn, pair))


def linears_of(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_modules() if linear_dims(child) is not None]


def _inside(name: str, containers: Iterable[str]) -> bool:
    return any(name == c or name.startswith(f"{c}.") or c == "" for c in containers)


def _packed_parts(block: nn.Module, name: str, styled: Mapping[str, str | None]) -> int:
    """Blocks a ``packed_colwise`` linear holds: its width over what the row linear beside it reads (2: gate|up)."""
    if styled[name] != "packed_colwise":
        return 1
    parent = name.rpartition(".")[0]
    rows = [other for other, style in styled.items() if style in ROW_STYLES and other.rpartition(".")[0] == parent]
    out = linear_dims(block.get_submodule(name))[1]
    row_in = linear_dims(block.get_submodule(rows[0]))[0] if rows else 0
    return out // row_in if row_in and out % row_in == 0 and out > row_in else PACKED_PARTS["mlp"]


def derive_pairs(block: nn.Module, *, skip: Iterable[str] = ()) -> tuple[LinearPair, ...]:
    """Column/row pairs read off the module tree (see the module docstring, point 3)."""
    skip, width = set(skip), residual_width(block)
    order = {name: index for index, (name, _) in enumerate(block.named_modules())}
    groups: dict[str, list[str]] = {}
    for name, module in block.named_modules():
        if name and name not in skip and linear_dims(module) is not None:
            groups.setdefault(name.rpartition(".")[0], []).append(name)
    for container in sorted(groups, key=lambda c: -c.count(".") - bool(c)):  # deepest first
        if width is not None and container and container in groups and _row_of(block, groups[container], width) is None:
            parent = container.rpartition(".")[0]
            groups[parent] = sorted([*groups.get(parent, []), *groups.pop(container)], key=order.__getitem__)
    pairs = []
    for container in sorted(groups, key=order.__getitem__):
        names = groups[container]
        row = _row_of(block, names, width) or names[-1]
        columns = tuple(name for name in names if name != row)
        pairs.append(LinearPair(column=columns, row=row, role="attention" if _role(block, row) == "attention" else "mlp"))
    return tuple(pairs)


def _row_of(block: nn.Module, names: list[str], width: int | None) -> str | None:
    """The last linear after the first that writes the residual width (with no known width: None)."""
    if width is None or len(names) < 2:
        return None
    return next((n for n in reversed(names[1:]) if linear_dims(block.get_submodule(n))[1] == width), None)


def _pair_splits(block: nn.Module, fqn: str, pair: LinearPair) -> list[LinearSplit]:
    """A pair's columns and row as splits, packed columns found by their width (see the module docstring)."""
    row_in, row_out = _dims(block, fqn, pair.row)
    reads = {_dims(block, fqn, name)[0] for name in pair.column} | {residual_width(block) or row_out}
    if not pair.column or reads != {row_out}:
        shapes = ", ".join(f"{n} ({_dims(block, fqn, n)[0]}->{_dims(block, fqn, n)[1]})" for n in (*pair.column, pair.row))
        inner = next((n for n in pair.column if _dims(block, fqn, n)[0] != row_out), None)
        why = (f"{inner} reads {_dims(block, fqn, inner)[0]} features, not the block's {row_out}: it follows another "
               "linear (a low-rank or latent projection, as in multi-head latent attention), which a column/row split "
               "cannot cut" if inner else "they are not column linears reading the width the row linear writes back")
        raise NotModelledError(f"cannot split {fqn} for tensor parallelism: linears {shapes}: {why}; pass tp_plan= "
                               "naming each linear's style, or plan it with tp=1")
    role = pair.role if pair.role in PACKED_PARTS else "mlp"
    splits = [LinearSplit(pair.row, "rowwise", role=role)]
    for name in pair.column:
        out = _dims(block, fqn, name)[1]
        if out == row_in or (role == "attention" and out < row_in):  # a q/k/v head projection (grouped-query k, v)
            splits.append(LinearSplit(name, "colwise", role=role))
        elif kv_groups(block.get_submodule(name.rpartition(".")[0]), out) is not None:
            splits.append(LinearSplit(name, "colwise", role=role))  # whole key/value groups per rank
        elif out == PACKED_PARTS[role] * row_in:
            splits.append(LinearSplit(name, "packed_colwise", parts=PACKED_PARTS[role], role=role))
        else:
            raise NotModelledError(
                f"cannot split {fqn} for tensor parallelism: {name} ({_dims(block, fqn, name)[0]}->{out}) writes {out} features but "
                f"{_join(fqn, pair.row)} reads {row_in} (a fused projection whose layout the runtime cannot infer); "
                "pass tp_plan= naming its style (e.g. colwise_gather_output) or plan it with tp=1"
            )
    return [*splits[1:], splits[0]]


def kv_groups(module: nn.Module, out: int) -> int | None:
    """Key/value groups of a fused projection laid out group by group, ``(groups, r_dim, head_dim)`` with
    ``r_dim`` = query heads per group + 2 (torchtitan's ``FusedQKVLinear``, documented as column-parallel as is);
    None if ``module`` declares no such layout."""
    r_dim, head_dim = getattr(module, "r_dim", None), head_dim_of(module)
    if isinstance(r_dim, int) and head_dim and out % (r_dim * head_dim) == 0:
        return out // (r_dim * head_dim)
    return None


def _dims(block: nn.Module, fqn: str, name: str) -> tuple[int, int]:
    dims = linear_dims(block.get_submodule(name))
    if dims is None:
        raise NotModelledError(f"{_join(fqn, name)} is a {type(block.get_submodule(name)).__name__}, not a linear "
                               "(nn.Linear or Conv1D); tensor parallelism splits only linears")
    return dims


def _role(block: nn.Module, name: str) -> str:
    return "attention" if is_attention(block.get_submodule(name.rpartition(".")[0])) else "mlp"


ATTENTION_CORE_CALLS = ("scaled_dot_product_attention", "flash_attn", "flex_attention", "softmax(")
"""Calls in a forward that mix positions: a module making one is attention, whatever attributes it declares."""


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` attends over the sequence: it declares a head size (:func:`head_dim_of`), or its own forward
    calls an attention core (a user's attention holding only ``heads``). Sequence parallelism gathers an attention's
    input over the sequence; taken for a token-wise MLP, its ranks would each attend over their own part alone."""
    if head_dim_of(module) is not None:
        return True
    source = _forward_source(module)  # empty without source: only the declared head size tells
    return any(call in source for call in ATTENTION_CORE_CALLS)


def residual_width(block: nn.Module) -> int | None:
    """Width of the residual stream a block reads and writes: the size of its shallowest first norm (``None``
    without norms). Shallowest: a per-head query/key norm inside the attention (Qwen3's ``q_norm``) can come first
    in module order, before the block's own norms."""
    sizes = [(name.count("."), int(module.weight.shape[0])) for name, module in block.named_modules()
             if is_norm(module) and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1]
    return min(sizes, key=lambda depth_size: depth_size[0])[1] if sizes else None


def is_norm(module: nn.Module) -> bool:
    """A per-token normalisation: ``LayerNorm``/``RMSNorm``, or a class named ``...Norm`` (``LlamaRMSNorm``)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.lower().endswith("norm")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# ---------------------------------------------------------------------- what the runtime refuses (any tp degree)

CONFIG_HEAD_READS = ("config.num_attention_heads", "config.num_key_value_heads", "config.hidden_size")
"""Reads of the whole model's head counts in an attention forward: it would slice local heads at wrong offsets."""


def block_problem(block: nn.Module, fqn: str, *, plan: Mapping[str, str] | None = None,
                  skip: Iterable[str] = ()) -> str | None:
    """Why tensor parallelism cannot split ``block`` at any degree (one line), or None."""
    skip = set(skip)
    norms = {name for name, module in block.named_modules() if name and is_norm(module)}
    containers = moe_containers(block)
    held = uncovered_parameter(block, fqn, set(linears_of(block)) | norms | skip | set(containers))
    if held is not None:  # a weight in no linear (torchtitan's GroupedExperts): name it, not the pairs it leaves odd
        return held
    try:
        splits = block_splits(block, fqn, plan=plan, skip=skip)
    except NotModelledError as error:
        return str(error)
    odd = next((split for split in splits if split.style not in LINEAR_STYLES), None)
    if odd is not None:
        return f"{_join(fqn, odd.name)}: style {odd.style!r} does not apply to a linear in a block"
    moe = next((problem for name in containers if (problem := moe_problem(block.get_submodule(name), _join(fqn, name),
                                                                              plan=plan)) is not None), None)
    return moe or uncovered_parameter(block, fqn, {split.name for split in splits} | norms | skip | set(containers)) or next(
        (problem for name in head_split_attentions(block, splits)
         if (problem := config_head_read(_join(fqn, name), block.get_submodule(name))) is not None), None) or (
        head_norm_problem(block, fqn, splits))


def head_norms(block: nn.Module, splits: Sequence[LinearSplit]) -> list[str]:
    """Norms inside an attention whose heads are split (Qwen3's per-head ``q_norm``/``k_norm``): each rank normalises
    its local heads, so a norm's weight gradient is a partial sum over the tensor-parallel ranks."""
    scopes = {scope for split in splits if split.style in HEAD_SPLIT_STYLES for scope in _head_scopes(block, split.name)}
    return [name for name, module in block.named_modules()
            if is_norm(module) and any(name.startswith(f"{scope}.") for scope in scopes)]


def _head_scopes(block: nn.Module, name: str) -> list[str]:
    """Every module above linear ``name`` declaring a head size: torchtitan's fused ``qkv_linear`` and the attention
    around it, which holds the per-head norms."""
    scopes = []
    while name:
        name = name.rpartition(".")[0]
        if head_dim_of(block.get_submodule(name)) is not None:
            scopes.append(name)
    return scopes


def head_norm_problem(block: nn.Module, fqn: str, splits: Sequence[LinearSplit]) -> str | None:
    """A refusal line for a norm inside a head-split attention that is not one head's, shared by every head: it
    normalises across heads (OLMo 2's ``q_norm`` over all heads), holds a weight per head (Cohere's ``(heads,
    head_dim)``), or is one of a list of norms, one per head (StableLM's ``LayerNormPerHead``), which each rank would
    pair with its local heads from the first; or None."""
    names = head_norms(block, splits)
    for name in names:
        norm, head_dim = block.get_submodule(name), head_dim_of(block.get_submodule(attention_of(block, name)))
        weight = getattr(norm, "weight", None)
        parent = name.rpartition(".")[0]
        siblings = [other for other in names if other.rpartition(".")[0] == parent and other.count(".") == name.count(".")]
        if len(siblings) > 1 and parent != attention_of(block, name):
            return (f"{_join(fqn, parent)} holds one norm per head ({len(siblings)}): each tensor-parallel rank would "
                    "normalise its heads with the first of them; plan with tp=1")
        if isinstance(weight, torch.Tensor) and head_dim and weight.dim() > 1 and weight.shape[-1] == head_dim:
            return (f"{_join(fqn, name)} holds a weight per head ({list(weight.shape)}), which tensor parallelism "
                    "would have to split with the heads; plan with tp=1")
        if isinstance(weight, torch.Tensor) and head_dim and weight.numel() != head_dim:
            return (f"{_join(fqn, name)} normalises {weight.numel()} features across the heads tensor parallelism "
                    f"splits (one head has {head_dim}); plan with tp=1")
    return None


def uncovered_parameter(module: nn.Module, fqn: str, styled: set[str]) -> str | None:
    """The first parameter of ``module`` owned by none of the ``styled`` submodules, as a refusal line, or None."""
    for name, _ in module.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(owner == s or owner.startswith(f"{s}.") or s == "" for s in styled):
            return (f"tensor parallelism does not know how to split parameter {_join(fqn, name)} (owned by "
                    f"{type(module.get_submodule(owner)).__name__}); it splits a block's linear pairs and norms, an "
                    "embedding layer's tables (not other modules in that layer), norm layers and the head; plan this "
                    "model with tp=1")
    return None


def head_split_attentions(block: nn.Module, splits: Sequence[LinearSplit]) -> list[str]:
    """Attention modules (a declared head size) whose projections are split by heads (not gathered)."""
    found = [attention_of(block, split.name) for split in splits if split.style in HEAD_SPLIT_STYLES]
    return list(dict.fromkeys(name for name in found if name is not None))


def attention_of(block: nn.Module, name: str) -> str | None:
    """The nearest module above linear ``name`` declaring a head size (torchtitan: ``qkv_linear``'s parent)."""
    while name:
        name = name.rpartition(".")[0]
        if head_dim_of(block.get_submodule(name)) is not None:
            return name
    return None


def config_head_read(fqn: str, attention: nn.Module) -> str | None:
    """A refusal line if ``attention``'s forward reads the whole model's head counts from its config."""
    source = _forward_source(attention)
    read = next((name for name in CONFIG_HEAD_READS if name in source), None)
    if read is None:
        return None
    return (f"cannot split the heads of {fqn} ({type(attention).__name__}): its forward reads {read}, the whole "
            "model's count, so it would slice this rank's heads at the wrong offsets; give its fused projection "
            "style colwise_gather_output and its output projection rowwise_split_input in tp_plan=, or plan with tp=1")


# ------------------------------------------------------------------- mixture-of-experts blocks with stacked experts

def moe_containers(block: nn.Module) -> list[str]:
    """Modules of ``block`` (relative names) holding a stacked experts module named ``experts``: each is split as a
    unit (see the module docstring), not as the block's linear pairs."""
    return [name.rpartition(".")[0] for name, module in block.named_modules()
            if name.rpartition(".")[2] == "experts" and stacked_experts_problem(module) is None]


@dataclass(frozen=True)
class MoEParts:
    """The children of a MoE container: the experts, modules split like a dense MLP (shared experts: two or more
    linears), and modules kept whole on every tensor-parallel rank (routers, single-linear gates)."""

    experts: str
    shared: tuple[str, ...]
    replicated: tuple[str, ...]


def moe_parts(container: nn.Module) -> MoEParts:
    children = [(name, child) for name, child in container.named_children() if name != "experts"]
    shared = tuple(name for name, child in children if len(linears_of(child)) >= 2)
    replicated = tuple(name for name, child in children if name not in shared and any(True for _ in child.parameters()))
    return MoEParts("experts", shared, replicated)


def expert_tp_dims(experts: nn.Module) -> dict[str, tuple[int, int]]:
    """Stacked parameter -> (the dim tensor parallelism splits, packed blocks along it) for an experts module of
    transformers' experts interface: ``gate_up_proj`` (or ``up_proj`` without a gate) column-wise on the hidden
    width, ``down_proj`` row-wise on it; stored ``(E, out, in)``, or ``(E, in, out)`` where it declares
    ``is_transposed``; gate|up concatenated (two packed blocks) unless it declares ``is_concatenated=False``
    (interleaved pairs, split plainly). Raises ``NotModelledError`` naming what it cannot split."""
    where = f"experts module {type(experts).__name__}"
    layout = {name: getattr(experts, name, None) for name in ("is_transposed", "has_gate")}
    if not all(isinstance(value, bool) for value in layout.values()):
        raise NotModelledError(f"{where} declares no is_transposed/has_gate layout (transformers' experts interface), "
                               "so tensor parallelism cannot tell which dim is each expert's hidden width; plan with tp=1")
    for flag, why in (("has_bias", "a down-projection bias would be added once per tensor-parallel rank"),
                      ("has_post_expert_norm", "a norm after each expert would see partial sums")):
        if getattr(experts, flag, False):
            raise NotModelledError(f"{where} declares {flag}: {why} (not implemented); plan with tp=1")
    transposed, up = layout["is_transposed"], "gate_up_proj" if layout["has_gate"] else "up_proj"
    parts = 2 if layout["has_gate"] and getattr(experts, "is_concatenated", True) else 1
    dims = {up: (2 if transposed else 1, parts), "down_proj": (1 if transposed else 2, 1)}
    own = {name for name, _ in experts.named_parameters(recurse=False)}
    if own != set(dims):
        odd = sorted(own ^ set(dims))[0]
        raise NotModelledError(f"{where}: parameter {odd} is not one of {', '.join(sorted(dims))} that expert tensor "
                               "parallelism splits; plan with tp=1")
    return dims


def expert_hidden_width(experts: nn.Module) -> int:
    """Each expert's hidden width (the down projection's input features)."""
    dim, _ = expert_tp_dims(experts)["down_proj"]
    return int(experts.down_proj.shape[dim])


def moe_problem(container: nn.Module, fqn: str, *, plan: Mapping[str, str] | None = None) -> str | None:
    """Why tensor parallelism cannot split the MoE container at ``fqn`` at any degree (one line), or None."""
    try:
        expert_tp_dims(container.get_submodule("experts"))
    except NotModelledError as error:
        return f"{_join(fqn, 'experts')}: {error}"
    for name in moe_parts(container).shared:
        problem = block_problem(container.get_submodule(name), _join(fqn, name), plan=plan)
        if problem is not None:
            return problem
    return None


LOCAL_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads",
                          "split_size")
"""Integer attributes of an attention module that count its heads (or one packed block's width)."""


def localise_attention(attention: nn.Module, tp: int) -> None:
    """Divide the head counts (and packed widths) ``attention``'s forward reads by ``tp``: it now holds its
    local heads. Attributes its forward does not read are left alone (they describe the whole model)."""
    source = _forward_source(attention)
    for name in LOCAL_COUNT_ATTRIBUTES:
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and (not source or f"self.{name}" in source):
            setattr(attention, name, value // tp)


def _forward_source(module: nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source (compiled, generated): treat every attribute as read
        return ""
