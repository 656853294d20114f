"""Loading a tied weight's state under a name the checkpoint does not hold.

A model whose embedding and head share one parameter (GPT-2, Gemma) saves it once without pipelining: the
optimizer's state and param-group settings are listed under the parameter's first name only (``tok_emb.weight``).
Under pipelining each end stage keeps its own copy under its own layer's name (``head.weight``, see
``runtime.pipeline_ties``), and asks the checkpoint for that name's state, which a checkpoint saved without
pipelining does not have; the other way round, a model whose first name is a module no stage holds (BART's
``model.shared``) asks for a name a pipelined save never wrote. All those names are one parameter in the user's
model, so a missing one reads a saved partner's state; the model's aliases are found once, before anything splits
it (:func:`tied_names`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.cost_models.tp_embeddings import tied_parameters

KEY_PREFIXES = (("model", ""), ("optim", "state."), ("optim", "param_groups."))
"""The state-dict parts and the prefix before a parameter's FQN in their keys (DCP's flattened keys:
``model.<fqn>``, ``optim.state.<fqn>.<statistic>``, ``optim.param_groups.<fqn>.<setting>``)."""

Renamed = list[tuple[str, str, str, bool]]
"""``(part, key the load fills, own key, whether the own entry was dropped as the same tensor)``, for
:func:`restore_names`."""


def tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Every name of each parameter the model holds under more than one (its FQNs as the user built it)."""
    return tuple(tuple(f"{fqn}.{name}" if fqn else name for fqn, name in group) for group in tied_parameters(model))


def placed_names(names: Iterable[str], ties: Sequence[tuple[str, ...]]) -> set[str]:
    """``names`` (model state names some rank holds) and every name tied to one of them: a checkpoint's tensor saved
    under any of those has a place in the model."""
    placed = set(names)
    for group in ties:
        if placed.intersection(group):
            placed.update(group)
    return placed


def read_from_partners(tensors: dict[str, dict[str, Any]], saved: Container[str], *,
                       ties: Sequence[tuple[str, ...]]) -> Renamed:
    """Make, in place, each entry of ``tensors`` (``{"model": ..., "optim": ...}``) whose key ``saved`` lacks and whose
    parameter is tied to one ``saved`` holds load from that partner's key: renamed to it, or, when this rank loads
    the partner itself and both are one tensor, put aside (the partner's load fills it). Returns what
    :func:`restore_names` undoes once the load is done."""
    renamed: Renamed = []
    for part, prefix in KEY_PREFIXES:
        state = tensors.get(part, {})
        for key in [k for k in state if k.startswith(prefix) and f"{part}.{k}" not in saved]:
            partner = _partner_key(key, prefix, ties, lambda k, p=part: f"{p}.{k}" in saved)
            if partner is None:
                continue
            if partner not in state:
                state[partner] = state.pop(key)
                renamed.append((part, partner, key, False))
            elif _same_tensor(state[key], state[partner]):
                del state[key]
                renamed.append((part, partner, key, True))
    return renamed


def restore_names(tensors: dict[str, dict[str, Any]], renamed: Renamed) -> None:
    """Undo :func:`read_from_partners` once the load has filled the entries (a dropped one takes its partner's)."""
    for part, loaded, key, dropped in reversed(renamed):
        tensors[part][key] = tensors[part][loaded] if dropped else tensors[part].pop(loaded)


def _partner_key(key: str, prefix: str, ties: Sequence[tuple[str, ...]],
                 usable: Callable[[str], bool]) -> str | None:
    """The key naming the same state of a tied partner of ``key``'s parameter, if ``usable`` takes one."""
    for names in ties:
        for name in names:
            own = f"{prefix}{name}"
            if key == own or key.startswith(f"{own}."):
                rest = key[len(own):]
                found = next((f"{prefix}{other}{rest}" for other in names
                              if other != name and usable(f"{prefix}{other}{rest}")), None)
                if found is not None:
                    return found
    return None


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one tensor (the same object, or views of the same memory alike)."""
    if a is b:
        return True
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        a, b = a.to_local(), b.to_local()
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.data_ptr() == b.data_ptr() and a.stride() == b.stride())
