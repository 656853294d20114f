"""Expert parallelism for mixture-of-experts blocks Tessera did not write: Hugging Face transformers 5's Mixtral,
Qwen2-MoE (shared expert and its gate), Qwen3-MoE and every block whose experts module keeps all experts' weights
stacked on dim 0 and is called as ``experts(hidden_states, top_k_index, top_k_weights)``
(``models.moe.stacked_experts_problem`` says exactly what qualifies; the blocks' configs declare the same module as
``ep_dispatch_experts`` in ``base_model_ep_plan``).

**Only the experts module is replaced**, by :class:`ShardedExperts`; the block's own forward still runs:
its router (top-k, softmax before or after, ``norm_topk_prob`` or not), router jitter, shared expert and
shared-expert gate are the model's code, called exactly as in one process, on this rank's tokens. The new module
takes the router's choices, sends each (token, expert) pair's row to the rank holding that expert
(``runtime.experts_exchange``), runs the local experts there with the original module's own forward (its
``config._experts_implementation``: eager, batched or grouped matmuls), each row as a top-1 choice of weight 1,
brings the outputs back and applies the routing weights on the sending rank, summed per token as the original
does. The dispatch is dropless (no capacity), as the original: training equals one process on the same rows.
transformers 5.24 has a dispatch of its own (``transformers.distributed.expert_parallel``), applied from its
``DistributedConfig`` mesh; this one runs on the plan's mesh with the exchange and the expert-gradient scaling that
Tessera's own MoE layer uses, so both kinds compose with the runtime's data-parallel and pipeline axes alike.

**Parameters.** The stacked weights (``gate_up_proj``, ``down_proj``, biases) stay registered under their FQNs on
the new module, as ``DTensor`` s sharded on dim 0 over the mesh's ep axis (``Shard(0)``: this rank's ``E / ep``
experts), so ``full_tensor()``, ``state_dict`` and ``torch.distributed.checkpoint`` see the whole stack. The
original module computes on their local shards, handed to it per call (``torch.func.functional_call``); it is
kept out of the module tree. Expert data parallelism (FSDP2 over ``edp``, ``runtime.expert_parallel``) wraps the new
module: FSDP2 composes a data-parallel mesh with an ep-sharded ``DTensor`` (its 2-D "FSDP + EP" layout).

**Load-balancing loss.** ``router_logits`` in the model's output are recorded by the model's own hooks on its
router, which still runs on this rank's tokens: they are exactly the single-process router's logits for these
rows. An auxiliary loss computed from them (``output_router_logits=True``) is therefore this rank's batch's
loss, as under plain data parallelism: the Switch loss multiplies two batch means, so the ``dp`` ranks' average
of it is not the global batch's value (Megatron-Core and torchtitan likewise balance per micro-batch).

**Pipeline parallelism** composes (the runtime's pipeline calls each planned block as the user's eager module;
an ep group is ranks of one stage, running the same chunks on the same micro-batch schedule), with 1F1B, GPipe,
interleaved schedules and ZeRO 0-3, and zero-bubble with ZeRO-0.

**Tensor parallelism** (expert tensor parallelism = tp, Megatron-Core's default): each expert's gate/up projection
is split column-wise and its down projection row-wise over the tp axis (``cost_models.tp_rules.expert_tp_dims``),
so every tensor-parallel rank runs all of its tokens' (token, expert) pairs on its slice of the hidden width and
holds a partial sum of the combined output; one all-reduce over tp completes it (``experts_exchange``'s
``reduce_over_group``), and the tokens and routing weights enter through ``copy_to_group``, so their gradients
(partial on each rank) are summed: the router, which stays whole on every rank, gets exactly the single-process
gradient. With expert parallelism too, the parameters are ``DTensor`` s over the ``(ep, tp)`` mesh and the ep
exchange runs on every tensor-parallel rank alike (its peers are the ranks of its tp index, which see the same
tokens); the tp reduction follows the combine. ``runtime.tensor_parallel`` splits the rest of the block (the
router and gates whole, a shared expert like a dense MLP) and, with sequence parallelism, gathers the tokens where
they enter the MoE block and keeps this rank's share of its output.

**Folded experts** (``etp = 1 < tp``, ``runtime.expert_parallel``): the parameters are ``DTensor`` s sharded on dim 0
over the folded grid's ``expert_ep`` axis, whole in width; each tensor-parallel rank exchanges its share of the
tokens (``experts_exchange.TokenShard``) and the one reduction over tp adds the shares' combined outputs.

Not implemented (refused by :func:`check_stacked_experts` with the combination's name): context parallelism
together with expert parallelism on these blocks; experts with biases or a post-expert norm under tp; the zero-bubble schedule with ZeRO > 0 (Qwen3-MoE
under ``dp=2,ep=2,pp=2,zero=3``: the second step's loss is off by 2.5e-5 relative, cause not found); experts held in a ``ModuleList`` that their block
runs itself (transformers 4's layout, or a home-grown block): the block's own forward would have to be rewritten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.cost_models.tp_rules import expert_hidden_width, expert_tp_dims
from tessera.cost_models.types import Strategy, runtime_splits
from tessera.errors import NotModelledError
from tessera.models.moe import STACKED_EXPERTS_CALL, stacked_experts_problem, sum_rows
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
from tessera.runtime.mesh import EP, FOLDED_EP, TP


class ShardedExperts(nn.Module):
    """Stands in for a stacked experts module split over ``mesh``: its ``ep`` axis holds ``E / ep`` whole experts per
    rank and reaches the others by all-to-all; its ``tp`` axis splits each expert's hidden width (gate/up
    column-wise, down row-wise: ``cost_models.tp_rules.expert_tp_dims``). Parameters are ``DTensor`` s under the
    original FQNs (``Shard(0)`` over ep, the hidden-width shard over tp).

    ``experts`` must satisfy ``stacked_experts_problem`` and hold the same weights on every rank of ``mesh`` (its
    dims named ``ep`` and/or ``tp``); it keeps its class, config and activation, gives its parameters to this module
    and computes the local shards.
    """

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, *, shard: TokenShard | None = None) -> None:
        super().__init__()
        axes = mesh.mesh_dim_names
        ep_axis = next((axis for axis in (EP, FOLDED_EP) if axis in axes), None)
        self.num_experts = experts.num_experts
        self.ep = mesh.size(axes.index(ep_axis)) if ep_axis else 1
        self.group = mesh.get_group(ep_axis) if ep_axis else None  # the token exchange
        self.shard = shard  # folded: this rank dispatches its share of the tokens, whole experts
        # the partial sums: of experts split over tp, or of the token shares of folded ones
        self.tp_group = shard.group if shard is not None else mesh.get_group(TP) if TP in axes else None
        tp_dims = expert_tp_dims(experts) if TP in axes else {}
        for name, param in list(experts.named_parameters(recurse=False)):
            placements = ([Shard(0)] if ep_axis else []) + ([_tp_placement(*tp_dims[name])] if TP in axes else [])
            shard = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)  # local part, none sent
            self.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
            delattr(experts, name)
        experts.num_experts = self.num_experts // self.ep  # the original forward now sees local expert indices
        self.__dict__["local_experts"] = experts  # not a submodule: its weights are this module's

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # (N, H)
        if self.tp_group is not None:  # each tp rank computes a partial sum: the inputs' gradients are summed
            tokens, top_k_weights = copy_to_group(tokens, self.tp_group), copy_to_group(top_k_weights, self.tp_group)
        if self.shard is not None:
            combined = self._exchange_share(tokens, top_k_index, top_k_weights)
        elif self.ep > 1:
            combined = self._exchange(tokens, top_k_index, top_k_weights)  # (N, H)
        else:
            combined = self._run_rows(tokens, top_k_index, top_k_weights)  # (N, H)
        if self.tp_group is not None:
            combined = reduce_over_group(combined, self.tp_group)  # one reduction of the combined output
        return combined if hidden_states.dim() == 2 else combined.view(hidden_states.shape)  # a view only if asked

    def _exchange_share(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Folded: the exchange of this rank's share of the tokens; zero rows for the rest (summed over tp after)."""
        start, stop = self.shard.bounds(tokens.shape[0])
        share = self._exchange(tokens[start:stop], top_k_index[start:stop], top_k_weights[start:stop])
        return F.pad(share, (0, 0, start, tokens.shape[0] - stop))  # (N, H)

    def _exchange(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) row to the ep rank holding the expert and back, weighted and summed per token."""
        top_k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)  # (N*k,) every token's choices in turn
        order = torch.argsort(chosen, stable=True)  # (N*k,) expert-major, so grouped by the rank holding each
        counts = torch.bincount(chosen, minlength=self.num_experts)  # (E,)
        received = exchange_counts(counts, self.group, self.ep)  # (ep, E/ep)
        sent, arrived = split_sizes(counts, received, self.ep)
        rows = all_to_all(tokens[order // top_k], arrived, sent, self.group)  # (R, H)
        scale = expert_gradient_scale(self.ep, self.shard)
        outputs = with_expert_gradient_scale(lambda x: self._run_local_experts(x, received), rows, scale)
        back = all_to_all(outputs, sent, arrived, self.group)  # (N*k, H) in ``order``
        weighted = (back * top_k_weights.reshape(-1)[order].unsqueeze(-1)).to(tokens.dtype)  # (N*k, H)
        return sum_rows(order // top_k, weighted, tokens)  # (N, H)

    def _run_local_experts(self, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert, unweighted, ``(R, H)``."""
        experts = local_expert_of_rows(received).unsqueeze(1)  # (R, 1)
        if rows.shape[0] == 0:  # one zero row through expert 0, dropped: keeps the weights and exchange in backward,
            return self._run_rows(rows.sum(0, keepdim=True), experts.new_zeros(1, 1))[:0]  # which the peers wait on
        return self._run_rows(rows, experts)

    def _run_rows(self, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The original forward on this rank's shards of the stacked weights (each row a top-1 choice of weight 1
        unless ``weights`` are given)."""
        local = {name: _local(p) for name, p in self.named_parameters()}
        weights = rows.new_ones(rows.shape[0], 1) if weights is None else weights  # (R, k)
        return torch.func.functional_call(self.local_experts, local, (rows, experts, weights))  # (R, H)


def _tp_placement(dim: int, parts: int) -> Placement:
    """Each rank's slice of the hidden width; of each of ``parts`` packed blocks (gate|up) when packed."""
    return Shard(dim) if parts == 1 else _StridedShard(dim, split_factor=parts)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``param`` as a plain tensor (autograd reaches ``param``). ``to_local()`` marks its result
    as a parameter (``_is_param``), which ``functional_call`` would try to register; a view is not marked."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.view_as(local)


