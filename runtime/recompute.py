"""Activation recomputation per layer: ``full`` (keep only the block's inputs) or ``selective``.

We use PyTorch's composable ``checkpoint`` (``torch.distributed._composable.checkpoint``): it installs the
non-reentrant ``torch.utils.checkpoint`` machinery as forward pre/post hooks on the module instead of
wrapping it. So, unlike ``checkpoint_wrapper`` (which inserts ``_checkpoint_wrapped_module.`` into every
parameter FQN below the block), **module and parameter FQNs are unchanged**: ``blocks.0.attn.weight``
stays ``blocks.0.attn.weight``, the plan's FQNs still resolve after recomputation is applied, and FSDP2
``fully_shard``, DDP, tensor parallelism and pipeline stages compose with it. Apply it before sharding or
wrapping with a data-parallel wrapper (after tensor parallelism).

``selective`` is Megatron-LM's selective recomputation (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 5): keep the outputs of the linear projections (the
expensive matmuls, ``aten.mm``/``aten.addmm``) and of tensor-parallel collectives (recomputing those would
repeat communication), and recompute everything else in the block in backward -- the attention core
(scaled-dot-product attention, softmax, dropout), activations and norms -- which is cheap in FLOPs but
large in bytes. It uses ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with that policy.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

SAVED_OPS: frozenset = frozenset(
    op
    for op in (
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        getattr(torch.ops._c10d_functional, "all_reduce", None),
        getattr(torch.ops._c10d_functional, "reduce_scatter_tensor", None),
        getattr(torch.ops._c10d_functional, "all_gather_into_tensor", None),
    )
    if op is not None
)
"""Ops whose outputs selective recomputation keeps (overload packets or overloads)."""


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and collective outputs; recompute every other op (attention core, activations, norms)."""
    packet = getattr(op, "overloadpacket", op)
    if op in SAVED_OPS or packet in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The (forward, recompute) context pair for ``checkpoint(..., context_fn=...)``."""
    _ignore_profiler_annotations()
    return create_selective_checkpoint_contexts(selective_policy)


@functools.cache
def _ignore_profiler_annotations() -> None:
    """Keep ``record_function``'s ops out of selective checkpointing's replay. FSDP2 in torch 2.13 runs its hooks
    under ``record_function``, whose dispatched ops can come a different number of times in the recomputation than
    in the forward: SAC, which replays ops by count, then stops the backward ("profiler._record_function_enter_new
    ... encountered during backward but not found in storage"; met with ZeRO-1 and a profiler on, and reported
    with torchtitan, pytorch/torchtitan#3427). Annotations compute nothing, so replaying them is never needed.
    It adds them to torch's own ``SAC_IGNORED_OPS``: once per process, for every selective checkpoint in it."""
    profiler = torch.ops.profiler
    for packet in (profiler._record_function_enter, profiler._record_function_enter_new, profiler._record_function_exit):
        SAC_IGNORED_OPS.update(getattr(packet, name) for name in packet.overloads())


def apply_recompute(model: nn.Module, block_fqns: tuple[str, ...], *, selective_fqns: tuple[str, ...] = ()) -> nn.Module:
    """Recompute the forward of the modules in ``block_fqns`` (full) and ``selective_fqns`` (selective) in
    backward (in place; FQNs unchanged).

    Full: only the block's inputs are kept; everything inside is rebuilt (with the same RNG state, so
    dropout matches) when its backward runs. Selective: see the module docstring.
    """
    for fqn in block_fqns:
        checkpoint(model.get_submodule(fqn))
    for fqn in selective_fqns:
        checkpoint(model.get_submodule(fqn), context_fn=functools.partial(selective_context))
    return model
