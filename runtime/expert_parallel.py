"""Expert parallelism: each rank of an ``ep`` group holds ``experts / ep`` whole experts of every MoE layer and
exchanges tokens with its group by all-to-all (GShard, Lepikhin et al. 2020, arXiv:2006.16668; the
dispatch/combine pattern of DeepSpeed-MoE and Megatron-Core).

Two kinds of MoE layer are split: Tessera's ``MoELayer`` (here) and the stacked experts modules of models Tessera
did not write, Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE and their kin (``runtime.hf_experts``; only their experts
module is replaced, their blocks' own routing runs). Both use the exchange of ``runtime.experts_exchange``.

**Where the ep group comes from.** Expert parallelism is carved out of the data-parallel axis
(``Strategy``'s convention; ``runtime.mesh``): ``dp = edp * ep``, the ``ep`` axis inside the pipeline axis
(mesh ``("edp", "pp", "ep", "cp", "tp")``), so an ep group is ``ep`` ranks of one pipeline stage, ``tp * cp``
apart. Each data-parallel rank still routes its own tokens (its rows of the batch); the ``ep`` data-parallel
ranks of a group pool their experts. Dense parameters (attention, norms, router, shared expert, embeddings,
head) stay replicated over all ``dp`` ranks; each expert lives on one rank of every ep group, replicated over
the ``edp`` groups.

**What a layer does** (:class:`ExpertParallelMoE`, a ``MoELayer`` whose experts run remotely). Routing,
capacity and the weighted combine are the single-process layer's own code (``models.moe``), run on this
rank's tokens: capacity is per rank, ``ceil(top_k * local_tokens / experts * capacity_factor)``, exactly what
``MoELayer`` computes when it is called on the same tokens, so the same assignments are dropped (GShard
likewise sizes expert buffers per group of local tokens). Then, instead of running all experts on the
``(E, C, H)`` buffer:

1. only the *filled* slots travel (an expert's filled slots are a prefix of its ``C``: arrival order): the
   per-expert fill counts are exchanged first (one small all-to-all), then the token rows with
   ``all_to_all_single`` and uneven splits -- rank ``j`` receives, from every peer, the rows for its own
   experts (no padding is sent; gloo supports uneven splits, see PLATFORM-NOTES);
2. each local expert runs once on the rows all peers sent it;
3. the outputs go back by the inverse all-to-all and land in the slots they came from; the combine is the
   single-process one. Autograd: the backward of an all-to-all is the all-to-all with the splits swapped
   (``runtime.experts_exchange``).

**Gradients.** A local expert's gradient, after backward, is the sum of the gradients of the ``ep`` ranks'
local losses (their tokens' backward came back through the all-to-all). Dense gradients are averaged over
``dp`` (each rank's loss is the mean over its rows). So expert gradients are reduced over the ``edp`` ranks
holding the same expert and divided by ``dp`` (not ``edp``). torchtitan sets FSDP2's
``set_gradient_divide_factor(dp)``; on gloo that needs ``PREMUL_SUM`` (absent) or the sum-only mode, which in
torch 2.13 divides twice when the reduce-scatter group has one rank (``replicate``, or ``edp == 1``). So the
layer instead scales each expert's weight gradients by ``1/ep`` in backward (an identity with a scaled
gradient around the expert, the rows' own gradient scaled back) and the wrapping averages over ``edp`` as
usual: ``1 / (ep * edp) = 1 / dp``. Experts are wrapped per expert (a ``ModuleDict`` is never called, so
it cannot be an FSDP unit) with the plan's ZeRO stage over the ``edp`` axis, before the dense wrapping
(which then skips them). The load-balancing ``aux_loss`` each layer stores is that of this rank's tokens.

**Tensor parallelism** composes: tensor-parallel ranks see the same tokens, so the ep group is the ranks of
one tensor-parallel index; experts are split like the dense MLP (gate/up column-wise, down row-wise: what
``Strategy`` tells the cost model) by ``runtime.tensor_parallel``, and every tensor-parallel rank does the
same dispatch for its slice of each expert. The router stays whole.

**Context parallelism** composes: each cp rank routes its share of the sequence (capacity from its own token
count), its ep group is the ranks of its cp index, and expert gradients are averaged over ``edp * cp`` ranks
(``runtime.mesh.expert_data_mesh``), dense ones over ``dp * cp``: ``1 / (ep * edp * cp) = 1 / (dp * cp)``.

**Pipeline parallelism** composes: the ep group of a rank is in its own pipeline stage, so its peers run the
same chunk's MoE layers on the same micro-batch schedule and their all-to-alls pair up (pipelining's shape
inference runs each stage's forward and backward once more, on every ep peer alike). Each chunk module's
experts are wrapped over ``edp`` like the dense units over ``dp``.

**Folded experts** (``Strategy.etp = 1 < tp``, Megatron's "MoE parallel folding", Liu et al. 2025,
arXiv:2504.14960): the experts leave the tensor-parallel axis and get a grid of their own over the same ranks
(``runtime.mesh.expert_grid``: ``(expert_dp, expert_ep)`` over each stage's ``dp x tp`` ranks; the dense mesh keeps
the plain layout), so an ep group may span tensor-parallel ranks and data-parallel ranks, e.g. on 4 ranks tp=2,dp=2
for attention and ep=4 for the experts. The tokens change layout inside the MoE layer, after routing: a
tensor-parallel group holds the same tokens (its attention output was all-reduced) and routes all of them, exactly
as unfolded (same capacity, same drops); each of its ranks then dispatches only its contiguous ``1/tp`` share of them
(``experts_exchange.TokenShard``) to whole experts, and the combined outputs, zero for the other shares, are summed
over the tensor-parallel group (gradients of the tokens and routing weights summed there too). Expert gradients are
scaled by ``tp / ep`` in backward and averaged over ``expert_dp = dp * tp / ep`` replicas (FSDP2 or ``replicate``
over the grid's ``expert_dp`` axis): ``1 / dp`` again. ``tensor_parallel`` keeps the folded experts whole
(``tp_whole_linears``). Stacked experts modules fold alike (``runtime.hf_experts``).

The tensor, context and pipeline compositions above are this layer's; stacked experts modules compose with tensor
and pipeline parallelism in their own way (``runtime.hf_experts``) and refuse context parallelism.

Not implemented (``NotModelledError`` from ``check_expert_parallel``): sequence parallelism with ``ep > 1`` on
``MoELayer`` or folded experts (unfolded stacked experts modules run it) and selective recomputation (full
recomputation works) with ``ep > 1``; folding to ``1 < etp < tp``, folding with context
parallelism, and folded experts whose replicas no data-parallel wrapping would average (``dp = 1``, ZeRO-0,
``ep < tp``): ``check_expert_folding``.
A model on the meta device is materialised whole on every rank before its experts are split (``apply_plan``,
as for DDP): correct, but each rank briefly holds every expert; initialising only the local experts would
need ``runtime.materialize`` to draw and drop the remote ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tessera.cost_models.folding import folding_refusal
from tessera.cost_models.types import Strategy, runtime_splits
from tessera.errors import NotModelledError, RuntimeSetupError
from tessera.models.moe import MoELayer, slot_tokens
from tessera.runtime.experts_exchange import (
    TokenShard,
    all_to_all,
    copy_to_group,
    exchange_counts,
    expert_gradient_scale,
    local_expert_of_rows,
    reduce_over_group,
    split_sizes,
    with_expert_gradient_scale,
)
from tessera.runtime.hf_experts import (
    ShardedExperts,
    apply_stacked_experts,
    check_stacked_experts,
    stacked_experts_candidates,
)
from tessera.runtime.mesh import EP, FOLDED_EDP, FOLDED_EP, TP, expert_data_mesh, expert_grid, folds_experts, is_folded


class ExpertParallelMoE(MoELayer):
    """A ``MoELayer`` holding only this rank's experts; tokens reach them by all-to-all over ``group``.

    Same parameters (shared, not copied) and FQNs as the layer it replaces: ``experts`` is a ``ModuleDict``
    keyed by the global expert index, so ``experts.5.up.weight`` keeps its name on the rank that holds it.
    """

    def __init__(self, layer: MoELayer, *, group: dist.ProcessGroup, ep: int, ep_rank: int,
                 shard: TokenShard | None = None) -> None:
        nn.Module.__init__(self)  # MoELayer.__init__ would build fresh experts from a config
        per_rank = layer.num_experts // ep
        self.router = layer.router
        local = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        self.experts = nn.ModuleDict({str(e): layer.experts[e] for e in local})
        self.shared = layer.shared
        self.num_experts, self.top_k = layer.num_experts, layer.top_k
        self.capacity_factor, self.aux_loss_coef = layer.capacity_factor, layer.aux_loss_coef
        self.aux_loss: torch.Tensor | None = None
        self.group, self.ep = group, ep
        self.shard = shard  # folded: this rank dispatches only its share of the tokens (experts_exchange)

    def tp_whole_linears(self) -> tuple[str, ...]:
        """Folded, the local experts stay whole too: the ranks of a tensor-parallel group hold different experts."""
        if self.shard is None:
            return super().tp_whole_linears()
        linears = [name for name, module in self.experts.named_modules() if isinstance(module, nn.Linear)]
        return ("router", *(f"experts.{name}" for name in linears))

    def _routed_output(self, tokens: torch.Tensor, slot: torch.Tensor, capacity: int, weights: torch.Tensor) -> torch.Tensor:
        """Folded: this rank's share of the combine (zero for the other ranks' tokens), summed over the
        tensor-parallel group; the inputs' gradients (each rank's share) summed there too."""
        if self.shard is None:
            return super()._routed_output(tokens, slot, capacity, weights)
        group = self.shard.group
        tokens, weights = copy_to_group(tokens, group), copy_to_group(weights, group)
        return reduce_over_group(super()._routed_output(tokens, slot, capacity, weights), group)  # (N, H)

    def _run_experts(self, tokens: torch.Tensor, slot: torch.Tensor, capacity: int) -> torch.Tensor:
        """Outputs for every slot of this rank's dispatch buffer, ``(E*C + 1, H)``, the last row zeros (as in
        ``MoELayer``): filled slots go to the experts' ranks and come back; empty slots stay zero."""
        N, H = tokens.shape
        filler = slot_tokens(slot, tokens=N, slots=self.num_experts * capacity, top_k=self.top_k)  # (E*C,)
        filled = filler < N if self.shard is None else self.shard.holds(filler, N)  # (E*C,)
        sent = filled.nonzero().squeeze(1)  # (S,) filled slots, expert-major: each expert's are contiguous
        counts = filled.view(self.num_experts, capacity).sum(1)  # (E,) rows this rank sends each expert
        received = exchange_counts(counts, self.group, self.ep)  # (ep, E/ep): rows each peer sends each local expert
        send_splits, recv_splits = split_sizes(counts, received, self.ep)  # rows to / from each peer
        rows = all_to_all(tokens[filler[sent]], recv_splits, send_splits, self.group)  # (R, H)
        outputs = self._run_local_experts(rows, received)  # (R, H)
        back = all_to_all(outputs, send_splits, recv_splits, self.group)  # (S, H)
        return tokens.new_zeros(self.num_experts * capacity + 1, H).index_copy(0, sent, back)  # (E*C + 1, H)

    def _run_local_experts(self, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """Run each local expert once on its rows from every peer; outputs in the order ``rows`` arrived.

        ``rows`` arrive peer-major (peer, then local expert, then slot); group them expert-major, run, undo.
        """
        expert_of_row = local_expert_of_rows(received)  # (R,)
        order = torch.argsort(expert_of_row, stable=True)  # (R,)
        grouped = rows[order].split(received.sum(0).tolist())  # E/ep chunks, (R_e, H) each
        outputs = torch.cat([self._run_expert(expert, chunk) for expert, chunk in zip(self.experts.values(), grouped)])
        return outputs[torch.argsort(order)]  # (R, H) back in arrival order

    def _run_expert(self, expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """``expert(rows)`` with its weight gradients divided by ``ep`` and the rows' gradients unchanged: the
        data-parallel wrapping averages them over ``edp``, so they are averaged over ``dp`` like the dense ones."""
        return with_expert_gradient_scale(expert, rows, expert_gradient_scale(self.ep, self.shard))  # (R_e, H)


# --------------------------------------------------------------------------------------------- applying it


def check_expert_parallel(model: nn.Module, strategy: Strategy, *, selective_recompute: bool = False) -> None:
    """Raise ``NotModelledError`` naming what the runtime cannot do for ``ep > 1`` on ``model``.

    Selective recomputation of a block is refused: the experts are FSDP2 units inside the block, and their
    hooks issue a different sequence of ops when the block is recomputed than when it first ran, which
    selective checkpointing (it replays saved ops by count) rejects. Full recomputation works. Stacked experts
    modules (``runtime.hf_experts``) have their own limits (``check_stacked_experts``).
    """
    check_expert_folding(strategy)
    # The layers capture also looks for (cost_models.types.RUNTIME_SPLITS), so a plan only asks ep of a model holding them.
    layers = [module for module in model.modules() if runtime_splits("ep", type(module))]
    # sp: a MoELayer dispatches a flat buffer of its tokens, not a sequence; stacked experts modules get the whole
    # sequence gathered where their block's MLP begins (runtime.tp_experts), so ep x tp x sp runs for them (unfolded;
    # folded + sp is not measured)
    sp_refused = strategy.sp and (bool(layers) or strategy.expert_tp != strategy.tp)
    unsupported = {"sp": sp_refused, "selective recomputation": selective_recompute}
    for name, used in unsupported.items():
        if used:
            raise NotModelledError(
                f"strategy {strategy.to_string()!r}: expert parallelism together with {name} is not implemented by "
                f"the runtime; plan with ep=1 or without {name}"
            )
    stacked = check_stacked_experts(model, strategy, stacked_experts_candidates(model))
    if not layers and not stacked:
        raise NotModelledError(f"ep={strategy.ep} but the model has no MoE layer (tessera.models.moe.MoELayer) or "
                               "experts module to split; plan it with ep=1")
    for layer in layers:
        if layer.num_experts % strategy.ep:
            raise NotModelledError(f"{layer.num_experts} experts cannot be split evenly over ep={strategy.ep}; "
                                   f"plan with an ep that divides {layer.num_experts}")


def check_expert_folding(strategy: Strategy) -> None:
    """Raise ``NotModelledError`` for the experts' own tensor-parallel degrees the runtime does not run: it folds
    to ``etp = 1`` (``runtime.mesh.expert_grid``) with ``ep > 1``, without context parallelism, and where the
    experts' replicas are averaged (some data-parallel wrapping: ``dp > 1`` or ZeRO >= 1)
    (``cost_models.folding.folding_refusal`` says which, in one line)."""
    problem = folding_refusal(strategy)
    if problem is not None:
        raise NotModelledError(f"strategy {strategy.to_string()!r}: {problem}")


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, *, ep: int) -> None:
    """Replace every ``MoELayer`` of ``model`` (in place) by an :class:`ExpertParallelMoE`, and every stacked experts
    module by a ``ShardedExperts``, over the mesh's ep axis (and its tp axis when tp > 1: each expert's hidden
    width split too), or, folded (``runtime.mesh.is_folded``), over the experts' own grid with whole experts, each
    rank dispatching its share of its tensor-parallel group's tokens; the experts other ranks hold are dropped
    (every rank must hold the same weights beforehand)."""
    folded = is_folded(mesh, ep)
    if mesh[EP].size() != ep and not folded:
        raise RuntimeSetupError(f"the mesh's ep axis has {mesh[EP].size()} ranks but the plan says ep={ep}; "
                                "build the mesh from the plan's strategy (runtime.mesh.build_mesh)")
    experts_mesh = expert_grid(mesh, ep)[FOLDED_EP] if folded else mesh[EP]
    shard = TokenShard(mesh.get_local_rank(TP), mesh[TP].size(), mesh.get_group(TP)) if folded else None
    group, ep_rank = experts_mesh.get_group(), experts_mesh.get_local_rank()
    for name, layer in list(model.named_modules()):
        if isinstance(layer, MoELayer) and not isinstance(layer, ExpertParallelMoE):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    ExpertParallelMoE(layer, group=group, ep=ep, ep_rank=ep_rank, shard=shard))
    split_over_tp = mesh[TP].size() > 1 and not folded
    apply_stacked_experts(model, mesh[EP, TP] if split_over_tp else experts_mesh, shard=shard)


