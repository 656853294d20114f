"""Which parallel axes the runtime can apply to a captured model, and why not (``LayerGraph.unavailable_axes``).

Capture calls :func:`unavailable_axes` once; the search then never enumerates an unavailable axis
(``planner.space``), a pin that uses one is refused, and the plan and its report say why, one line each. The
rules follow the runtime's own refusals, read off the same module tree the runtime will split:

- **tp** (``runtime.tensor_parallel``): every linear of a block must be a class the runtime splits
  (``cost_models.types.RUNTIME_SPLITS["tp"]``: ``nn.Linear``; Hugging Face's ``Conv1D`` is not), each captured
  column/row pair must read back what its first column writes (a fused QKV projection does not), an attention
  pair's module must declare an integer ``head_dim``, and every parameter must belong to a split linear, a
  norm, an embedding table or the head; ``other`` layers must hold no parameters.
- **pp** (``runtime.pipeline``): stages are cut from a ``torch.fx`` trace of the root's forward, so a model
  that capture could only trace with ``torch.export`` or ``make_fx`` cannot be pipelined. (Weights tied across
  stages are the runtime's own check, which depends on the strategy, not only on the model.)
- **ep** (``runtime.expert_parallel``): a model with routed experts needs them in layers of a class the runtime
  splits (``RUNTIME_SPLITS["ep"]``: ``tessera.models.moe.MoELayer``). A dense model has no ep to lose.
- **BatchNorm** (``runtime.data_parallel.check_batch_norm``): exact under data parallelism only, so a model
  holding one has no tp, cp or pp. (Its limits on micro-batches and recomputation are the runtime's check.)

Combinations the runtime refuses for every model (ep with sp...) are ``cost_models.types.RUNTIME_EXCLUSIVE``,
applied by the search. Context parallelism's position rule lives in ``runtime.context_parallel``; the search
checks cp combinations only, and the runtime refuses a model whose positions it does not know.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from tessera.cost_models.types import LayerStats, LinearPair, runtime_splits
from tessera.planner.layer_info import is_norm, linear_dims

FX_FRONT_END = "torch.fx.symbolic_trace"


def unavailable_axes(
    model: nn.Module, layers: dict[str, nn.Module], stats: Sequence[LayerStats], *,
    front_end: str, fallback_reasons: Sequence[str] = (),
) -> dict[str, str]:
    """Axis name -> one line saying why the runtime cannot apply it to ``model`` (absent: available)."""
    planned = [layer for layer in stats if layer.fqn in layers]
    reasons = {
        "tp": _tensor_parallel_problem(model, layers, planned),
        "pp": _pipeline_problem(model, front_end=front_end, fallback_reasons=fallback_reasons),
        "ep": _expert_parallel_problem(model, layers, planned),
    }
    for axis, reason in _batch_norm_problems(model).items():
        reasons[axis] = reasons.get(axis) or reason
    return {axis: reason for axis, reason in reasons.items() if reason is not None}


def _batch_norm_problems(model: nn.Module) -> dict[str, str]:
    """BatchNorm normalises over the batch: the runtime keeps it exact under data parallelism only
    (``runtime.data_parallel.check_batch_norm`` refuses tp, cp and pp for such a model)."""
    name = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    if name is None:
        return {}
    layer = f"BatchNorm {name or type(model).__name__}"
    return {
        "tp": f"{layer} would normalise over each rank's shard of the channels (not implemented)",
        "cp": f"{layer} would normalise over each rank's shard of the tokens (not implemented)",
        "pp": f"{layer} would normalise over each pipeline micro-batch instead of the whole batch",
    }


# ----------------------------------------------------------------------------------------------- tensor parallelism


def _tensor_parallel_problem(model: nn.Module, layers: dict[str, nn.Module], planned: list[LayerStats]) -> str | None:
    covered = {id(p) for layer in planned for p in layers[layer.fqn].parameters()}
    stray = next((name for name, p in model.named_parameters() if id(p) not in covered), None)
    if stray is not None:
        return f"parameter {stray} belongs to no planned layer, so the runtime does not know how to split it"
    for layer in planned:
        problem = _layer_problem(layer, layers[layer.fqn])
        if problem is not None:
            return problem
    return None


def _layer_problem(layer: LayerStats, module: nn.Module) -> str | None:
    """Why the runtime's tensor parallelism would refuse this layer, or None."""
    if layer.kind == "block":
        return _unsplit_linear(layer.fqn, module) or _pair_problem(layer, module) or _uncovered(layer.fqn, module)
    if layer.kind == "embedding":
        return _uncovered(layer.fqn, module, splits=lambda m: isinstance(m, nn.Embedding))
    if layer.kind == "head":
        return _unsplit_linear(layer.fqn, module) or _uncovered(layer.fqn, module)
    if layer.kind == "other":
        name = next((n for n, _ in module.named_parameters()), None)
        if name is not None:
            return f"layer {layer.fqn} ({type(module).__name__}) holds parameter {name} but has no tensor-parallel split"
    return None


