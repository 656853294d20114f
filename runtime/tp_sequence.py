"""Sequence parallelism (Korthikanti et al. 2022) for ``runtime.tensor_parallel``: where the residual stream is
split over the sequence and gathered again.

The stream is sharded from the first block to the layer before the head: scattered on the sequence where it
enters the first block, gathered on the sequence before each attention's column linears (attention needs every
position) and on the tokens (dim 0) before an MLP's, and gathered again where it leaves the layer before the head,
so root code between that layer and the head sees the whole sequence (GPT-2 reshapes it there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from tessera.cost_models.tp_rules import attention_of, is_attention
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.plan import PlannedLayer

SEQUENCE_DIM = 1
"""Sequence dimension of activations ``(B, T, H)``: attention gathers and reduce-scatters the real sequence."""
TOKEN_DIM = 0
"""Token-wise layers (norms, MLPs) treat the local tokens as a shard of dim 0: exact for ``(B, T / tp, H)`` and for
the flattened ``(B * T / tp, H)`` some blocks reshape to (OPT's MLP), as each token is computed on its own."""
Styles = dict[str, ParallelStyle]


def check_sequence_parallel(seq_len: int, tp: int) -> None:
    """Sequence parallelism shards ``(B, T, H)`` activations evenly over ``T``."""
    if seq_len % tp:
        raise ConfigError(f"sequence parallelism needs seq_len={seq_len} divisible by tp={tp}; pick another seq_len or sp=false")


def sequence_entry(layers: Sequence[PlannedLayer]) -> str | None:
    """FQN of the first block (else norm or head): where the replicated residual stream is split over the
    sequence. Parameter-free ``other`` layers (a rotary-embedding module) do not carry the stream."""
    return next((layer.fqn for layer in layers if layer.kind == "block"),
                next((layer.fqn for layer in layers if layer.kind in ("norm", "head")), None))


def sequence_sharded(layers: Sequence[PlannedLayer], entry: str | None) -> set[str]:
    """Layers that see the sequence sharded: from ``entry`` to the layer before the head (on a later pipeline
    rank, all but the head). A norm before the first block (an embedding norm) sees it whole."""
    fqns = [layer.fqn for layer in layers if layer.kind not in ("loss", "head")]
    if entry is None:
        return set()
    if entry in fqns:
        return set(fqns[fqns.index(entry):])
    earlier_stage = all(layer.kind in ("embedding", "other") for layer in layers if layer.kind != "loss")
    return set() if earlier_stage else set(fqns)


def _sequence_exit(layers: Sequence[PlannedLayer]) -> str | None:
    """The layer right before the head, where the sequence is gathered again (None if the head is elsewhere).
    Parameter-free ``other`` layers (a rotary-embedding module listed late) do not carry the stream."""
    kinds = [layer for layer in layers if layer.kind not in ("loss", "other")]
    for before, layer in zip(kinds, kinds[1:]):
        if layer.kind == "head":
            return before.fqn
    return None


def check_head_follows_on_its_stage(layers: Sequence[PlannedLayer]) -> None:
    kinds = [layer for layer in layers if layer.kind not in ("loss", "other")]
    for before, layer in zip(kinds, kinds[1:]):
        if layer.kind == "head" and layer.chunk != before.chunk:
            raise NotModelledError(
                f"sequence parallelism gathers the sequence where it leaves {before.fqn}, which runs on another "
                f"pipeline chunk than the head {layer.fqn}; plan the head with the layer before it, or sp=false"
            )


def add_sequence_hooks(model: nn.Module, layers: Sequence[PlannedLayer], mesh: DeviceMesh, plans: dict[str, Styles],
                        *, entry: str | None) -> None:
    """Scatter the sequence entering ``entry`` (when this rank holds it); gather it before each module's column
    linears (the sequence for attention, the tokens for an MLP) and where it leaves the layer before the head.

    The scatter hook must run after an activation-checkpoint pre-hook on ``entry`` (apply recomputation
    first): checkpointing then records the replicated input and its recomputation re-runs the scatter,
    instead of scattering an already scattered input a second time.
    """
    if entry in plans:
        model.get_submodule(entry).register_forward_pre_hook(
            _replace_hidden(lambda x: _scatter_sequence(x, mesh)), with_kwargs=True)
    exit_ = _sequence_exit(layers)
    if exit_ is not None:
        model.get_submodule(exit_).register_forward_hook(_replace_output(lambda x: _gather_sequence(x, mesh).to_local()))
    for layer in layers:
        if layer.kind != "block":
            continue
        block = model.get_submodule(layer.fqn)
        for container, dim in _gathering_containers(block, plans[layer.fqn]).items():
            block.get_submodule(container).register_forward_pre_hook(
                _replace_hidden(lambda x, dim=dim: _gather_sequence(x, mesh, dim=dim)), with_kwargs=True)


def _gathering_containers(block: nn.Module, styles: Styles) -> dict[str, int]:
    """Module holding column linears (not the block itself) -> the dim its input is gathered on."""
    found: dict[str, int] = {}
    for name, style in styles.items():
        container = _container_of(name)
        if isinstance(style, ColwiseParallel) and container:
            attention = is_attention(block.get_submodule(container)) or attention_of(block, name) is not None
            found[container] = SEQUENCE_DIM if attention else TOKEN_DIM
    return found


def _replace_output(transform: Callable[[torch.Tensor], Any]):
    """A forward hook applying ``transform`` to the output (a tensor, or a tuple's first element)."""

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (transform(output[0]), *output[1:])
        return transform(output)

    return hook


def _replace_hidden(transform: Callable[[torch.Tensor], Any]):
    """A forward pre-hook applying ``transform`` to the hidden states (first positional or ``hidden_states``)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": transform(kwargs["hidden_states"])}
        raise NotModelledError(f"{type(module).__name__} received no positional input or hidden_states keyword to "
                               "shard over the sequence")

    return hook


def _scatter_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Replicated (B, T, H) -> this rank's (B, T / tp, H); backward all-gathers the gradient."""
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(SEQUENCE_DIM)]).to_local()  # (B, T/tp, H)


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh, *, dim: int = SEQUENCE_DIM) -> DTensor:
    """Local (B, T / tp, H) -> replicated DTensor (B, T, H) (or the tokens of every rank stacked on ``dim`` 0);
    backward reduce-scatters the (partial) gradient."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)
    return x.redistribute(mesh, [Replicate()])  # (B, T, H), kept a DTensor for the column linears


def _container_of(name: str) -> str:
    return name.rpartition(".")[0]
