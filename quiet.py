"""Muting torchao's import-time chatter. This module imports nothing from Tessera, so every layer may use it.

torchao logs a warning for each CUDA kernel library a CPU host cannot load, and torch one for each enum torchao
registers with pytree, the first time each part of torchao is imported; transformers imports parts of torchao when
it builds a model and torchao is installed (as Tessera's ``fp8`` and ``test`` extras install it). Neither concerns a
user of Tessera, so Tessera imports torchao and builds Hugging Face models with those loggers muted (a model the
user builds before calling Tessera prints what its own imports print).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def muted(logger_names: tuple[str, ...] = TORCHAO_IMPORT_LOGGERS) -> Iterator[None]:
    """Only errors from these loggers while the block runs; their levels are restored after."""
    loggers = [logging.getLogger(name) for name in logger_names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
