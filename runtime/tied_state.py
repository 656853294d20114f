"""Loading a tied weight's state under a name the checkpoint does not hold.

A model whose embedding and head share one parameter (GPT-2, Gemma) saves it once without pipelining: the
optimizer's state is listed under the parameter's first name only (``tok_emb.weight``). Under pipelining each end
stage keeps its own copy under its own layer's name (``head.weight``, see ``runtime.pipeline_ties``), and asks the
checkpoint for that name's state, which a checkpoint saved without pipelining does not have. Both names are the
same parameter in the user's model, so the copy reads its partner's saved state; the model's aliases are found
once, before anything splits it (:func:`tied_names`).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from torch import nn

from tessera.cost_models.tp_embeddings import tied_parameters

STATE_PARTS = {"model": "", "optim": "state."}
"""The state-dict parts whose keys name a parameter, with the prefix before its FQN (DCP's flattened keys:
``model.<fqn>``, ``optim.state.<fqn>.<statistic>``)."""


def tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Every name of each parameter the model holds under more than one (its FQNs as the user built it)."""
    return tuple(tuple(f"{fqn}.{name}" if fqn else name for fqn, name in group) for group in tied_parameters(model))


def read_from_partners(tensors: dict[str, dict[str, Any]], saved: Container[str],
                       ties: Sequence[tuple[str, ...]]) -> dict[tuple[str, str], str]:
    """Rename, in place, each entry of ``tensors`` (``{"model": ..., "optim": ...}``) whose key ``saved`` lacks and
    whose parameter is tied to one ``saved`` holds, to that partner's key, so a load fills it from there. Returns
    ``{(part, partner key): own key}`` for :func:`restore_names`."""
    renamed = {}
    for part, prefix in STATE_PARTS.items():
        state = tensors.get(part, {})
        for key in [key for key in state if f"{part}.{key}" not in saved]:
            partner = _partner_key(key, prefix, ties, lambda k, p=part: f"{p}.{k}" in saved and k not in state)
            if partner is not None:
                state[partner] = state.pop(key)
                renamed[(part, partner)] = key
    return renamed


def restore_names(tensors: dict[str, dict[str, Any]], renamed: dict[tuple[str, str], str]) -> None:
    """Undo :func:`read_from_partners` once the load has filled the entries."""
    for (part, partner), key in renamed.items():
        tensors[part][key] = tensors[part].pop(partner)


def _partner_key(key: str, prefix: str, ties: Sequence[tuple[str, ...]], usable) -> str | None:
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
