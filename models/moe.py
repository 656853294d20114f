"""Mixture-of-experts transformer (Mixtral / DeepSeek style): Llama attention, routed SwiGLU experts.

Each block is ``x + attn(norm(x))`` then ``x + moe(norm(x))``. The MoE layer is a top-k softmax router
(Shazeer et al. 2017; top-2 with renormalised weights as Mixtral, Jiang et al. 2024, arXiv:2401.04088) over
``experts`` SwiGLU MLPs held in a ``ModuleList`` (so expert parallelism can place whole experts on ranks), plus an
optional always-on shared expert (DeepSeekMoE, Dai et al. 2024, arXiv:2401.06066).

Dispatch is capacity-based, as GShard (Lepikhin et al. 2020, arXiv:2006.16668) and Switch Transformer
(Fedus et al. 2022, arXiv:2101.03961): every expert processes exactly
``capacity = ceil(top_k * tokens / experts * capacity_factor)`` token slots. Assignments are queued per expert,
every token's first choice before any second choice; assignments past the capacity are dropped (their token
keeps the residual path), empty slots hold zeros. All shapes are static, so the layer traces with
``torch.fx`` and runs on the meta device, and what a planner measures on meta -- each expert at its expected
load ``top_k * tokens / experts`` times the capacity factor -- is what training runs. ``capacity_factor`` is the
knob for routing imbalance: 1.0 is the perfectly balanced expected load; Switch trains with 1.0-1.25.
Capture can override it for a measurement (``capture(..., expert_capacity_factor=...)``).

Load-balancing loss (Switch Transformer eq. 4): ``aux_loss_coef * experts * sum_e f_e * P_e`` with ``f_e`` the
fraction of routed assignments that chose expert ``e`` and ``P_e`` its mean router probability. Each MoE layer
stores its last value in ``.aux_loss``; ``MoE.aux_loss()`` sums them, so a training step adds
``model.aux_loss()`` to the language-model loss. Tracing does not store it (a traced value is not a tensor).

**Stacked experts** (:func:`stacked_experts_problem`) are the other MoE form expert parallelism splits: the experts
module of Hugging Face transformers 5 (every family in 5.24 that has routed experts: Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek, ...), which its block calls with the router's choices. The rule is the module's structure and call, not its
class, and lives here because both capture (``planner.capabilities``) and the runtime (``runtime.hf_experts``) read it.

Module names (Tessera's contract): ``tok_emb``, ``blocks.{i}.attn_norm``, ``blocks.{i}.attn.{q,k,v,o}``,
``blocks.{i}.mlp_norm``, ``blocks.{i}.moe.router``, ``blocks.{i}.moe.experts.{e}.{gate,up,down}``,
``blocks.{i}.moe.shared.{gate,up,down}``, ``norm``, ``head``.

The model is a ``Llama`` whose blocks put a ``MoELayer`` (named ``moe``) where Llama has its SwiGLU ``mlp``, and
``MoEConfig`` is a ``LlamaConfig`` with the routing fields: embedding, RoPE, attention, norms, head and
initialisation are Llama's own code.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.configs import MoEConfig
from tessera.models.llama import Llama, LlamaBlock, SwiGLU


def expert_capacity(tokens: int, *, experts: int, top_k: int, capacity_factor: float) -> int:
    """Token slots per expert: ceil(top_k * tokens / experts * capacity_factor).

    Integer arithmetic only (the factor is taken in hundredths), so it also runs on traced sizes.
    """
    percent = round(capacity_factor * 100)
    return (top_k * tokens * percent + experts * 100 - 1) // (experts * 100)


class MoELayer(nn.Module):
    """Top-k router, ``experts`` SwiGLU MLPs with capacity-based dispatch, optional shared expert."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden, config.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(config.hidden, config.ffn_hidden) for _ in range(config.experts))
        self.shared = SwiGLU(config.hidden, config.shared_ffn) if config.shared_ffn else None
        self.num_experts, self.top_k = config.experts, config.top_k
        self.capacity_factor = config.capacity_factor
        self.aux_loss_coef = config.aux_loss_coef
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)  # (N, H)
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E), fp32 as Mixtral / Switch
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)  # (N, k)
        choice = chosen.t().reshape(-1)  # (k*N,): every token's first choice, then every second choice
        onehot = (choice.unsqueeze(-1) == torch.arange(self.num_experts, device=x.device)).long()  # (k*N, E)
        self._store_aux_loss(probs, onehot)
        capacity = expert_capacity(
            tokens.size(0), experts=self.num_experts, top_k=self.top_k, capacity_factor=self.capacity_factor
        )
        slot = _slots(choice, onehot, capacity)  # (k*N,) in [0, E*C]; E*C means dropped
        y = self._routed_output(tokens, slot, capacity, weights)  # (N, H)
        if self.shared is not None:
            y = y + self.shared(tokens)  # (N, H)
        return y.view(B, T, H)

    def tp_whole_linears(self) -> tuple[str, ...]:
        """Linears (relative names) tensor parallelism keeps whole on every rank: the router (every rank routes the
        same tokens); the experts are split like the dense MLP unless a subclass places them itself."""
        return ("router",)

    def _routed_output(self, tokens: torch.Tensor, slot: torch.Tensor, capacity: int, weights: torch.Tensor) -> torch.Tensor:
        """Each token's routing-weighted sum of its experts' outputs, ``(N, H)``; ``weights`` is ``(N, k)``."""
        outputs = self._run_experts(tokens, slot, capacity)  # (E*C + 1, H); last row zeros
        return (outputs[slot].view(self.top_k, -1, tokens.shape[1]) * weights.t().unsqueeze(-1)).sum(0)  # (N, H)

    def _run_experts(self, tokens: torch.Tensor, slot: torch.Tensor, capacity: int) -> torch.Tensor:
        """Gather each expert's ``capacity`` tokens, run the experts, return their outputs plus a zero row."""
        N, H = tokens.shape
        filler = slot_tokens(slot, tokens=N, slots=self.num_experts * capacity, top_k=self.top_k)  # (E*C,); N = empty
        padded = torch.cat([tokens, tokens.new_zeros(1, H)])  # (N + 1, H); row N is the empty slot
        dispatched = padded[filler].view(self.num_experts, capacity, H)  # (E, C, H)
        outputs = torch.stack([expert(dispatched[e]) for e, expert in enumerate(self.experts)])  # (E, C, H)
        return torch.cat([outputs.view(-1, H), outputs.new_zeros(1, H)])  # (E*C + 1, H)

    def _store_aux_loss(self, probs: torch.Tensor, onehot: torch.Tensor) -> None:
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing() or torch.compiler.is_compiling():
            return  # a traced value is a proxy, not a loss
        fraction = onehot.float().mean(0)  # (E,) share of assignments per expert
        mean_prob = probs.mean(0)  # (E,)
        self.aux_loss = self.aux_loss_coef * self.num_experts * (fraction * mean_prob).sum()


