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

**Tensor-parallel experts** (each expert's hidden width split over ``tp``, ``runtime.hf_experts``) compute a partial
sum of their combined output on every tensor-parallel rank; :func:`copy_to_group` and :func:`reduce_over_group` are
the two ends of that region (Megatron-LM's ``f`` and ``g``, Shoeybi et al. 2019): the inputs enter unchanged and
their gradients (partial, each rank's share) are summed in backward; the output is summed once in forward.

**Folded experts** (``etp = 1 < tp``, ``runtime.mesh.expert_grid``): the ranks of a tensor-parallel group hold the
same tokens (the block's input is whole there: the row-parallel attention output was all-reduced) but sit in
different expert-parallel groups. Each routes all its tokens exactly as the unfolded layer does (the same
capacity and drops), then dispatches only its :class:`TokenShard`, a contiguous ``1/tp`` of them; its combined
output is zero for the other tokens, so :func:`reduce_over_group` over the tensor-parallel group completes it
(the same ``copy_to_group`` / ``reduce_over_group`` pair as tensor-parallel experts: the tokens' and routing
weights' gradients, each rank's share, are summed). That boundary is where the tokens change layout: inside the
MoE layer, after routing, before the dispatch, with no extra all-to-all and no sequence parallelism needed. An
all-reduce of the combined ``(N, H)`` output per layer is what it costs beyond the unfolded dispatch (Megatron-Core
under sequence parallelism instead holds ``1/tp`` of the tokens per rank already).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def expert_gradient_scale(ep: int, shard: "TokenShard | None") -> float:
    """What a local expert's weight gradients are divided by in backward so that averaging them over the ranks
    holding the expert divides them by ``dp``: ``dp / expert_dp``, i.e. ``ep``, or ``ep / tp`` when folded
    (``expert_dp = dp * tp / ep``)."""
    return ep if shard is None else ep / shard.count


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


class _ReduceOverGroup(torch.autograd.Function):
    """``x`` summed over ``group`` in forward; the gradient passes unchanged (every rank's is the whole one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):
        summed = x.contiguous().clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` entering a region that computes partial sums over ``group``: its gradient is summed in backward."""
    return _CopyToGroup.apply(x, group)


def reduce_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The partial sums ``x`` of every rank of ``group`` added up (the region's one reduction)."""
    return _ReduceOverGroup.apply(x, group)


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


@dataclass(frozen=True)
class TokenShard:
    """The share of a tensor-parallel group's (whole, identical) tokens this rank dispatches to folded experts:
    contiguous block ``index`` of ``count``; ``group`` (the tensor-parallel group) sums the ranks' partial outputs."""

    index: int
    count: int
    group: dist.ProcessGroup

    def bounds(self, tokens: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's tokens among ``tokens``."""
        size = -(-tokens // self.count)
        return min(self.index * size, tokens), min((self.index + 1) * size, tokens)

    def holds(self, token: torch.Tensor, tokens: int) -> torch.Tensor:
        """Which entries of ``token`` (token indices; ``tokens`` marks none) are this rank's to dispatch."""
        start, stop = self.bounds(tokens)
        return (token >= start) & (token < stop)
