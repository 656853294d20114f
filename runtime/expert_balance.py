"""Auxiliary-loss-free expert load balancing for models that leave it to the training loop.

DeepSeek-V3's balancing (Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
arXiv 2408.15664) routes each token by its router scores plus a per-expert bias, and moves that bias between
optimizer steps: down for the experts that received more tokens than the mean, up for the others. torchtitan's MoE
layer keeps the bias and the count in buffers (``expert_bias_E``, ``tokens_per_expert_E``; ``expert_bias`` and
``tokens_per_expert`` in its earlier releases), counts during the forward and leaves the update to its trainer,
which runs it in an optimizer pre-step hook: the bias moves by ``load_balance_coeff`` times the sign of (mean count
- count), centred to a zero mean, with the counts summed over every rank that saw other tokens; then the count
restarts. ``ParallelModel.train_step`` does the same before its optimizer step, so a plan does not silently train
without the balancing the model asks for.

The sign makes the update blind to the counts' scale: summing over tensor-parallel ranks (which route the same
tokens) or counting a recomputed forward twice moves nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUFFER_NAMES = (("expert_bias_E", "tokens_per_expert_E"), ("expert_bias", "tokens_per_expert"))
"""(bias, count) buffer names of torchtitan's MoE layer, newest release first."""


def loss_free_balanced(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str, str]]:
    """Every submodule of ``modules`` that asks for the balancing (a ``load_balance_coeff`` and both buffers), with
    the names of its bias and count buffers, in module order."""
    found = []
    for module in modules:
        for layer in module.modules():
            names = next((pair for pair in BUFFER_NAMES if all(isinstance(getattr(layer, n, None), torch.Tensor)
                                                              for n in pair)), None)
            if names is not None and getattr(layer, "load_balance_coeff", None) is not None:
                found.append((layer, *names))
    return found


def update_expert_biases(layers: Sequence[tuple[nn.Module, str, str]], group: dist.ProcessGroup | None) -> None:
    """Move each layer's routing bias towards the experts that got fewer tokens this step, from the counts summed
    over ``group`` (the ranks that hold these layers and see other tokens), and restart the counts."""
    if not layers:
        return
    counts = torch.stack([_local(getattr(layer, count)).float() for layer, _, count in layers])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    with torch.no_grad():
        for (layer, bias, count), tokens in zip(layers, counts):
            step = layer.load_balance_coeff * torch.sign(tokens.mean() - tokens)
            _local(getattr(layer, bias)).add_((step - step.mean()).to(getattr(layer, bias).dtype))
            getattr(layer, count).zero_()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
