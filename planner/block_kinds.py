"""Block kinds: what each block of a captured model is (``LayerStats.block_kind``), from module structure and declared
config fields, never from a model's name.

- ``encoder``: a block of a stack that runs before the language model's stack -- a vision tower in front of a
  language model (LLaVA), the encoder of an encoder-decoder (T5, Whisper). The language model's stack is the
  container holding the last block the forward runs; blocks of another container that all run before its first
  block are the encoder's. (A model that splits one language-model stack over two containers would have its first
  container's blocks reported as an encoder.)
- ``ssm`` / ``ssm-moe``: the block holds a state-space mixer, recognised by a parameter named ``A_log`` (the log of the state
  matrix, the name every Mamba / Mamba-2 implementation uses: transformers' Mamba, Mamba2, Jamba, Zamba, Bamba,
  Falcon-H1, GraniteMoeHybrid; the reference ``mamba_ssm``). A hybrid block holding both (Falcon-H1's parallel
  attention + Mamba) is ``ssm``; one with routed experts too (Jamba's) is ``ssm-moe``.
- ``moe`` / ``local-moe``: routed experts (``layer_info.expert_count``) beside global / sliding-window attention.
- ``local-attention``: attention over a sliding window shorter than the sequence. The window is what the model's
  config declares per layer (``layer_types[i]`` is ``"sliding_attention"``, of ``sliding_window`` tokens, or
  ``"chunked_attention"``, of ``attention_chunk_size``: transformers' Gemma 2/3, Qwen2/3, Cohere2, GPT-OSS, Llama 4),
  else what the block's modules declare (an integer ``sliding_window`` / ``sliding_window_size`` / ``window_size``
  attribute, ``None`` meaning global: torchtitan's GPT-OSS, Tessera's Llama), else what the config declares for
  every layer (``sliding_window``: Mistral). A window that covers the whole sequence is global attention.
- ``attention`` otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tessera.cost_models.types import BlockKind
from tessera.planner import layer_info

WINDOW_ATTRIBUTES = ("sliding_window", "sliding_window_size", "window_size")
"""Module attributes declaring an attention window in tokens (``None`` / 0: global)."""
LOCAL_LAYER_TYPES = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
"""``config.layer_types`` entries that limit attention to a window -> the config field giving its size."""
SSM_PARAMETER = "A_log"
"""Parameter name of a state-space mixer's (log) state matrix."""


def block_kinds(
    blocks: Mapping[str, nn.Module], *, order: tuple[str, ...], experts: Mapping[str, int], config: object, seq_len: int,
) -> dict[str, tuple[BlockKind, int]]:
    """The kind of each block (FQN -> module, in ``order`` of execution) and its attention window (tokens; 0 when
    global); ``experts``: routed experts per block."""
    encoders = encoder_blocks([fqn for fqn in order if fqn in blocks])
    text_config = _text_config(config)
    kinds: dict[str, tuple[BlockKind, int]] = {}
    for fqn, module in blocks.items():
        if fqn in encoders:
            kinds[fqn] = ("encoder", 0)
        elif has_ssm_mixer(module):
            kinds[fqn] = ("ssm-moe" if experts.get(fqn) else "ssm", 0)
        else:
            window = attention_window(module, text_config, _index(fqn))
            local = window is not None and window < seq_len
            kind = ("local-" if local else "") + ("moe" if experts.get(fqn) else "attention")
            kinds[fqn] = (kind, window if local else 0)  # type: ignore[assignment]
    return kinds


def encoder_blocks(blocks: list[str]) -> set[str]:
    """Blocks (FQNs in execution order) of containers that all run before the language model's stack."""
    if not blocks:
        return set()
    stack = _container(blocks[-1])
    first = next(i for i, fqn in enumerate(blocks) if _container(fqn) == stack)
    before = {_container(fqn) for fqn in blocks[:first]}
    later = {_container(fqn) for fqn in blocks[first:]}
    return {fqn for fqn in blocks if _container(fqn) in before - later}


def has_ssm_mixer(module: nn.Module) -> bool:
    """Whether the block holds a state-space mixer (a parameter named ``A_log``)."""
    return any(name.rpartition(".")[2] == SSM_PARAMETER for name, _ in module.named_parameters())


def attention_window(module: nn.Module, config: object, index: int | None) -> int | None:
    """Tokens the block's attention sees (a sliding window or chunk), or None for global attention."""
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and index is not None and index < len(layer_types):
        field = LOCAL_LAYER_TYPES.get(layer_types[index])
        return _positive(getattr(config, field, None)) if field else None
    declared = [value for m in module.modules() for name in WINDOW_ATTRIBUTES
                if (value := _declared(m, name)) is not _ABSENT]
    if declared:
        return next((window for value in declared if (window := _positive(value))), None)
    return _positive(getattr(config, "sliding_window", None))


_ABSENT = object()


def _declared(module: nn.Module, name: str) -> object:
    """The attribute ``name`` of ``module`` (``_ABSENT`` when it has none; ``None`` is a declared global window)."""
    if name in module.__dict__ or hasattr(type(module), name):
        return getattr(module, name)
    found = layer_info.attribute(module, name)
    return _ABSENT if found is None else found


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _text_config(config: object) -> object:
    """The config that declares the language model's layers (a composite model's ``text_config``)."""
    if config is None or hasattr(config, "layer_types") or hasattr(config, "sliding_window"):
        return config
    return getattr(config, "text_config", None) or config


def _container(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _index(fqn: str) -> int | None:
    last = fqn.rpartition(".")[2]
    return int(last) if last.isdigit() else None
