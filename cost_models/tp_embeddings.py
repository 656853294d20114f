"""Tensor parallelism and the embedding tables: which tables are split over the vocabulary, and whether a parameter
tied between a table and the head would be split alike on both (the runtime keeps a tie only then)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from torch import nn

from tessera.cost_models.tp_rules import REPLICATED_STYLES, plan_style


INDEX_ARGUMENTS = ("input", "input_ids", "ids", "tokens", "token_ids", "x")
"""Names of an embedding's first forward argument when it is the index to look up (vocabulary-parallel hooks
convert that argument)."""


def embedding_kept_whole(embedding: nn.Embedding, style: str | None) -> bool:
    """Whether tensor parallelism keeps ``embedding`` whole on every rank (``style``: the plan's for it): the plan
    says so; its forward does not take the indices first (OPT's learned positions, called with the mask) or does
    not look them up as given (BART's learned positions take the ids and look up positions made from their shape:
    the override must hand its first argument to ``super().forward`` or ``F.embedding(..., self.weight)`` itself, as
    Gemma's scaled embedding does); or
    it does its own vocabulary-parallel lookup (torchtitan's ``Embedding``, which unwraps a sharded weight itself)."""
    if style in REPLICATED_STYLES:
        return True
    forward = type(embedding).forward
    if forward is nn.Embedding.forward:
        return False
    if hasattr(embedding, "tp_group"):
        return True
    names = list(inspect.signature(forward).parameters)[1:2]
    if names not in ([name] for name in INDEX_ARGUMENTS):
        return True
    try:
        source = "".join(inspect.getsource(forward).split())
    except (OSError, TypeError):  # no source: taken as a lookup of its first argument
        return False
    return not any(call in source for call in (f".forward({names[0]})", f"embedding({names[0]},self.weight"))


def tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module FQN, parameter name) that share one parameter object."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((module_fqn, name))
    return [group for group in owners.values() if len({fqn for fqn, _ in group}) > 1]


def tie_problem(model: nn.Module, kinds: Mapping[str, str], plan: Mapping[str, str]) -> str | None:
    """A refusal line when a parameter tied between an embedding table and the head would be split on one and
    whole on the other (``kinds``: planned layer FQN -> kind); the runtime cannot keep such a pair tied."""
    for group in tied_parameters(model):
        split = {f"{fqn}.{name}": known for fqn, name in group
                 if (known := _splits_tied(model, fqn, kinds, plan)) is not None}  # an alias module takes theirs
        if len(set(split.values())) > 1:
            whole = next(name for name, is_split in split.items() if not is_split)
            other = next(name for name, is_split in split.items() if is_split)
            owner = whole.rpartition(".")[0]
            return (f"tied parameters {whole} and {other} would be split differently by tensor parallelism ({owner} "
                    f"({type(model.get_submodule(owner)).__name__}) stays whole on every rank, "
                    f"{other.rpartition('.')[0]} is split); untie them (torchtitan: enable_weight_tying=False) or plan "
                    "with tp=1")
    return None


def _splits_tied(model: nn.Module, fqn: str, kinds: Mapping[str, str], plan: Mapping[str, str]) -> bool | None:
    """Whether tensor parallelism splits the module at ``fqn`` (an embedding table or the head); None for others."""
    module = model.get_submodule(fqn)
    kind = kinds.get(fqn) or next((k for layer, k in kinds.items() if fqn.startswith(f"{layer}.")), None)
    if kind == "embedding" and isinstance(module, nn.Embedding):
        return not embedding_kept_whole(module, plan_style(plan, fqn))
    if kind == "head" and isinstance(module, nn.Linear):
        return True
    return None