def stacked_experts_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> every module named ``experts`` in ``model`` outside a layer ``RUNTIME_SPLITS["ep"]`` names (Tessera's
    ``MoELayer``, split whole by ``runtime.expert_parallel``) and not yet expert-parallel."""
    modules = dict(model.named_modules())
    return {name: module for name, module in modules.items()
            if name.rpartition(".")[2] == "experts" and not isinstance(module, ShardedExperts)
            and not runtime_splits("ep", type(modules[name.rpartition(".")[0]]))}


def check_stacked_experts(model: nn.Module, strategy: Strategy, candidates: dict[str, nn.Module]) -> int:
    """Raise ``NotModelledError`` naming the first experts module of ``candidates`` that ep cannot split, or a
    combination not implemented for them; returns how many there are (all of them split)."""
    for name, experts in candidates.items():
        problem = stacked_experts_problem(experts)
        if problem is not None:
            block = name.rpartition(".")[0]
            owner = type(model.get_submodule(block)).__name__ if block else type(model).__name__
            raise NotModelledError(
                f"ep={strategy.ep}: the experts of {block or 'the model'} ({owner}) cannot be split: {problem}; "
                f"expert parallelism splits tessera.models.moe.MoELayer and experts modules called as "
                f"{STACKED_EXPERTS_CALL} with every expert's weights stacked on dim 0 (transformers 5); plan with ep=1"
            )
        if experts.num_experts % strategy.ep:
            raise NotModelledError(f"{experts.num_experts} experts of {name} cannot be split evenly over "
                                   f"ep={strategy.ep}; plan with an ep that divides {experts.num_experts}")
    if strategy.expert_tp > 1 and candidates:
        check_experts_tensor_parallel(candidates, strategy.expert_tp)
    zero_bubble = strategy.pp > 1 and strategy.schedule == "zero-bubble" and strategy.zero > 0
    unsupported = {"context parallelism": strategy.cp > 1,
                   "schedule=zero-bubble and ZeRO > 0 (measured: losses differ from one process)": zero_bubble}
    for combination, used in unsupported.items():
        if used and candidates:
            raise NotModelledError(
                f"strategy {strategy.to_string()!r}: expert parallelism of stacked experts modules "
                f"({next(iter(candidates))}) together with {combination} is not implemented by the runtime; plan "
                "with ep=1 or without it"
            )
    return len(candidates)


def check_experts_tensor_parallel(candidates: dict[str, nn.Module], tp: int) -> None:
    """Raise ``NotModelledError`` naming the first experts module of ``candidates`` that ``tp`` cannot split."""
    for name, experts in candidates.items():
        try:
            width = expert_hidden_width(experts)
        except NotModelledError as error:
            raise NotModelledError(f"tp={tp}: {name}: {error}") from None
        if width % tp:
            raise NotModelledError(f"{name}: each expert's hidden width {width} is not divisible by tp={tp}; plan "
                                   f"with a tp that divides {width}")


def apply_stacked_experts(model: nn.Module, mesh: DeviceMesh, *, shard: TokenShard | None = None) -> None:
    """Replace every stacked experts module of ``model`` (in place) by a :class:`ShardedExperts` over ``mesh`` (its
    dims named ``ep`` and/or ``tp``, or the folded grid's ``expert_ep`` with this rank's token ``shard``)."""
    for name, experts in stacked_experts_candidates(model).items():
        if stacked_experts_problem(experts) is None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, ShardedExperts(experts, mesh, shard=shard))
