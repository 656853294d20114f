"""The token exchange of expert parallelism, shared by Tessera's MoE layers (``runtime.expert_parallel``) and
Hugging Face experts modules (``runtime.hf_experts``).

Each rank of an ``ep`` group holds ``E / ep`` consecutive experts (rank ``j`` holds experts ``j * E/ep`` onward),
so rows sorted by expert are also sorted by the rank that holds them. A dispatch is:

1. :func:`exchange_counts`: each rank's per-expert row counts, one small even all-to-all; from them every rank
   knows how many rows it sends to and receives from each peer (uneven splits; gloo supports them);
2. :func:`all_to_all` of the rows (differentiable: the backward is the exchange with the splits swapped);
3. each local expert runs on the rows every peer sent it (:func:`local_expert_of_rows` says which row is whose),
   inside :func:`with_expert_gradient_scale`;
4. the inverse :func:`all_to_all` brings the outputs back in the order they were sent.

**Gradients.** Dense gradients are averaged over ``dp`` ranks; a local expert's gradient is the *sum* over the
``ep`` ranks whose tokens it ran, and the expert-data-parallel wrapping averages it over the ``edp`` ranks that
hold the same expert (``runtime.expert_parallel.apply_expert_data_parallel``). :func:`with_expert_gradient_scale`
divides the expert's weight gradients by ``ep`` in backward, so they end up divided by ``ep * edp = dp``, like the
dense ones (``PREMUL_SUM``, which FSDP2's own divide factor needs, is absent on gloo).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 with uneven splits; its backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: send ``in_splits[j]`` rows of ``x`` to peer ``j``, receive
    ``out_splits[j]`` rows from it."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged, its gradient multiplied by ``factor``."""
    return _ScaleGradient.apply(x, factor)


def with_expert_gradient_scale(run: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, ep: int) -> torch.Tensor:
    """``run(rows)`` with the gradients of the weights inside ``run`` divided by ``ep``, the rows' unchanged.

    Scaling the output gradient by ``1/ep`` scales every gradient inside ``run``; the input's is scaled back.
    """
    return scale_gradient(run(scale_gradient(rows, float(ep))), 1.0 / ep)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup, ep: int) -> torch.Tensor:
    """Each peer's row counts for this rank's experts, ``(ep, E/ep)``, from this rank's ``(E,)`` counts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def split_sizes(counts: torch.Tensor, received: torch.Tensor, ep: int) -> tuple[list[int], list[int]]:
    """Rows sent to each peer (its experts' counts summed) and rows received from each peer."""
    return counts.view(ep, -1).sum(1).tolist(), received.sum(1).tolist()


def local_expert_of_rows(received: torch.Tensor) -> torch.Tensor:
    """The local expert index of every received row, ``(R,)``: rows arrive peer-major, each peer's expert-major."""
    ep, local = received.shape
    experts = torch.arange(local, device=received.device).repeat(ep)  # (ep * E/ep,)
    return experts.repeat_interleave(received.flatten())  # (R,)
