"""Weights tied across pipeline stages (an input embedding shared with the LM head: GPT-2, Gemma, OPT).

They stay tied, as in Megatron-LM: each stage holding one of the layers keeps its own copy of the weight
(equal at the start: rank 0's weights are broadcast), and before every optimizer step the copies' gradients
are summed over the group of those stages in each pipeline (:class:`TiedGradients`), so every copy takes the
step the single parameter takes. Each copy keeps its layer's FQN (``emb.weight`` on the first stage,
``head.weight`` on the last), as a single-process state dict lists both.

With tensor parallelism each stage holds its shard of its copy. The sum is taken shard by shard over stages
of the same ``tp`` (and ``dp``) coordinate, which is exact when both copies are split alike: the vocabulary-
parallel embedding and the column-parallel head both shard the ``(V, H)`` matrix on dim 0, so the two local
shards are the same rows. :func:`check_tied_layouts` compares the copies' placements and local shapes across
the world after sharding and refuses, on every rank alike, copies split differently. Refused by name before
anything is sharded (:func:`check_ties`): ties between two chunks of one pipeline rank. A model built on the meta
device initialises each stage's copy on its own; the copies then take the last stage's value
(:func:`share_initial_values`), which the unsplit model's init, writing the one parameter in module order, leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tessera.cost_models.types import Strategy
from tessera.errors import NotModelledError
from tessera.planner.plan import Plan


@dataclass(frozen=True)
class TiedWeight:
    """One parameter shared by layers of different pipeline chunks (an input embedding and the LM head)."""

    fqns: tuple[str, ...]
    """Its FQN in each chunk holding it, in chunk order (``tok_emb.weight``, ``head.weight``)."""
    chunks: tuple[int, ...]
    """The chunk of each FQN."""

    def pp_ranks(self, pp: int) -> tuple[int, ...]:
        """Pipeline ranks holding a copy (chunk ``c`` runs on ``c % pp``)."""
        return tuple(sorted({chunk % pp for chunk in self.chunks}))

    @property
    def names(self) -> str:
        return " and ".join(self.fqns)


def cross_chunk_ties(model: nn.Module, plan: Plan) -> list[TiedWeight]:
    """Parameters shared by layers of different chunks, found by identity on the unsplit model."""
    owners: dict[int, dict[int, str]] = {}  # id(param) -> chunk -> first FQN there
    for layer in plan.layers:
        if layer.kind == "loss":
            continue
        for name, param in model.get_submodule(layer.fqn).named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), {}).setdefault(layer.chunk, f"{layer.fqn}.{name}")
    return [
        TiedWeight(tuple(by_chunk[c] for c in sorted(by_chunk)), tuple(sorted(by_chunk)))
        for by_chunk in owners.values() if len(by_chunk) > 1
    ]


def check_ties(ties: Sequence[TiedWeight], strategy: Strategy) -> None:
    """Refuse the tied-weight combinations the runtime does not keep exact, naming the weight and the fix."""
    for tie in ties:
        if len(tie.pp_ranks(strategy.pp)) < len(tie.chunks):
            raise NotModelledError(f"{tie.names} are tied between chunks {tie.chunks} and two of them run on one "
                                   f"pipeline rank under {strategy.to_string()!r}; plan other chunks or pp=1")


def tie_group(mesh: DeviceMesh, pp_ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """The process group of this rank's copies of a tied weight: the ``pp_ranks`` of its pipeline (the ranks
    equal on every other mesh axis; Megatron-LM's embedding group). Every rank calls it (groups are
    created collectively); ``None`` on a rank holding no copy."""
    pp = mesh.mesh.shape[mesh.mesh_dim_names.index("pp")]
    pipelines = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, pp)  # (replicas, pp)
    groups = [[int(row[r]) for r in pp_ranks] for row in pipelines]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


class TiedGradients:
    """Optimizer pre-step hook: sum each tied weight's gradient over its copies, so every copy takes the same
    step as the single tied parameter would.

    Each stage's gradient is its layers' part of the full gradient (already averaged over data parallelism
    and scaled by ``1 / micro-batches``, both linear), so the sum is exactly the unsplit model's gradient. A
    gradient sharded by FSDP or tensor parallelism is summed shard by shard: the copies are split alike
    (:func:`check_tied_layouts`) over the same ``dp`` and ``tp`` ranks.
    """

    def __init__(self, params: Sequence[tuple[nn.Parameter, dist.ProcessGroup]]) -> None:
        self.params = list(params)

    def __call__(self, optimizer: torch.optim.Optimizer, *_) -> None:
        for param, group in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # a vocabulary-parallel embedding's gradient comes back replicated: take this rank's rows
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=group)


def share_initial_values(ties: Sequence[TiedWeight], params: Sequence[tuple[nn.Parameter, dist.ProcessGroup]], *,
                         pp: int, pp_rank: int) -> None:
    """Give every copy of each tied weight the value its last stage's copy took (collective over each group): a model
    materialised on meta initialises each copy on its own stage, where the unsplit model's init wrote one
    parameter, last in module order (the head's). ``params``: this rank's copies, ties in order
    (:func:`local_tied_parameters`)."""
    mine = iter(params)
    for tie in ties:
        ranks = tie.pp_ranks(pp)
        if pp_rank not in ranks:
            continue
        param, group = next(mine)
        source = dist.get_global_rank(group, ranks.index(tie.chunks[-1] % pp))
        with torch.no_grad():
            dist.broadcast(param.to_local() if isinstance(param, DTensor) else param, src=source, group=group)


def local_tied_parameters(
    ties: Sequence[TiedWeight], modules: Sequence[nn.Module], mesh: DeviceMesh, *, pp: int, pp_rank: int
) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """This rank's copy of each tied weight with its group (collective: call on every rank, ties in order);
    copies split differently by tensor parallelism are refused on every rank (:func:`check_tied_layouts`)."""
    params = {name.removeprefix("module."): p for m in modules for name, p in m.named_parameters()}
    found, copies = [], {}
    for index, tie in enumerate(ties):
        group = tie_group(mesh, tie.pp_ranks(pp))
        if group is None or pp_rank not in tie.pp_ranks(pp):
            continue
        fqn = next(fqn for fqn in tie.fqns if fqn in params)
        found.append((params[fqn], group))
        copies[index] = (fqn, layout(params[fqn]))
    check_tied_layouts(ties, copies, mesh)
    return found


def layout(param: torch.Tensor) -> tuple:
    """How a copy is split: its placements (a ``DTensor``) and the shape this rank holds."""
    placements = tuple(str(p) for p in param.placements) if isinstance(param, DTensor) else ()
    local = param.to_local() if isinstance(param, DTensor) else param
    return placements, tuple(local.shape)


def check_tied_layouts(ties: Sequence[TiedWeight], copies: dict[int, tuple[str, tuple]], mesh: DeviceMesh) -> None:
    """Every copy of a tied weight in one pipeline replica must be split alike (collective over the world, so
    a mismatch raises on every rank, not only on the stages holding the copies)."""
    coordinate = mesh.get_coordinate() or []
    replica = tuple(c for name, c in zip(mesh.mesh_dim_names, coordinate) if name != "pp")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (replica, copies))
    seen: dict[tuple[int, tuple], tuple[str, tuple]] = {}
    for rank_replica, rank_copies in gathered:
        for index, (fqn, split) in rank_copies.items():
            first = seen.setdefault((index, rank_replica), (fqn, split))
            if first[1] != split:
                raise NotModelledError(
                    f"{ties[index].names} are tied across pipeline stages but split differently: {first[0]} "
                    f"{_describe(first[1])}, {fqn} {_describe(split)}; the summed gradient would mix different "
                    "elements: untie them, or plan with tp=1 or pp=1"
                )


def _describe(split: tuple) -> str:
    placements, shape = split
    return f"as {', '.join(placements) or 'a plain tensor'} holding {shape} here"
