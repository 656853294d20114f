"""Activation recomputation: full, non-reentrant checkpointing of whole blocks.

We use PyTorch's composable ``checkpoint`` (``torch.distributed._composable.checkpoint``): it installs the
non-reentrant ``torch.utils.checkpoint`` machinery as forward pre/post hooks on the module instead of
wrapping it. So, unlike ``checkpoint_wrapper`` (which inserts ``_checkpoint_wrapped_module.`` into every
parameter FQN below the block), **module and parameter FQNs are unchanged**: ``blocks.0.attn.weight``
stays ``blocks.0.attn.weight``, the plan's FQNs still resolve after recomputation is applied, and FSDP2
``fully_shard`` and DDP compose with it. Apply it before sharding or wrapping.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def apply_recompute(model: nn.Module, block_fqns: tuple[str, ...]) -> nn.Module:
    """Recompute the forward of each module in ``block_fqns`` during backward (in place; FQNs unchanged).

    Only the blocks' inputs are kept for backward; everything saved inside a block is dropped after its
    forward and rebuilt (with the same RNG state, so dropout matches) when its backward runs.
    """
    for fqn in block_fqns:
        checkpoint(model.get_submodule(fqn))
    return model