def _unsplit_linear(fqn: str, module: nn.Module) -> str | None:
    for name, sub in module.named_modules():
        if linear_dims(sub) is not None and not runtime_splits("tp", type(sub)):
            where = _join(fqn, name.rpartition(".")[0])
            return f"no column/row linear pairs the runtime can split in {where} ({type(sub).__name__})"
    return None


def _pair_problem(layer: LayerStats, block: nn.Module) -> str | None:
    """A captured pair the runtime's shape and head checks refuse (fused projections, no ``head_dim``)."""
    for pair in layer.tp_pairs:
        first, row = linear_dims(block.get_submodule(pair.column[0])), linear_dims(block.get_submodule(pair.row))
        if first is None or row is None or first[1] != row[0]:
            return (f"{layer.fqn}.{pair.column[0]} writes {first[1] if first else '?'} features but "
                    f"{layer.fqn}.{pair.row} reads {row[0] if row else '?'} (a fused projection the runtime cannot split)")
        container = _pair_container(pair)
        if pair.role == "attention" and not isinstance(getattr(block.get_submodule(container), "head_dim", None), int):
            return f"attention {_join(layer.fqn, container)} declares no integer head_dim to split heads by"
    return None


def _uncovered(fqn: str, module: nn.Module, *, splits=None) -> str | None:
    """The first parameter owned by no module the runtime splits or replicates (a norm), or None."""
    splits = splits or (lambda m: runtime_splits("tp", type(m)) or is_norm(m))
    owners = [name for name, sub in module.named_modules() if splits(sub)]
    for name, _ in module.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(o == "" or owner == o or owner.startswith(f"{o}.") for o in owners):
            kind = type(module.get_submodule(owner)).__name__
            return f"tensor parallelism has no split for parameter {_join(fqn, name)} ({kind})"
    return None


def _pair_container(pair: LinearPair) -> str:
    parents = {name.rpartition(".")[0] for name in (*pair.column, pair.row)}
    return parents.pop() if len(parents) == 1 else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# ----------------------------------------------------------------------------------------------- pipeline, experts


def _pipeline_problem(model: nn.Module, *, front_end: str, fallback_reasons: Sequence[str]) -> str | None:
    if front_end != FX_FRONT_END:
        why = next((r for r in fallback_reasons if r.startswith(FX_FRONT_END)), "")
        cause = f" ({why.split('): ', 1)[-1]})" if why else ""
        return (f"the runtime cuts pipeline stages from a torch.fx trace of the root forward, which fails on "
                f"{type(model).__name__}{cause}")
    return None


def _expert_parallel_problem(model: nn.Module, layers: dict[str, nn.Module], planned: list[LayerStats]) -> str | None:
    routed = next((layer for layer in planned if layer.experts), None)
    if routed is None or any(runtime_splits("ep", type(m)) for m in model.modules()):
        return None
    holder = next((name for name, m in layers[routed.fqn].named_modules() if name.rpartition(".")[2] == "experts"), "")
    parent = layers[routed.fqn].get_submodule(holder.rpartition(".")[0]) if holder else layers[routed.fqn]
    return (f"the experts of {_join(routed.fqn, holder.rpartition('.')[0])} ({type(parent).__name__}) are not a "
            "mixture-of-experts layer the runtime's expert parallelism splits (tessera.models.moe.MoELayer)")
