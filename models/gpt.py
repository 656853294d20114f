"""GPT (Megatron-LM style): learned positions, pre-LayerNorm blocks, GELU MLP, causal SDPA.

Module names are part of Tessera's contract (plans and tensor-parallel styles are keyed by them):
``tok_emb``, ``pos_emb``, ``blocks.{i}.attn_norm``, ``blocks.{i}.attn.{q,k,v,o}``, ``blocks.{i}.mlp_norm``,
``blocks.{i}.mlp.{up,down}``, ``ln_f``, ``head``. Query, key and value are separate ``nn.Linear`` so that
DTensor column-wise sharding keeps heads aligned; attention reshapes with ``-1`` heads so the same code runs
on tensor-parallel local shards.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.configs import GPTConfig

INIT_STD = 0.02
"""Weight init std of GPT-2 / Megatron-LM (Radford et al. 2019; Shoeybi et al. 2019)."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, h)
        self.v = nn.Linear(h, h)
        self.o = nn.Linear(h, h)
        self.head_dim = config.head_dim
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism the local projection holds heads / tp heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H)
        return self.o(y)  # (B, T, H)


class GPTMLP(nn.Module):
    """Two-layer GELU MLP (tanh approximation, as Megatron-LM and GPT-2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # (B, T, F) -> (B, T, H)


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = GPTMLP(config)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.attn_norm(x)), self.dropout, self.training)  # (B, T, H)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)  # (B, T, H)


class GPT(nn.Module):
    """GPT language model: ``forward(input_ids (B, T)) -> logits (B, T, vocab)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.tie_weights()
        if not self.tok_emb.weight.is_meta:  # on meta there is nothing to initialise (and normal_ is slow there)
            self.reset_parameters()

    def tie_weights(self) -> None:
        """Share ``tok_emb.weight`` with ``head`` when configured; ``to_empty`` from meta unties them."""
        if self.config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Initialise every parameter deterministically from the global torch RNG (call after ``to_empty``).

        Normal(0, 0.02) weights, zero biases, unit norms; residual output projections use
        0.02 / sqrt(2 * layers) (GPT-2 / Megatron-LM scaled init) so the residual stream does not grow with depth.
        """
        self.tie_weights()
        scaled_std = INIT_STD / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():  # fixed order -> same seed, same weights
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.head and self.config.tie_embeddings:
                    continue  # shares tok_emb.weight, already initialised
                std = scaled_std if name.endswith(("attn.o", "mlp.down")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)  # (B, T, H)
        x = F.dropout(x, self.config.dropout, self.training)  # (B, T, H)
        for block in self.blocks:
            x = block(x)  # (B, T, H)
        return self.head(self.ln_f(x))  # (B, T, V)
