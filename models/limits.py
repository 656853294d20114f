"""Bounds on model shapes: a spec past them fails at once with ``ModelSpecError`` instead of building millions of
modules (``gpt-tiny:layers=100000000`` would take hours on meta and never plan).

Each bound is far above any published model, so it refuses typos and hostile input, never a real run:

=============  ===========  ==============================================================================
field          at most      largest published (for scale)
=============  ===========  ==============================================================================
layers         1,024        128 (Megatron-LM 1T, Narayanan et al. 2021, Table 1); planning time grows with
                            the layer count, about a minute at 1,024 on one shared CPU core
hidden         131,072      25,600 (Megatron-LM 1T)
heads          4,096        160 (Megatron-LM 1T)
kv_heads       4,096        as heads
ffn_hidden     1,048,576    4 x 25,600
vocab          4,194,304    262,144 (Gemma 3)
seq_len        16,777,216   10M tokens (the longest contexts reported)
experts        1,024        256 routed (DeepSeek-V3)
top_k          1,024        8 (DeepSeek-V3); also at most ``experts``
shared_ffn     1,048,576    as ffn_hidden
head_dim       16,384       256 (Gemma 2); a declared head dim (``attention_head_dim``)
=============  ===========  ==============================================================================

A mixture-of-experts model also has at most ``MAX_EXPERT_MODULES`` experts in all (layers x experts): each is
its own module. Float fields must be finite (``rope_theta`` positive).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tessera.errors import ModelSpecError

MAX_DIMS: dict[str, int] = {
    "layers": 1024,
    "hidden": 2**17,
    "heads": 4096,
    "kv_heads": 4096,
    "ffn_hidden": 2**20,
    "vocab": 2**22,
    "seq_len": 2**24,
    "experts": 1024,
    "top_k": 1024,
    "shared_ffn": 2**20,
    "dense_layers": 1024,
    "dense_ffn": 2**20,
    "attention_head_dim": 2**14,
}
"""Largest value each shape field may take (see the module docstring for the published sizes behind them)."""
MAX_EXPERT_MODULES = 2**16
"""layers x experts at most 65,536 (DeepSeek-V3: 61 x 256 = 15,616)."""
MAX_CAPACITY_FACTOR = 1024.0
"""Largest expert capacity factor: above experts / top_k every expert is already planned for every token."""


def check_dimension(name: str, value: object, *, family: str, minimum: int = 1, label: str | None = None) -> None:
    """Raise ``ModelSpecError`` unless ``value`` is a whole number in ``[minimum, MAX_DIMS[name]]``; the message
    calls it ``label`` (default ``"<family> <name>"``)."""
    label = label or f"{family} {name}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelSpecError(f"{label} must be a whole number, got {value!r}")
    if value < minimum:
        raise ModelSpecError(f"{label} must be {'positive' if minimum == 1 else f'at least {minimum}'}, got {value}")
    limit = MAX_DIMS.get(name)
    if limit is not None and value > limit:
        raise ModelSpecError(f"{label}={value:,} is past Tessera's bound of {limit:,} (tessera.models.limits; far "
                             "above any published model): is it a typo?")


def check_dimensions(config: object, names: Iterable[str], *, family: str) -> None:
    """``check_dimension`` for each of ``names`` on ``config``, in order."""
    for name in names:
        check_dimension(name, getattr(config, name), family=family)


def check_finite(name: str, value: object, *, family: str, positive: bool = False) -> None:
    """Raise ``ModelSpecError`` unless ``value`` is a finite number (and, with ``positive``, more than 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelSpecError(f"{family} {name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ModelSpecError(f"{family} {name} must be positive, got {value}")
