"""Model sources: a spec string -> an ``nn.Module`` on the meta device (no weights), and the name to record.

``resolve_model`` accepts:

- a built-in preset or family, with overrides: ``llama3-70b``, ``gpt3-175b:layers=4``, ``mixtral-8x7b``,
  ``moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=64,experts=8,top_k=2``
  (``tessera.models``);
- ``hf:<model_type>[:key=value,...]``: a Hugging Face ``transformers`` config built offline (no download) from
  the library's defaults for that ``model_type`` plus the overrides, randomly initialised on meta:
  ``hf:llama:num_hidden_layers=2,hidden_size=64``, ``hf:gpt2``, ``hf:mixtral``, ``hf:bert``. The model is the
  masked-LM class when the type has one (encoders), else the causal-LM class, else the bare model. ``use_cache=False``
  (a cache output does not export) and ``attn_implementation="sdpa"`` (so attention is a recognised core) are
  set, or ``"eager"`` where the class does not support SDPA (Gemma-2), as transformers itself falls back; an
  ``attn_implementation=flash_attention_2`` (or ``flex_attention``, ...) override names the kernel training
  will run, which prices sliding windows (``layer_info.windowed_kernel``) while capture still measures SDPA. Needs the optional extra: ``pip install 'tessera[hf]'``;
- ``path/to/file.py:factory`` or ``package.module:factory``: a user function returning an ``nn.Module``, or
  ``(module, example_inputs)`` for a model whose input is not ``(1, seq_len)`` token ids (an image batch, several
  tensors): ``example_inputs`` is what ``capture`` accepts (a tensor, a tuple of positional inputs, a dict of
  keyword inputs, or a function of ``seq_len`` returning one). It is called under ``torch.device("meta")``, so
  the parameters and inputs it creates are meta tensors (their initialisers are skipped: ``models.meta_init``).
  A plan records the file by its absolute path (:func:`absolute_spec`); an older plan's relative one is read from
  the current folder.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.errors import ModelSpecError
from tessera.models import build_model, is_builtin_spec
from tessera.models.limits import check_dimension
from tessera.models.meta_init import skipping_init_on_meta
from tessera.planner.layer_info import WINDOWED_KERNELS
from tessera.quiet import muted
from tessera.topology.validation import short

_FACTORY = re.compile(r"^(?P<module>[^:\n]+?\.py|[\w./\\-]+?):(?P<factory>[A-Za-z_]\w*)$")
"""``file.py:factory`` (any folder name, spaces included: :func:`absolute_spec` prefixes the current one) or
``package.module:factory``."""
HF_INSTALL_HINT = "pip install 'tessera[hf]'"
log = logging.getLogger(__name__)


def resolve_model(spec: str) -> tuple[nn.Module, str]:
    """The module a spec names, built on meta, and the name to record (the spec itself)."""
    model, name, _ = resolve_model_and_inputs(spec)
    return model, name


def resolve_model_and_inputs(spec: str) -> tuple[nn.Module, str, Any]:
    """:func:`resolve_model` plus the example inputs a factory returned with its model (else ``None``)."""
    spec = spec.strip()
    if spec.startswith("hf:"):
        return hf_model(spec), spec, None
    match = _FACTORY.match(spec)
    if match and not is_builtin_spec(spec):
        model, inputs = factory_model_and_inputs(match["module"], match["factory"])
        return model, spec, inputs
    return build_model(spec, device="meta"), spec, None  # raises ModelSpecError listing the presets when unknown


def names_a_model(spec: str) -> bool:
    """Whether ``spec`` has the form of a model spec (a preset or family, ``hf:...``, a factory); a model object's
    class name, which a plan records for it, has none of these."""
    spec = spec.strip()
    return spec.startswith("hf:") or bool(_FACTORY.match(spec)) or is_builtin_spec(spec)


def runs_user_code(spec: str) -> bool:
    """Whether building ``spec`` imports and calls user code (a ``file.py:factory`` or ``module:factory``)."""
    spec = spec.strip()
    return not spec.startswith("hf:") and bool(_FACTORY.match(spec)) and not is_builtin_spec(spec)


def factory_file(spec: str) -> Path | None:
    """The Python file a ``file.py:factory`` spec names, as written; None for any other spec."""
    spec = spec.strip()
    match = _FACTORY.match(spec)
    if match is None or spec.startswith("hf:") or is_builtin_spec(spec) or not match["module"].endswith(".py"):
        return None
    return Path(match["module"])


def absolute_spec(spec: str) -> str:
    """``spec`` with its factory file's path made absolute from the current folder (other specs as given): a plan
    records the spec, and the model is rebuilt from it (resume, a launched train.py) in other folders."""
    spec = spec.strip()
    path = factory_file(spec)
    if path is None or os.path.isabs(os.path.expanduser(path)):
        return spec
    return f"{looked_for(path)}:{spec.rpartition(':')[2]}"


def looked_for(path: Path | str) -> str:
    """Where a factory file's path is read: from the current folder when relative (no filesystem access; a ``~`` of
    an unknown user stays as written, so it never raises)."""
    return os.path.abspath(os.path.expanduser(path))


def missing_file_reason(name: str, factory: str = "factory") -> str:
    """One line for a factory file ``name`` that does not exist: the path looked for and what to do."""
    factory = short(factory)
    if os.path.isabs(os.path.expanduser(name)):
        return f"model file {short(name)} does not exist; give a path to a .py file and a factory"
    return (f"model file {short(name)} does not exist here: looked for {short(looked_for(name))} (a relative "
            "path is read from the current folder); run from the folder it is relative to, or give its absolute "
            f"path: /path/to/{short(Path(name).name)}:{factory}")


def max_positions(model: nn.Module) -> int | None:
    """Longest sequence the model's position tables cover (built-in ``seq_len``, HF ``max_position_embeddings``)."""
    config = getattr(model, "config", None)
    for name in ("seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# ----------------------------------------------------------------------------------------------- factories


def factory_model(module_name: str, factory_name: str) -> nn.Module:
    """Call ``factory_name`` from a Python file or importable module, on meta; ModelSpecError if that fails."""
    return factory_model_and_inputs(module_name, factory_name)[0]


def factory_model_and_inputs(module_name: str, factory_name: str) -> tuple[nn.Module, Any]:
    """The factory's model and the example inputs it returned with it (``None`` when it returned a module)."""
    module = _load_module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ModelSpecError(f"{module_name} has no function {factory_name!r}; it defines "
                             f"{', '.join(names[:12]) or 'no public functions'}")
    try:
        with torch.device("meta"), skipping_init_on_meta():
            returned = factory()
    except (Exception, SystemExit) as exc:  # the user's code: its failure is named, not a traceback of ours
        raise ModelSpecError(f"model factory {module_name}:{factory_name}() raised {type(exc).__name__}: "
                             f"{_first_line(exc)}; fix the factory (call it yourself to see the traceback)") from exc
    return _model_and_inputs(returned, f"{module_name}:{factory_name}()")


def _model_and_inputs(returned: object, called: str) -> tuple[nn.Module, Any]:
    if isinstance(returned, nn.Module):
        return returned, None
    if isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], nn.Module):
        model, inputs = returned
        if callable(inputs) or isinstance(inputs, (torch.Tensor, tuple, list, dict)):
            return model, inputs
        raise ModelSpecError(f"{called} returned example inputs of type {type(inputs).__name__}; return a tensor, "
                             "a tuple of positional inputs, a dict of keyword inputs or a function of seq_len")
    raise ModelSpecError(f"{called} returned {type(returned).__name__}, not an nn.Module or (nn.Module, example_inputs)")


