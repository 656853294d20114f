"""Llama (2/3 family): RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases.

Module names are part of Tessera's contract: ``tok_emb``, ``blocks.{i}.attn_norm``, ``blocks.{i}.attn.{q,k,v,o}``,
``blocks.{i}.mlp_norm``, ``blocks.{i}.mlp.{gate,up,down}``, ``norm``, ``head``.

The skeleton (embedding, RoPE tables, blocks, final norm, head, initialisation) is shared with the
mixture-of-experts model (``models.moe``): its blocks differ only in their feed-forward half, so ``LlamaBlock``
builds and calls that half through :meth:`LlamaBlock.build_feed_forward` / :meth:`LlamaBlock.feed_forward`, and
``Llama`` builds its blocks from the class in ``block_class``.

RoPE uses real cos/sin tables (the "rotate half" form used by Hugging Face), not complex numbers, so the model
builds and runs on the meta device. The tables are non-persistent buffers on the root module, shared by every
block: they are recomputed by ``reset_parameters`` and never saved in a checkpoint. Llama 3.1's long-context
frequency scaling is not implemented (Llama 3 pre-trains at 8K context without it).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.configs import LlamaConfig

INIT_STD = 0.02
"""Weight init std (GPT-2 style; torchtitan's Llama uses the same for projections)."""
NORM_EPS = 1e-5
"""RMSNorm epsilon of Llama 3 (``norm_eps`` in Meta's released params.json)."""


def rope_tables(config: LlamaConfig, *, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim), computed in fp32."""
    hd = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)  # (hd/2,)
    positions = torch.arange(config.seq_len, device=device, dtype=torch.float32)  # (S,)
    angles = torch.outer(positions, inv_freq)  # (S, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (i, i + hd/2) of x (B, n, T, hd) by the angles in cos/sin (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, n, T, hd/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, n, T, hd)
    return x * cos + rotated * sin  # (B, n, T, hd)


class GroupedQueryAttention(nn.Module):
    """Causal attention where ``heads / kv_heads`` query heads share one key/value head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.q = nn.Linear(config.hidden, config.heads * hd, bias=False)
        self.k = nn.Linear(config.hidden, config.kv_heads * hd, bias=False)
        self.v = nn.Linear(config.hidden, config.kv_heads * hd, bias=False)
        self.o = nn.Linear(config.heads * hd, config.hidden, bias=False)
        self.head_dim = hd

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism the local projection holds heads / tp heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hd)
        return self.o(y)  # (B, T, H)


class SwiGLU(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020); ``hidden`` -> ``ffn_hidden`` -> ``hidden``."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, F) -> (B, T, H)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x)).

    A subclass replaces the feed-forward half by overriding :meth:`build_feed_forward` and :meth:`feed_forward`
    (registered last, after ``mlp_norm``: module order fixes the order weights are initialised in).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden, eps=NORM_EPS)
        self.attn = GroupedQueryAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden, eps=NORM_EPS)
        self.build_feed_forward(config)

    def build_feed_forward(self, config: LlamaConfig) -> None:
        """Register the feed-forward module (here ``mlp``, a SwiGLU)."""
        self.mlp = SwiGLU(config.hidden, config.ffn_hidden)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward half on the normalised input: (B, T, H) -> (B, T, H)."""
        return self.mlp(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, H)
        return x + self.feed_forward(self.mlp_norm(x))  # (B, T, H)


class Llama(nn.Module):
    """Llama language model: ``forward(input_ids (B, T)) -> logits (B, T, vocab)``."""

    block_class: ClassVar[type[LlamaBlock]] = LlamaBlock
    """The block every layer is (a subclass swaps in its own, e.g. ``MoEBlock``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(self.build_block(config, index) for index in range(config.layers))
        self.norm = nn.RMSNorm(config.hidden, eps=NORM_EPS)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.tie_weights()
        # Non-persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", torch.empty(config.seq_len, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.seq_len, config.head_dim), persistent=False)
        if not self.tok_emb.weight.is_meta:  # on meta there is nothing to initialise (and normal_ is slow there)
            self.reset_parameters()

    def build_block(self, config: LlamaConfig, index: int) -> LlamaBlock:
        """Block ``index``: a ``block_class``, except the first ``dense_layers`` a config may declare (DeepSeek-V3's
        dense first layers in front of its MoE layers), which are plain Llama blocks of the config's dense shape."""
        if index < getattr(config, "dense_layers", 0):
            return LlamaBlock(config.dense_block_config())
        return self.block_class(config)

    def tie_weights(self) -> None:
        """Share ``tok_emb.weight`` with ``head`` when configured; ``to_empty`` from meta unties them."""
        if self.config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise parameters from the global torch RNG and recompute the RoPE tables (call after ``to_empty``).

        Normal(0, 0.02) weights, unit norms; residual output projections (``attn.o`` and every ``down``: the
        MLP's, or each expert's and the shared expert's) use 0.02 / sqrt(2 * layers).
        """
        self.tie_weights()
        scaled_std = INIT_STD / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():  # fixed order -> same seed, same weights
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.head and self.config.tie_embeddings:
                    continue  # shares tok_emb.weight, already initialised
                std = scaled_std if name.endswith(("attn.o", ".down")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
        cos, sin = rope_tables(self.config, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        x = self.tok_emb(input_ids)  # (B, T, H)
        # torch.narrow, not slicing: fx cannot slice a buffer with a traced length.
        cos = torch.narrow(self.rope_cos, 0, 0, T).to(x.dtype)  # (T, hd)
        sin = torch.narrow(self.rope_sin, 0, 0, T).to(x.dtype)  # (T, hd)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, H)
        return self.head(self.norm(x))  # (B, T, V)
