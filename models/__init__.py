"""Reference architectures (GPT, Llama, mixture-of-experts), configurable, buildable on meta, with named presets.

This package imports only torch, the standard library and ``tessera.errors``, so anything may import it.

>>> model = build_model("llama3-70b", device="meta")   # no memory: parameters are shapes only
>>> model = build_model("gpt-tiny")                    # real CPU weights, same seed -> same weights
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.gpt import GPT, GPTConfig
from tessera.models.llama import Llama, LlamaConfig
from tessera.models.moe import MoE, MoEConfig
from tessera.models.presets import FAMILIES, PRESETS, ModelConfig, list_presets, parse_spec, with_override

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "ModelConfig",
    "build_model",
    "is_builtin_spec",
    "list_presets",
    "model_config",
    "with_override",
]

_MODEL_CLASSES: dict[type, type[nn.Module]] = {GPTConfig: GPT, LlamaConfig: Llama, MoEConfig: MoE}


def is_builtin_spec(spec: str) -> bool:
    """Whether ``spec`` names a built-in preset or family (``llama3-8b``, ``gpt3-175b:layers=4``, ``moe:...``)."""
    name = spec.strip().partition(":")[0].strip()
    return name in PRESETS or name in FAMILIES


def model_config(spec: str) -> ModelConfig:
    """The config dataclass a spec names (``llama3-8b``, ``gpt3-175b:layers=4``, ``gpt:layers=2,...``)."""
    return parse_spec(spec)


def build_model(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model a spec names on ``device`` ("meta" for planning: no memory is allocated).

    Weights are initialised from the global torch RNG by ``model.reset_parameters()``, so the same
    ``torch.manual_seed`` gives the same model in every process. The model carries ``model.config`` and
    ``model.name`` (the spec).
    """
    config = parse_spec(spec)
    with torch.device("meta"):
        model = _MODEL_CLASSES[type(config)](config)
    if torch.device(device).type != "meta":
        # Materialise, then initialise once: the RNG is consumed only by reset_parameters, so
        # "seed, build on meta, to_empty, seed, reset_parameters" (the distributed path) gives these same weights.
        model = model.to_empty(device=device)
        model.reset_parameters()
    if dtype is not None:
        model = model.to(dtype)
    model.name = spec
    return model
