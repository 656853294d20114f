"""Meta-device models: materialise only this rank's shards, with the weights an unsharded init gives.

A model built on the meta device has shapes but no memory. ``apply_plan`` shards it first (tensor
parallelism, pipeline split, FSDP), then :func:`materialize_shards` allocates each rank's shards (``to_empty``) and
initialises them by running the model's own ``reset_parameters()`` under :class:`ShardedInitMode`.

**Why the result equals the unsharded init for the same seed.** ``build_model(spec)`` on CPU is
"seed, build on meta, ``to_empty``, ``reset_parameters()``": the global RNG is consumed parameter after
parameter in ``reset_parameters``' order. ``ShardedInitMode`` intercepts every random in-place fill
(``normal_``, ``uniform_``...) and every ``copy_`` aimed at a sharded (``DTensor``) or not-materialised
(meta: a layer another pipeline rank runs) parameter, and every ``torch.nn.init`` function called on one
(``nn.init.normal_`` dispatches before the tensor method does): it draws the *full* tensor with the global RNG, exactly
as the unsharded init would, keeps this rank's shard (``distribute_tensor(..., src_data_rank=None)``: local
slicing, no communication) and drops the rest. Replicated parameters are filled as usual. So every rank
consumes the RNG identically, holds at most one full parameter at a time (never the full model), and ends
up with exactly its slice of the unsharded weights. Every rank must therefore be seeded identically: we
check that all ranks' RNG states agree before initialising. Elementwise in-place ops that follow a fill
(``trunc_normal_``'s ``erfinv_``/``clamp_``...) run on the shards directly, which is exact. A model without a
root ``reset_parameters()`` is initialised by its submodules' ``reset_parameters()`` in module order.
Weights tied before ``to_empty`` (which unties them) are tied again before the init runs, and a parameter no init
writes is refused by name (it would hold whatever memory held).

The plan check: :func:`check_plan_agrees` compares a hash of the plan on every rank, because each rank of a
``torchrun`` job plans on its own and a plan that differs between ranks deadlocks or corrupts training.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from tessera.cost_models.tp_embeddings import tied_parameters
from tessera.errors import NotModelledError, RuntimeSetupError
from tessera.planner.plan import Plan

RANDOM_FILLS = {
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.geometric_,
}


def is_on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


class ShardedInitMode(TorchFunctionMode):
    """Initialise sharded and meta parameters as if they were whole (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes the tensor by keyword
        if isinstance(target, torch.Tensor) and (isinstance(target, DTensor) or target.is_meta):
            if func in RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init":
                return self._fill(target, func, args, kwargs)
            if func is torch.Tensor.copy_ and not isinstance(args[1], DTensor):
                return self._keep_shard(target, args[1])
        return func(*args, **kwargs)

    def _fill(self, target: torch.Tensor, func, args: tuple, kwargs: dict) -> torch.Tensor:
        full = torch.empty(target.shape, dtype=target.dtype, device=self.device)
        if args:
            func(full, *args[1:], **kwargs)  # consumes the RNG exactly as the unsharded init does
        else:
            func(**{**kwargs, "tensor": full})
        return self._keep_shard(target, full)

    @staticmethod
    def _keep_shard(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if isinstance(target, DTensor):
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        return target  # meta: a layer another rank runs; the draw above kept the RNG in step


def materialize_shards(
    model: nn.Module, modules: Sequence[nn.Module], *, layer_fqns: Sequence[str], device: torch.device
) -> None:
    """Allocate this rank's shards of ``model`` and initialise them as the unsharded model would be.

    ``modules`` are what the rank runs (the wrapped model, or its pipeline chunk modules): they are
    materialised with ``to_empty`` (FSDP2-aware); layers of other ranks stay on meta. Tensors of the root's
    glue code (outside every planned layer in ``layer_fqns``: RoPE tables) are materialised on every rank
    and copied into the chunk modules that read them.
    """
    check_same_seed()
    ties = tied_parameters(model)  # to_empty unties them
    for module in modules:
        module.to_empty(device=device)
    for name, module in model.named_modules():
        own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        in_layer = any(name == fqn or name.startswith(f"{fqn}.") for fqn in layer_fqns)
        if not in_layer and any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
    _retie(model, ties)
    with torch.no_grad():
        for param in _materialised(model):
            param.fill_(float("nan"))  # what no init writes stays NaN: found below, not trained from stale memory
        with ShardedInitMode(device):
            initialise(model)
        _check_initialised(model)
    _copy_glue_buffers(model, modules)


def _materialised(model: nn.Module) -> list[torch.Tensor]:
    """This rank's floating-point parameters (their local shards), those of other pipeline ranks left out."""
    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return [p for p in locals_ if not p.is_meta and p.is_floating_point()]


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Make each group of names that shared one parameter before ``to_empty`` share it again (the first materialised
    one), where this rank holds them: the model's init then writes it once, and training keeps it one weight."""
    for group in ties:
        owners = [(model.get_submodule(fqn), name) for fqn, name in group]
        kept = next((m._parameters[n] for m, n in owners if not m._parameters[n].is_meta), None)
        for module, name in owners:
            if kept is not None and not module._parameters[name].is_meta:
                module._parameters[name] = kept


def _check_initialised(model: nn.Module) -> None:
    """Refuse parameters the model's init left unwritten: a module without ``reset_parameters()`` keeps what its
    constructor set only on a real device; on meta its values would be whatever memory held."""
    unwritten = [name for name, p in model.named_parameters()
                 if not p.is_meta and p.is_floating_point()
                 and torch.isnan(p.to_local() if isinstance(p, DTensor) else p).any()]
    if unwritten:
        owner = model.get_submodule(unwritten[0].rpartition(".")[0])
        raise NotModelledError(
            f"{type(model).__name__} is on the meta device and its init leaves {len(unwritten)} parameter(s) unset "
            f"(first: {unwritten[0]}, of {type(owner).__name__}, which has no reset_parameters()); give "
            f"{type(owner).__name__} a reset_parameters() setting what its constructor sets, or build the model "
            "on a real device")


def initialise(model: nn.Module) -> None:
    """``model.reset_parameters()``; for a Hugging Face model, its own ``initialize_weights()`` (its
    ``_init_weights``: norms to ones, rotary tables recomputed), which building on meta skipped; else each
    submodule's ``reset_parameters()`` in module order."""
    if callable(getattr(model, "reset_parameters", None)):
        model.reset_parameters()
        return
    if callable(getattr(model, "initialize_weights", None)) and callable(getattr(model, "_init_weights", None)):
        model.initialize_weights()
        return
    found = [m for m in model.modules() if m is not model and callable(getattr(m, "reset_parameters", None))]
    if not found and any(True for _ in model.parameters()):
        raise NotModelledError(
            f"{type(model).__name__} is on the meta device but neither it nor its submodules define "
            "reset_parameters(); build it on a real device or add reset_parameters()"
        )
    for module in found:
        module.reset_parameters()


def _copy_glue_buffers(model: nn.Module, modules: Sequence[nn.Module]) -> None:
    """Chunk modules hold their own references to root buffers (GraphModule copies them): refresh them."""
    originals = dict(model.named_buffers())
    for module in modules:
        for name, buffer in module.named_buffers():
            source = originals.get(name)
            if source is not None and source is not buffer and not source.is_meta:
                buffer.copy_(source)


def check_same_seed() -> None:
    """Every rank must draw the same initial weights: compare the CPU RNG states."""
    if not dist.is_initialized():
        return
    digest = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        raise RuntimeSetupError(
            "ranks are seeded differently, so a model on the meta device would be initialised differently on "
            "each; call torch.manual_seed(same seed) on every rank before apply_plan/auto_parallelize"
        )


DECISIONS = {"schema_version", "model_name", "param_count", "training", "strategy", "layers"}
"""The fields of a plan that the runtime executes; the rest (estimate, alternatives, search statistics and
timings) may differ between ranks without changing what runs."""


def plan_digest(plan: Plan) -> str:
    """Hash of the plan's decisions (:data:`DECISIONS`). A factory file is named by its file name only: a plan
    records the absolute path, and nodes that planned from other folders (per-node scratch, containers) run the
    same plan."""
    decisions = plan.model_dump(mode="json", include=DECISIONS)
    file, _, factory = plan.model_name.strip().rpartition(":")
    if file.endswith(".py"):
        decisions["model_name"] = f"{os.path.basename(file)}:{factory}"
    return hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()


def check_plan_agrees(plan: Plan) -> None:
    """Raise ``RuntimeSetupError`` unless every rank applies the same plan."""
    if not dist.is_initialized():
        return
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, plan_digest(plan))
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        ranks = "; ".join(f"ranks {r} plan {d[:12]}" for d, r in groups.items())
        raise RuntimeSetupError(
            f"ranks made different plans ({ranks}); every rank must apply the same plan: plan once, save it "
            "(Plan.to_json) and load it on every rank, or make the planner's inputs identical"
        )
