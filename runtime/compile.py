"""``torch.compile`` per block (opt-in: ``apply_plan(..., compile_blocks=True)``).

Each block's ``forward`` is replaced by its compiled version (``block.forward = torch.compile(block.forward)``)
rather than wrapping the module (``torch.compile(module)`` returns an ``OptimizedModule`` that inserts
``_orig_mod.`` into every FQN). The module's hooks -- FSDP2's all-gather/reduce-scatter, activation
checkpointing, sequence-parallel redistribution -- stay outside the compiled region and run eagerly around
it, so compilation composes with every other part of the plan, and FQNs are unchanged. Apply it after
tensor parallelism (the compiled code sees the local shards) and recomputation, before FSDP.

Off by default: on CPU, Inductor compiles a tiny model in 10-20 s and does not speed it up
(shared/PLATFORM-NOTES.md). Tested with FSDP2 (ZeRO-3) and full recomputation; selective recomputation
of a compiled block (its policy runs as a dispatch mode around compiled code) is not tested.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def compile_blocks(model: nn.Module, block_fqns: Sequence[str]) -> None:
    """Compile the ``forward`` of each module in ``block_fqns`` (in place; FQNs unchanged)."""
    for fqn in block_fqns:
        block = model.get_submodule(fqn)
        block.forward = torch.compile(block.forward)