def expert_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(FQN, module) of the modules holding this rank's experts, each wrapped on its own over ``edp``: every local
    expert of an ``ExpertParallelMoE``, every ``ShardedExperts`` (its stacked shards)."""
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            yield from ((f"{name}.experts.{key}", expert) for key, expert in module.experts.items())
        elif isinstance(module, ShardedExperts):
            yield name, module


def apply_expert_data_parallel(
    model: nn.Module, mesh: DeviceMesh, *, strategy: Strategy, mp_policy: MixedPrecisionPolicy,
    block_reshard: Mapping[str, bool] | None = None,
) -> None:
    """Average each local expert's gradient over the ``edp`` (x ``cp``) ranks holding it; ``1/ep`` is applied in
    backward (``experts_exchange.with_expert_gradient_scale``), so it ends up divided by ``dp`` (x ``cp``) like the
    dense ones.

    ZeRO-0 replicates each expert unit (FSDP2 ``replicate``); ZeRO-1/2/3 shard it over those ranks like the dense
    units (a stacked unit's parameters are ep-sharded ``DTensor`` s: FSDP2 shards them over ``edp`` x ``ep``).
    Under ZeRO-3 a unit reshards after forward as the block holding it does (``block_reshard``: block FQN ->
    ``Strategy.reshards_block``; a block not named reshards). Call before the dense data-parallel wrapping, which
    then leaves the experts alone.
    """
    edp_mesh = expert_grid(mesh, strategy.ep)[FOLDED_EDP] if folds_experts(strategy) else expert_data_mesh(mesh)
    for name, unit in list(expert_units(model)):
        if strategy.zero == 0:
            replicate(unit, mesh=edp_mesh, mp_policy=mp_policy)
        else:
            reshard = strategy.zero == 3 and _block_reshards(name, block_reshard or {})
            fully_shard(unit, mesh=edp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)


def _block_reshards(unit: str, block_reshard: Mapping[str, bool]) -> bool:
    """Whether the block holding ``unit`` reshards after forward (True when no entry names it)."""
    return next((keep for block, keep in block_reshard.items() if unit.startswith(f"{block}.")), True)
