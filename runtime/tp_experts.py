"""Tensor parallelism of mixture-of-experts blocks whose experts are stacked in 3-D parameters (Hugging Face
Mixtral, Qwen2-MoE, Qwen3-MoE; ``cost_models.tp_rules.moe_containers``): the module holding the experts (the
block's ``mlp``) is split as a unit, beside the block's own column/row pairs (``runtime.tensor_parallel``).

- **experts**: replaced by ``runtime.hf_experts.ShardedExperts`` over tp (each expert's gate/up column-wise, down
  row-wise, one all-reduce of the combined output), unless expert parallelism already split them over ``(ep, tp)``;
- **a shared expert** (Qwen2-MoE): a column/row pair like a dense MLP, its output all-reduced, so the block's
  sigmoid gate multiplies the whole value (a partial sum there would make the gate's gradient partial);
- **routers and gates**: whole on every rank, plain tensors: their inputs and output gradients are whole there,
  so their gradients are the single-process ones;
- **sequence parallelism**: the container's input (this rank's tokens) is all-gathered on the tokens (dim 0)
  where it enters, and its output, whole on every rank, is cut back to this rank's tokens (no communication; the
  backward all-gathers the gradient). Its reductions are therefore all-reduces of all the tokens; a reduce-scatter
  would move half the bytes, but the block reshapes the combined output to the gathered input's shape first.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from tessera.runtime.hf_experts import ShardedExperts
from tessera.runtime.tp_sequence import TOKEN_DIM, _gather_sequence, _replace_hidden, _replace_output


def split_moe_container(container: nn.Module, mesh: DeviceMesh, styles: dict[str, ParallelStyle], *, sp: bool) -> None:
    """Split one MoE container (in place) over the 1-D tensor-parallel ``mesh``: ``styles`` for its shared experts
    (relative to it), its experts over tp, and with ``sp`` the token gather and cut around it."""
    if styles:
        parallelize_module(container, mesh, styles)
    if not isinstance(container.experts, ShardedExperts):
        container.experts = ShardedExperts(container.experts, mesh)
    if sp:
        container.register_forward_pre_hook(
            _replace_hidden(lambda x: _gather_sequence(x, mesh, dim=TOKEN_DIM).to_local()), with_kwargs=True)
        container.register_forward_hook(_replace_output(lambda y: _local_tokens(y, mesh)))


def _local_tokens(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Whole ``(tp * B, T / tp, H)`` output -> this rank's ``(B, T / tp, H)``; backward all-gathers the gradient."""
    whole = DTensor.from_local(y, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(TOKEN_DIM)]).to_local()
