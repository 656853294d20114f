"""Named model presets and the model spec grammar.

A spec is one of:

- a preset name: ``llama3-70b``
- a preset with overrides: ``gpt3-175b:layers=4,seq=1024``
- a family with every required field: ``gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64``,
  ``llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=192,vocab=256,seq=64`` or
  ``moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=64,experts=8,top_k=2``

Keys are the config field names; ``seq``, ``ffn``, ``tie``, ``theta``, ``shared``, ``capacity`` and ``head_dim``
are accepted as short forms of ``seq_len``, ``ffn_hidden``, ``tie_embeddings``, ``rope_theta``, ``shared_ffn``,
``capacity_factor`` and ``attention_head_dim``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math

from tessera.errors import ModelSpecError
from tessera.models.configs import GPTConfig, LlamaConfig, MoEConfig

ModelConfig = GPTConfig | LlamaConfig | MoEConfig

FAMILIES: dict[str, type[GPTConfig] | type[LlamaConfig] | type[MoEConfig]] = {
    "gpt": GPTConfig,
    "llama": LlamaConfig,
    "moe": MoEConfig,
}
"""Family name -> config class, for ``family:key=value,...`` specs."""

ALIASES = {
    "seq": "seq_len",
    "ffn": "ffn_hidden",
    "tie": "tie_embeddings",
    "theta": "rope_theta",
    "shared": "shared_ffn",
    "capacity": "capacity_factor",
    "head_dim": "attention_head_dim",
}
"""Short override keys accepted in specs."""

PRESETS: dict[str, ModelConfig] = {
    # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (n_layers, d_model, n_heads,
    # context 2048). Vocabulary 51200 is the GPT-2 BPE (50257) padded as in Megatron-LM: Narayanan et al. 2021,
    # "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1 / Section 5.
    # Table 2.1 prints d_model=5140 for 13B; 5120 (40 heads x 128) is the consistent value.
    "gpt3-2.7b": GPTConfig(layers=32, hidden=2560, heads=32, vocab=51200, seq_len=2048),
    "gpt3-6.7b": GPTConfig(layers=32, hidden=4096, heads=32, vocab=51200, seq_len=2048),
    "gpt3-13b": GPTConfig(layers=40, hidden=5120, heads=40, vocab=51200, seq_len=2048),
    "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048),
    # Llama 3: Llama Team 2024, "The Llama 3 Herd of Models", Table 3 (layers, model dim, FFN dim, heads,
    # kv heads, RoPE theta 500000; 8K pre-training context, Section 3.4). Vocabulary 128256 = 128000 tokens
    # + 256 reserved special tokens, from the released config.json (``vocab_size``).
    "llama3-8b": LlamaConfig(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq_len=8192
    ),
    "llama3-70b": LlamaConfig(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256, seq_len=8192
    ),
    "llama3-405b": LlamaConfig(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256, seq_len=8192
    ),
    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088), Table 1: dim 4096, n_layers 32,
    # head_dim 128 (32 heads), hidden_dim 14336, n_kv_heads 8, context_len 32768, vocab_size 32000, 8 experts,
    # top-2. RoPE theta 1e6 from the released config.json (``rope_theta``). 46.7B parameters (12.9B active).
    "mixtral-8x7b": MoEConfig(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000, seq_len=32768, experts=8, top_k=2
    ),
    # DeepSeek-V3-shaped: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), Sec. 4.2
    # "Hyper-Parameters": 61 layers, hidden 7168, 128 attention heads, the first 3 layers dense (released config.json:
    # ``first_k_dense_replace`` 3, ``intermediate_size`` 18432), every other layer 1 shared + 256 routed experts of
    # intermediate size 2048 (``moe_intermediate_size``), 8 routed experts per token; vocabulary 129280 from the
    # released config.json (``vocab_size``); 4K pre-training context (Sec. 4.2), RoPE theta 10000 (config.json).
    # Approximations, stated: (1) attention is Tessera's GQA, not Multi-head Latent Attention. kv_heads=128
    # (plain multi-head) because it matches MLA's parameter count best: q/o 2 x 7168^2 + k/v 2 x 7168 x 128 x 56
    # = 205M per layer against MLA's ~187M (q down/up 11M + 38M, kv down/up 4M + 17M, o 117M); our head_dim is
    # hidden / heads = 56 where MLA's is 128 (+64 RoPE), so attention-core FLOPs are ~3x lower than MLA's (a
    # few percent of the step at 4K), and priced at a fused kernel's rate on heads of 56, slower than on MLA's
    # (``topology.head_dims``): about half of MLA's attention time in all. Fewer kv heads would undercount
    # parameters; MLA's latent KV compression saves inference memory, not training work. (2) Multi-token
    # prediction and the router's node-limited, bias-based balancing are not modelled (top-8 softmax router, aux
    # loss). Result: 672B parameters (paper: 671B), 38.7B active (37B).
    "deepseek-v3": MoEConfig(
        layers=61, hidden=7168, heads=128, kv_heads=128, ffn_hidden=2048, vocab=129280, seq_len=4096,
        experts=256, top_k=8, shared_ffn=2048, rope_theta=10000.0, dense_layers=3, dense_ffn=18432,
    ),
    # Gemma 3 27B's shape on Tessera's Llama (Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786,
    # Table 1 and the released config.json: 62 layers, hidden 5376, 32 heads, 16 KV heads, intermediate 21504,
    # vocabulary 262144 = 256K, tied embeddings, 128K context; ``rope_theta`` 1e6 of its global layers; heads of
    # 128, its config.json's ``head_dim``, where hidden / heads would be 168): 27.0B parameters. Approximations,
    # stated: its MLP is GeGLU (here SwiGLU: same shapes), and its 5 local sliding-window (1024) layers per global
    # one are global here (Tessera's attention has no window; captured Hugging Face Gemma 3 reports them as
    # ``local-attention``). The 256K-vocabulary model of the set.
    "gemma3-27b": LlamaConfig(
        layers=62, hidden=5376, heads=32, kv_heads=16, ffn_hidden=21504, vocab=262144, seq_len=131072,
        rope_theta=1000000.0, attention_head_dim=128, tie_embeddings=True,
    ),
    # Test presets: well under 1M parameters, so real CPU runs take milliseconds.
    "gpt-tiny": GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq_len=64),
    "llama-tiny": LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=192, vocab=256, seq_len=64),
    "moe-tiny": MoEConfig(
        layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq_len=64, experts=4, top_k=2
    ),
}
"""Preset name -> config."""


def list_presets() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(PRESETS)


def parse_spec(spec: str) -> ModelConfig:
    """Config for a spec string (see the module docstring); raises ModelSpecError naming what is wrong."""
    name, _, overrides = spec.strip().partition(":")
    name = name.strip()
    if name in PRESETS:
        base = PRESETS[name]
        return _with_overrides(base, type(base), _parse_items(overrides, type(base), spec=spec), spec)
    if name in FAMILIES:
        return _with_overrides(None, FAMILIES[name], _parse_items(overrides, FAMILIES[name], spec=spec), spec)
    if name == "hf":
        raise ModelSpecError(f"{spec.strip()[:200]!r} is a Hugging Face spec, which tessera.plan, tessera.evaluate and the "
                             "command line build (tessera.planner.model_source.resolve_model); tessera.models builds its "
                             "presets and families only")
    quoted = repr(name) if name == spec.strip() else f"{name!r} (in {spec.strip()[:200]!r})"
    close = difflib.get_close_matches(name, list_presets(), n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    raise ModelSpecError(  # the other kinds of spec are built by tessera.planner.model_source
        f"unknown model {quoted}{guess}; known presets: {', '.join(list_presets())}; "
        f"or a family spec such as 'gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64' (families: {', '.join(FAMILIES)}); "
        "or a Hugging Face config built offline, hf:<model_type>[:key=value,...] (e.g. hf:qwen3_moe); "
        "or your own path/to/file.py:factory"
    )


def _with_overrides(base: ModelConfig | None, cls: type, values: dict[str, object], spec: str) -> ModelConfig:
    if base is not None:
        return dataclasses.replace(base, **values)
    missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in values]
    if missing:
        raise ModelSpecError(f"model spec {spec!r} is missing {', '.join(missing)}; give them as key=value")
    return cls(**values)


def _parse_items(text: str, cls: type, *, spec: str) -> dict[str, object]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if not sep or key not in fields:
            valid = sorted(set(fields) | {a for a, full in ALIASES.items() if full in fields})
            raise ModelSpecError(
                f"bad model override {item!r} for {cls.__name__}; expected key=value with key in {', '.join(valid)}"
            )
        if key in values:
            raise ModelSpecError(f"model spec {spec!r} gives {key} twice; keep one")
        values[key] = _parse_value(key, raw.strip(), str(fields[key].type))
    return values


def with_override(spec: str, key: str, value: object) -> str:
    """``spec`` with ``key`` set to ``value``, replacing the spec's own value for it (or its short form):
    ``with_override("llama-tiny:seq=64,layers=4", "seq", 128)`` -> ``"llama-tiny:layers=4,seq=128"``."""
    name, _, overrides = spec.strip().partition(":")
    full = ALIASES.get(key, key)
    kept = [item for item in (part.strip() for part in overrides.split(","))
            if item and ALIASES.get(item.partition("=")[0].strip(), item.partition("=")[0].strip()) != full]
    return f"{name}:{','.join([*kept, f'{key}={value}'])}"


def _parse_value(key: str, raw: str, type_name: str) -> object:
    try:
        if type_name.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if type_name.startswith("int"):
            return None if raw.lower() == "none" and "None" in type_name else int(raw)
        value = float(raw)
    except ValueError:
        raise ModelSpecError(f"model override {key}={raw[:60]!r} is not a valid {type_name}") from None
    if not math.isfinite(value):
        raise ModelSpecError(f"model override {key}={raw!r} must be a finite number")
    return value
