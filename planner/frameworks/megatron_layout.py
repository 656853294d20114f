"""Megatron-LM's pipeline layouts: ``--pipeline-model-parallel-layout`` strings written and read (``E`` embedding, ``t``
a block, ``m`` a multi-token-prediction layer, ``L`` the loss, ``|`` between chunks), and its even split of the blocks
over the chunks, the embedding and the loss counted where asked."""

from __future__ import annotations

import re

from tessera.errors import ConfigError, NotModelledError
from tessera.topology.validation import quoted


MAX_LAYOUT_CHARS = 1 << 16
"""Longest ``--pipeline-model-parallel-layout`` read, before and after its repetitions are expanded."""


def layout_string(chunks: list[int]) -> str:
    """``--pipeline-model-parallel-layout`` of chunks holding ``chunks`` blocks: ``Et*3|t*4|t*3L``."""
    parts = [f"t*{count}" if count > 1 else "t" * count for count in chunks]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def even_split(layers: int, chunks: int, *, embedding: bool = False, loss: bool = False) -> list[int] | None:
    """Blocks per pipeline chunk as Megatron-Core splits ``layers`` evenly over ``chunks``, the embedding and the loss
    each counted as a layer where asked (``account_for_embedding_in_pipeline_split``, ``..._loss_...``): the first
    chunk holds the embedding in a block's place, the last the loss. None where that split is not even or leaves a
    chunk without a block."""
    split = layers + embedding + loss
    if split % chunks or split // chunks <= max(embedding, loss):
        return None
    sizes = [split // chunks] * chunks
    sizes[0] -= embedding
    sizes[-1] -= loss
    return sizes


def parse_layout(layout: str, *, pp: int) -> list[int]:
    """Blocks per chunk of a ``--pipeline-model-parallel-layout`` (Megatron-LM's grammar: ``(...)*n`` and ``x*n``
    repeat, ``,`` is cosmetic, ``|`` separates chunks; ``E`` must open it and ``L`` close it; ``m``, a
    multi-token-prediction layer, only in the last chunk)."""
    text = _expanded(layout)
    chunks = text.split("|")
    bad = set(text) - set("EtmL|")
    if bad or not text.startswith("E") or not text.endswith("L") or text.count("E") != 1 or text.count("L") != 1:
        what = f"has {sorted(bad)} (Tessera reads E, t, m, L)" if bad else "must start with E and end with L, once each"
        raise ConfigError(f"--pipeline-model-parallel-layout {quoted(layout)} {what}")
    if len(chunks) % pp:
        raise ConfigError(f"--pipeline-model-parallel-layout {quoted(layout)} has {len(chunks)} chunks, not a multiple of "
                          f"--pipeline-model-parallel-size {pp}")
    if "m" in text.rpartition("|")[0]:
        raise NotModelledError(f"--pipeline-model-parallel-layout {quoted(layout)} places multi-token-prediction layers "
                               "(m) before the last chunk; Tessera prices them in the last one, after its blocks")
    return [chunk.count("t") for chunk in chunks]


def layout_mtp_layers(layout: str) -> int:
    """The multi-token-prediction layers (``m``) a ``--pipeline-model-parallel-layout`` places."""
    return _expanded(layout).count("m")


def _expanded(layout: str) -> str:
    """A ``--pipeline-model-parallel-layout`` with its repetitions written out and its commas dropped."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^()]+)\)\*(\d{1,6})", r"(.)\*(\d{1,6})"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
        if len(text) > MAX_LAYOUT_CHARS:
            raise ConfigError(f"--pipeline-model-parallel-layout {quoted(layout)} expands past {MAX_LAYOUT_CHARS:,} "
                              "characters; check the repetitions")
    return text
