"""Reference architectures (GPT, Llama, mixture-of-experts), configurable, buildable on meta, with named presets.

This package imports only torch, the standard library and ``tessera.errors``, so anything may import it. The
model classes (and torch) are imported on first use: the configs, presets and spec parsing
(``model_config("gpt-tiny:layers=4")``) load in milliseconds, so a bad spec fails before any heavy import.

>>> model = build_model("llama3-70b", device="meta")   # no memory: parameters are shapes only
>>> model = build_model("gpt-tiny")                    # real CPU weights, same seed -> same weights
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from tessera.models.configs import GPTConfig, LlamaConfig, MoEConfig
from tessera.models.presets import FAMILIES, PRESETS, ModelConfig, list_presets, parse_spec, with_override

if TYPE_CHECKING:
    import torch
    from torch import nn

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

_MODULES = {"GPT": "tessera.models.gpt", "Llama": "tessera.models.llama", "MoE": "tessera.models.moe"}
"""The model classes, imported on first use: specs are parsed and checked without importing torch."""
_CLASS_OF_CONFIG = {GPTConfig: "GPT", LlamaConfig: "Llama", MoEConfig: "MoE"}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'tessera.models' has no attribute {name!r}")
    return getattr(import_module(_MODULES[name]), name)


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
    import torch

    from tessera.models.meta_init import skipping_init_on_meta

    config = parse_spec(spec)
    with torch.device("meta"), skipping_init_on_meta():  # torch's own layers initialise themselves: nothing on meta
        model = __getattr__(_CLASS_OF_CONFIG[type(config)])(config)
    if torch.device(device).type != "meta":
        # Materialise, then initialise once: the RNG is consumed only by reset_parameters, so
        # "seed, build on meta, to_empty, seed, reset_parameters" (the distributed path) gives these same weights.
        model = model.to_empty(device=device)
        model.reset_parameters()
    if dtype is not None:
        model = model.to(dtype)
    model.name = spec
    return model