def sum_rows(index: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``zeros_like(like).index_add(0, index, rows)``: each routed row added into its token's row (a combine), keeping
    the index alone for the backward. ``index_add``'s autograd keeps ``rows`` too (a copy per routed token, as large
    as the dispatched activations, for nothing but its gradient's shape), which transformers' grouped-matmul experts
    and Megatron-Core's unpermute do not keep."""
    return _SumRows.apply(index, rows, like)


class _SumRows(torch.autograd.Function):
    generate_vmap_rule = True  # torch.func's transforms (grad, vmap) compose with it

    @staticmethod
    def forward(index: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like).index_add(0, index, rows)  # out of place: vmap batches `rows` alone

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:  # noqa: ANN001
        (index,) = ctx.saved_tensors
        return None, grad.index_select(0, index), None


def slot_tokens(slot: torch.Tensor, *, tokens: int, slots: int, top_k: int) -> torch.Tensor:
    """The token in each of the ``slots`` dispatch slots (``tokens`` where empty), from each assignment's slot.

    ``slot`` is ``(k*N,)``, every token's first choice then every second choice (as ``_slots`` returns it).
    Shared with expert parallelism (``tessera.runtime.expert_parallel``), which must fill slots identically.
    """
    filler = torch.full((slots + 1,), tokens, dtype=torch.long, device=slot.device)
    token_of = torch.arange(tokens, device=slot.device).repeat(top_k)  # (k*N,)
    return filler.scatter(0, slot, token_of)[:-1]  # (E*C,); the last entry caught dropped assignments


def _slots(choice: torch.Tensor, onehot: torch.Tensor, capacity: int) -> torch.Tensor:
    """Dispatch-buffer slot of each assignment: expert * capacity + arrival order, or E*C when over capacity."""
    experts = onehot.size(-1)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # (k*N,) arrival order within its expert
    return torch.where(position < capacity, choice * capacity + position, experts * capacity)


class MoEBlock(LlamaBlock):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + moe(norm(x))."""

    def build_feed_forward(self, config: MoEConfig) -> None:
        """Register the routed experts as ``moe`` (in place of Llama's ``mlp``)."""
        self.moe = MoELayer(config)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)  # (B, T, H)


class MoE(Llama):
    """MoE language model: ``forward(input_ids (B, T)) -> logits (B, T, vocab)``; ``aux_loss()`` after it."""

    block_class = MoEBlock

    def aux_loss(self) -> torch.Tensor:
        """Sum of the blocks' load-balancing losses from the last forward (add it to the training loss)."""
        losses = [block.moe.aux_loss for block in self.blocks if block.moe.aux_loss is not None]
        if not losses:
            raise RuntimeError("aux_loss() is available after a forward pass")
        return torch.stack(losses).sum()


STACKED_EXPERTS_CALL = "experts(hidden_states, top_k_index, top_k_weights)"
"""How a block calls stacked experts: tokens ``(N, H)``, each token's experts ``(N, k)`` and routing weights ``(N, k)``;
it returns ``(N, H)``, each token's weighted sum of its experts' outputs."""


def stacked_experts_problem(experts: nn.Module) -> str | None:
    """Why expert parallelism cannot split ``experts`` as a stack of experts, or None when it can.

    The contract: ``forward`` takes three positional arguments (``STACKED_EXPERTS_CALL``) and computes, per
    (token, chosen expert) pair, that expert's output on the token times its weight, summed per token (what
    transformers' experts interface and its eager, batched and grouped implementations compute); ``num_experts``
    is an int; every parameter of the module itself has ``num_experts`` rows on dim 0 (expert ``e``'s weights
    are row ``e``), and it holds no buffers and no submodule with parameters (those would be shared by experts).
    """
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return f"they are a {type(experts).__name__} that the block runs itself, expert by expert"
    count = getattr(experts, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return "it declares no integer num_experts"
    arguments = list(inspect.signature(type(experts).forward).parameters.values())[1:]
    positional = [a for a in arguments if a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD)]
    required = [a for a in arguments if a.default is a.empty and a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD)]
    if len(positional) != 3 or len(required) > 3:
        return f"its forward is not called as {STACKED_EXPERTS_CALL}"
    own = dict(experts.named_parameters(recurse=False))
    if not own:
        return "it holds no parameters of its own"
    unstacked = [name for name, param in own.items() if param.dim() < 2 or param.shape[0] != count]
    if unstacked:
        return f"its parameter {unstacked[0]} is not stacked over its {count} experts on dim 0"
    shared = [name for name, _ in experts.named_parameters() if name not in own]
    if shared:
        return f"its parameter {shared[0]} belongs to a submodule that all experts share"
    buffer = next((name for name, _ in experts.named_buffers()), None)
    return None if buffer is None else f"it holds a buffer ({buffer})"
