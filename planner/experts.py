"""Mixture-of-experts layers at their expected load, so capture on meta is deterministic.

Which tokens an expert receives depends on router values, which meta and fake tensors do not have; dropless
implementations also size their work by those values (``nonzero``, a Python loop over the experts hit). Capture
therefore measures every expert at its *expected* load: ``ceil(top_k * tokens / experts * capacity_factor)``
token slots, the factor standing for routing imbalance (1.0: perfectly balanced; a planner wanting headroom for
the busiest expert uses more). Two kinds of layer are handled, for the duration of a capture:

- modules with a float attribute ``capacity_factor`` (Tessera's ``MoELayer``, whose capacity-based dispatch is
  static-shaped already): the attribute is set to the requested factor, or left as configured when none is given;
- Hugging Face packed experts (``MixtralExperts`` and its copies: 3-D ``gate_up_proj`` and ``down_proj``
  parameters, ``num_experts``, ``act_fn``; called as ``experts(hidden_states, top_k_index, top_k_weights)``):
  their forward is replaced by a static-shaped one that gathers each expert's slots, runs both projections as
  batched matmuls and scatters the weighted results back (factor 1.0 when none is given).

A module's stored ``aux_loss`` (Tessera's MoE layers keep their last load-balancing loss) is put back afterwards,
so a capture leaves no meta tensor behind in the model.

What capture then reports per MoE layer (``LayerStats``): ``experts``, ``top_k``, ``expert_param_count`` (all
routed experts), ``expert_forward_flops`` / ``expert_backward_flops`` (the routed experts' share of the layer's
FLOPs, at the measured load) and ``expert_capacity_factor`` (the load factor measured at, see
``measured_capacity_factor``). From those, ``expert_summary`` gives the per-expert figures a planner and a reader
want: parameters per expert, forward FLOPs per routed token, and expected tokens per expert.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from tessera.cost_models.layer_stats import LayerStats
from tessera.models.moe import expert_capacity, sum_rows
from tessera.planner.layer_info import attribute


@contextmanager
def expected_expert_load(model: nn.Module, capacity_factor: float | None) -> Iterator[None]:
    """Within the block, every MoE layer of ``model`` processes its expected load (see the module docstring)."""
    restore: list[tuple[nn.Module, str, object]] = []
    for module in model.modules():
        if "aux_loss" in vars(module):  # a stored load-balancing loss: a capture's meta value must not stay behind
            restore.append((module, "aux_loss", module.aux_loss))
        if isinstance(attribute(module, "capacity_factor"), float) and capacity_factor is not None:
            restore.append((module, "capacity_factor", module.capacity_factor))
            module.capacity_factor = capacity_factor
        elif is_packed_experts(module):
            restore.append((module, "forward", None))
            module.forward = partial(_expected_load_forward, module, capacity_factor or 1.0)
    try:
        yield
    finally:
        for module, name, value in restore:
            if name == "forward":
                del module.forward
            else:
                setattr(module, name, value)


def measured_capacity_factor(layer: nn.Module, requested: float | None) -> float:
    """The load factor ``expected_expert_load`` measures ``layer``'s experts at (1.0 for a dense layer)."""
    for module in layer.modules():
        if isinstance(attribute(module, "capacity_factor"), float):
            return requested if requested is not None else module.capacity_factor
        if is_packed_experts(module):
            return requested or 1.0
    return 1.0


@dataclass(frozen=True)
class ExpertSummary:
    """Per-expert figures of one kind of MoE layer, for ``tokens`` routed tokens (one micro-batch of sequences)."""

    layers: int  # MoE layers of this shape
    experts: int
    top_k: int
    params_per_expert: float
    flops_per_token: float  # forward FLOPs one expert spends on one routed token
    capacity_factor: float
    tokens: int
    expected_tokens_per_expert: float  # top_k * tokens / experts * capacity_factor


def expert_summary(layers: Sequence[LayerStats], *, seq_len: int, sequences: int = 1) -> list[ExpertSummary]:
    """One ``ExpertSummary`` per distinct MoE layer shape among ``layers`` (statistics for ``seq_len``)."""
    groups: dict[tuple, list[LayerStats]] = {}
    for layer in layers:
        if layer.experts:
            key = (layer.experts, layer.top_k, layer.expert_param_count, layer.expert_capacity_factor)
            groups.setdefault(key, []).append(layer)
    tokens = seq_len * sequences
    return [
        ExpertSummary(
            layers=len(group), experts=first.experts, top_k=first.top_k, params_per_expert=first.params_per_expert,
            flops_per_token=first.expert_flops_per_token(seq_len), capacity_factor=first.expert_capacity_factor,
            tokens=tokens, expected_tokens_per_expert=first.expected_tokens_per_expert(tokens),
        )
        for first, group in ((g[0], g) for g in groups.values())
    ]


def is_packed_experts(module: nn.Module) -> bool:
    """A Hugging Face experts module holding all experts' weights as 3-D tensors, called with the router's choices
    (``experts(hidden_states, top_k_index, top_k_weights)``, Mixtral's and Qwen3-MoE's); Llama 4's, called with
    tokens already routed, is not."""
    weights = [attribute(module, name) for name in ("gate_up_proj", "down_proj")]
    return (
        all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)
        and isinstance(attribute(module, "num_experts"), int)
        and callable(attribute(module, "act_fn"))
        and _takes_routing(module)
    )


def _takes_routing(module: nn.Module) -> bool:
    try:
        inputs = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return len(inputs) >= 3


def _expected_load_forward(
    experts: nn.Module,
    capacity_factor: float,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    N, H = hidden_states.shape  # (N, H) tokens
    k, E = top_k_index.shape[-1], experts.num_experts
    capacity = expert_capacity(N, experts=E, top_k=k, capacity_factor=capacity_factor)
    slots = torch.arange(E * capacity, device=hidden_states.device)  # (E*C,)
    tokens = slots % N  # a fixed token per slot: on meta only the count matters
    x = hidden_states[tokens].view(E, capacity, H)  # (E, C, H)
    gate, up = torch.bmm(x, _as_in_out(experts.gate_up_proj, H)).chunk(2, dim=-1)  # (E, C, F) each
    y = torch.bmm(experts.act_fn(gate) * up, _as_in_out(experts.down_proj, gate.shape[-1]))  # (E, C, H)
    weights = top_k_weights.reshape(-1)[slots % top_k_weights.numel()].unsqueeze(-1)  # (E*C, 1)
    routed = (y.reshape(-1, H) * weights).to(hidden_states.dtype)  # (E*C, H)
    return sum_rows(tokens, routed, hidden_states)  # (N, H), keeping the index alone as the grouped path does


def _as_in_out(weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """(E, in, out) view of a packed expert weight stored as (E, out, in) (nn.Linear layout) or (E, in, out)."""
    return weight if weight.shape[1] == in_features and weight.shape[2] != in_features else weight.transpose(1, 2)
