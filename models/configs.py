"""The shapes of the reference models (``GPTConfig``, ``LlamaConfig``, ``MoEConfig``), validated when made.

Plain dataclasses that import neither torch nor the model code, so a spec (``gpt-tiny:layers=4``) is parsed
and checked in milliseconds, before anything heavy is loaded (``tessera.models.presets``; the CLI checks
``--model`` this way). Each model module re-exports its config (``tessera.models.gpt.GPTConfig``). Bounds
and finiteness: ``tessera.models.limits``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from tessera.errors import ModelSpecError
from tessera.models.limits import (
    MAX_CAPACITY_FACTOR, MAX_EXPERT_MODULES, check_dimension, check_dimensions, check_finite,
)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. ``seq_len`` is the number of learned positions (the longest sequence)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int | None = None
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_dimensions(self, ("layers", "hidden", "heads", "vocab", "seq_len"), family="GPT")
        if self.ffn_hidden is not None:
            check_dimension("ffn_hidden", self.ffn_hidden, family="GPT")
        check_finite("dropout", self.dropout, family="GPT")
        if self.hidden % self.heads:
            raise ModelSpecError(
                f"GPT hidden={self.hidden} is not divisible by heads={self.heads}; pick heads that divide hidden"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelSpecError(f"GPT dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn(self) -> int:
        """MLP width: ``ffn_hidden`` or 4 * hidden."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.hidden // self.heads


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama model. ``seq_len`` is the longest sequence the RoPE tables cover."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    rope_theta: float = 500000.0
    tie_embeddings: bool = False
    attention_head_dim: int = 0
    """Features per attention head where a model declares its own (Gemma 3 27B: 128, where hidden / heads is 168;
    Hugging Face's ``head_dim``); 0: hidden / heads."""

    family: ClassVar[str] = "Llama"
    """Name errors use (a subclass's own)."""
    positive_fields: ClassVar[tuple[str, ...]] = (
        "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len"
    )
    """Fields that must be whole numbers from 1 to their bound (``tessera.models.limits``), checked in this order."""

    def __post_init__(self) -> None:
        check_dimensions(self, self.positive_fields, family=self.family)
        check_finite("rope_theta", self.rope_theta, family=self.family, positive=True)
        if self.attention_head_dim:
            check_dimension("attention_head_dim", self.attention_head_dim, family=self.family,
                            label=f"{self.family} head_dim")
            if self.attention_head_dim % 2:
                raise ModelSpecError(f"{self.family} head_dim={self.attention_head_dim} must be even (RoPE rotates "
                                     "pairs)")
        elif self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ModelSpecError(
                f"{self.family} hidden={self.hidden} must split into heads={self.heads} of even size "
                "(RoPE rotates pairs), or give head_dim"
            )
        if self.heads % self.kv_heads:
            raise ModelSpecError(f"{self.family} heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        """Features per attention head: the declared ``attention_head_dim``, else hidden / heads."""
        return self.attention_head_dim or self.hidden // self.heads


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """Shape of a mixture-of-experts model: a Llama shape (``ffn_hidden`` is each expert's) plus the routing.

    The fields added here are keyword-only (they follow Llama's defaulted fields).
    """

    experts: int
    top_k: int = 2
    shared_ffn: int = 0
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.01
    rope_theta: float = 1000000.0  # Mixtral's (Llama 3's is 500000)
    dense_layers: int = 0
    """The first ``dense_layers`` blocks are dense Llama blocks (DeepSeek-V3's ``first_k_dense_replace``)."""
    dense_ffn: int = 0
    """MLP width of the dense blocks (needed when ``dense_layers`` > 0)."""

    family: ClassVar[str] = "MoE"
    positive_fields: ClassVar[tuple[str, ...]] = LlamaConfig.positive_fields + ("experts", "top_k")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k > self.experts:
            raise ModelSpecError(f"MoE top_k={self.top_k} exceeds experts={self.experts}; pick top_k <= experts")
        if self.layers * self.experts > MAX_EXPERT_MODULES:
            raise ModelSpecError(f"MoE layers x experts = {self.layers * self.experts:,} is past Tessera's bound of "
                                 f"{MAX_EXPERT_MODULES:,} expert modules (tessera.models.limits); fewer layers or experts")
        check_dimension("shared_ffn", self.shared_ffn, family="MoE", minimum=0)
        check_dimension("dense_layers", self.dense_layers, family="MoE", minimum=0)
        check_dimension("dense_ffn", self.dense_ffn, family="MoE", minimum=0)
        if self.dense_layers >= self.layers or (self.dense_layers and not self.dense_ffn):
            raise ModelSpecError(f"MoE dense_layers={self.dense_layers} must be below layers={self.layers} and needs "
                                 f"dense_ffn (got {self.dense_ffn}); give both, or dense_layers=0")
        check_finite("capacity_factor", self.capacity_factor, family="MoE")
        check_finite("aux_loss_coef", self.aux_loss_coef, family="MoE")
        if not 0.01 <= self.capacity_factor <= MAX_CAPACITY_FACTOR or self.aux_loss_coef < 0:
            raise ModelSpecError(f"MoE capacity_factor must be >= 0.01 and <= {MAX_CAPACITY_FACTOR:g} (got "
                                 f"{self.capacity_factor}); aux_loss_coef non-negative (got {self.aux_loss_coef})")

    def dense_block_config(self) -> LlamaConfig:
        """The shape of a dense block: this attention, with a SwiGLU MLP of ``dense_ffn``."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(LlamaConfig)}
        return LlamaConfig(**{**fields, "ffn_hidden": self.dense_ffn})