def _load_module(name: str) -> object:
    try:
        if name.endswith(".py"):
            path = Path(name).expanduser().resolve()
            if not path.is_file():
                raise ModelSpecError(missing_file_reason(name))
            spec = importlib.util.spec_from_file_location(f"tessera_user_model_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except ModelSpecError:
        raise
    except (Exception, SystemExit) as exc:
        raise ModelSpecError(f"cannot import model source {name}: {type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 200 characters (it may come from anyone's code)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


# ----------------------------------------------------------------------------------------------- Hugging Face


def hf_model(spec: str) -> nn.Module:
    """A Hugging Face model from ``hf:<model_type>[:key=value,...]``, randomly initialised on meta."""
    _, _, rest = spec.partition(":")
    model_type, _, overrides = rest.partition(":")
    values = _parse_overrides(overrides)
    declared = values.pop("attn_implementation", None)
    if declared is not None:
        _training_attention(spec, declared)
    if not model_type.strip():
        raise ModelSpecError(f"{spec!r} names no model_type; write hf:<model_type>[:key=value,...], e.g. hf:llama")
    if "/" in model_type:  # a hub repository id: Tessera fetches nothing
        raise ModelSpecError(f"{spec!r} looks like a Hugging Face hub id; Tessera downloads nothing: write the config "
                             "as hf:<model_type>:key=value,... (e.g. hf:llama:hidden_size=4096,num_hidden_layers=32), "
                             "or pass a factory file.py:make_model that builds it from a local config")
    _check_hf_sizes(spec, values)  # before importing transformers, which takes seconds
    transformers = _transformers()
    try:
        defaults = transformers.AutoConfig.for_model(model_type.strip())
    except (ValueError, KeyError):
        known = list(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
        close = difflib.get_close_matches(model_type.strip(), known, n=3)
        hint = f"did you mean {' or '.join(repr(name) for name in close)}?" if close else \
            "transformers' CONFIG_MAPPING lists the model types"
        raise ModelSpecError(f"unknown Hugging Face model_type {model_type!r} in {spec!r}; {hint}") from None
    unknown = _unknown_keys(transformers, model_type.strip(), values, defaults)
    if unknown:
        raise ModelSpecError(f"{spec!r}: {model_type} configs have no {', '.join(unknown)}; "
                             f"{_where_keys_live(defaults, unknown)}")
    model = _built_hf_model(spec, transformers, model_type.strip(), values, declared)
    _check_optional_keys_read(spec, model_type.strip(), model, values, defaults)
    return model


def _built_hf_model(spec: str, transformers: object, model_type: str, values: dict, declared: str | None) -> nn.Module:
    """The model on meta, built with the attention kernel capture measures (``_attention_kernels``); its config names
    the kernel training runs."""
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
        config.use_cache = False
        auto_class = _hf_class(transformers, config)
        built, kernel = _attention_kernels(spec, _concrete_class(auto_class, config), declared)
        config._attn_implementation = built
        with torch.device("meta"), skipping_init_on_meta(), muted():  # transformers imports torchao's parts here
            model = auto_class.from_config(config, attn_implementation=built)
    except ModelSpecError:
        raise
    except Exception as exc:  # transformers' own checks of the user's values: named, not a traceback of ours
        raise ModelSpecError(f"{spec!r}: transformers cannot build this config: {type(exc).__name__}: "
                             f"{_first_line(exc)}; fix the overrides") from exc
    model.config.use_cache = False
    model.config._attn_implementation = kernel  # a windowed kernel is measured as SDPA (layer_info.measured_with_sdpa)
    return model


def _unknown_keys(transformers: object, model_type: str, values: dict, defaults: object) -> list[str]:
    """Keys that are neither attributes of the default config nor legacy keys its constructor converts, as it does
    reading a ``config.json``: transformers 5 moves ``rope_theta`` and ``partial_rotary_factor`` into
    ``rope_parameters`` (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``) and drops saved generation
    parameters (said in a warning: they set nothing), while a key it does not know stays on the config as an extra
    attribute. Each key is tried on its own, so one value transformers refuses (named by the build) hides no other."""
    unknown, dropped = [], []
    for key, value in values.items():
        if hasattr(defaults, key) or key in OPTIONAL_HF_KEYS:
            continue
        try:
            with muted():
                probe = transformers.AutoConfig.for_model(model_type, **{key: value})
        except Exception:  # noqa: BLE001 (a value transformers refuses: the build names it)
            continue
        if hasattr(probe, key):
            unknown.append(key)
        elif probe.to_dict() == defaults.to_dict():
            dropped.append(key)
    if dropped:
        log.warning("%s configs drop %s as transformers does reading a config.json: they set nothing here",
                    model_type, ", ".join(sorted(dropped)))
    return sorted(unknown)


def _where_keys_live(defaults: object, unknown: list[str]) -> str:
    """What to write instead: a composite config (Gemma 3, Llava) keeps the language model's fields in a nested
    config whose own model type an ``hf:`` spec can name; else the config's attributes."""
    nested = [(name, value) for name, value in vars(defaults).items()
              if name.endswith("_config") and getattr(value, "model_type", None)]
    text = next((value.model_type for name, value in nested if name == "text_config"), None)
    if text is not None:
        return (f"its language model's fields are in text_config (model type {text!r}): name that model type, "
                f"e.g. 'hf:{text}:num_hidden_layers=4'")
    keys = sorted(k for k in defaults.to_dict() if not k.startswith("_") and not k.endswith("_config"))
    close = [match for key in unknown for match in difflib.get_close_matches(key, keys, n=1)]
    if close:
        return f"did you mean {' or '.join(close)}? (keys are the config's attributes)"
    return f"keys are the config's attributes, e.g. {', '.join(keys[:10])}"


def _check_optional_keys_read(spec: str, model_type: str, model: nn.Module, values: dict, defaults: object) -> None:
    """Refuse an ``OPTIONAL_HF_KEYS`` value the built model does not use (a config without the key whose modules take
    no such attribute), as an unknown key is refused."""
    for key in OPTIONAL_HF_KEYS:
        if key in values and not hasattr(defaults, key) and not any(
                getattr(module, key, None) == values[key] for module in model.modules()):
            raise ModelSpecError(f"{spec!r}: {model_type} configs have no {key}, and its model does not read one; "
                                 "drop it")


ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
"""``attn_implementation`` values an ``hf:`` spec accepts: the attention kernel training will run."""


def _training_attention(spec: str, value: object) -> str:
    """The attention kernel an ``hf:`` spec declares for training (capture measures what ``_attention_kernels`` built)."""
    if value not in ATTENTION_IMPLEMENTATIONS:
        raise ModelSpecError(f"{spec!r}: attn_implementation={value!r} is not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    return value  # type: ignore[return-value]


_SUPPORT_FLAGS = {"sdpa": ("_supports_sdpa",), "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2"),
                  "flash_attention_3": ("_supports_flash_attn", "_supports_flash_attn_3"),
                  "flex_attention": ("_supports_flex_attn",)}
"""The ``PreTrainedModel`` class flags saying whether a model class runs each kernel (eager always runs); any one
will do: transformers before 4.54 names the flash kernels' flags by version (``_supports_flash_attn_2``)."""


def _supported_attention(model_class: type) -> tuple[str, ...]:
    """The ``ATTENTION_IMPLEMENTATIONS`` a transformers model class declares it supports."""
    return tuple(k for k in ATTENTION_IMPLEMENTATIONS
                 if k == "eager" or any(getattr(model_class, flag, False) for flag in _SUPPORT_FLAGS[k]))


def _attention_kernels(spec: str, model_class: type, declared: str | None) -> tuple[str, str]:
    """(the kernel to build the model with, the kernel training runs). Built with SDPA, the fused core capture
    recognises, where the class supports it, else eager, as transformers itself falls back when none is asked for
    (Gemma-2: ``_supports_sdpa = False``, SDPA has no logit softcapping); training runs the declared kernel, else
    the built one. A declared kernel the class does not support is refused, as transformers would at training."""
    supported = _supported_attention(model_class)
    built = "sdpa" if "sdpa" in supported else "eager"
    if declared is not None and declared not in supported:
        raise ModelSpecError(f"{spec!r}: {model_class.__name__} does not support attn_implementation={declared!r} "
                             f"(transformers' {_SUPPORT_FLAGS[declared][0]} is False); declare one of {', '.join(supported)}")
    if declared is None and built == "eager":  # eager keeps every layer's s x s scores for backward: it costs memory
        windowed = [k for k in supported if k in WINDOWED_KERNELS]
        log.warning("%s has no SDPA attention in transformers: planned with eager attention, which saves each layer's "
                    "attention scores (seq_len^2 per head)%s", model_class.__name__,
                    f"; add attn_implementation={windowed[0]} to the spec if training runs it" if windowed else "")
    return built, declared or built


def _concrete_class(auto_class: object, config: object) -> type:
    """The model class an ``AutoModel...`` class builds for ``config`` (its class flags say what it supports)."""
    with muted():  # importing the modeling module imports torchao's parts, which print
        return auto_class._model_mapping[type(config)]


OPTIONAL_HF_KEYS = ("head_dim",)
"""Config keys a model reads only where a checkpoint's ``config.json`` sets them, so a default config lacks them:
``head_dim`` (``getattr(config, "head_dim", hidden_size // num_attention_heads)`` in transformers' Llama, Qwen3,
Qwen3-MoE and Mistral attention), which Qwen3's released configs set to 128 whatever the width."""


HF_SIZES = {
    "num_hidden_layers": "layers", "n_layer": "layers", "hidden_size": "hidden", "n_embd": "hidden",
    "num_attention_heads": "heads", "n_head": "heads", "num_key_value_heads": "kv_heads",
    "intermediate_size": "ffn_hidden", "vocab_size": "vocab", "max_position_embeddings": "seq_len",
    "n_positions": "seq_len", "num_local_experts": "experts", "n_routed_experts": "experts",
}
"""Hugging Face config sizes checked against the built-in models' bounds (``tessera.models.limits``)."""


def _check_hf_sizes(spec: str, values: dict[str, object]) -> None:
    """Refuse an override of a size that is not a whole number in bounds, before transformers builds anything."""
    for key, value in values.items():
        if key in HF_SIZES:
            check_dimension(HF_SIZES[key], value, family="Hugging Face", label=f"{spec!r}: {key}")


def _transformers() -> object:
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            f"hf: model specs need Hugging Face transformers, which is not installed: {HF_INSTALL_HINT}"
        ) from None
    return transformers


def _hf_class(transformers: object, config: object) -> object:
    """The LM class for the config's type: masked LM (encoders such as BERT also list a causal-LM head, which
    warns without ``is_decoder``; BART's is its conditional generation model), else sequence-to-sequence LM (T5),
    else causal LM, else the bare model."""
    mapping = transformers.models.auto.modeling_auto
    if config.model_type in mapping.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return transformers.AutoModelForMaskedLM
    if config.model_type in mapping.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForSeq2SeqLM
    if config.model_type in mapping.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _parse_overrides(text: str) -> dict[str, object]:
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ModelSpecError(f"bad Hugging Face override {item!r}; expected key=value")
        values[key.strip()] = _parse_value(raw.strip())
    return values


def _parse_value(raw: str) -> object:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
