"""Which parallel axes the runtime can apply to a captured model, and why not (``LayerGraph.unavailable_axes``).

Capture calls :func:`unavailable_axes` once; the search then never enumerates an unavailable axis
(``planner.space``), a pin that uses one is refused, and the plan and its report say why, one line each. The
rules follow the runtime's own refusals, read off the same module tree the runtime will split:

- **tp** (``runtime.tensor_parallel``): the rule is the runtime's own, ``cost_models.tp_rules``: every block's linears
  get a style from the plan the model declares (Hugging Face ``base_model_tp_plan``) or from the module tree
  (``nn.Linear`` and Hugging Face ``Conv1D``; packed ``q|k|v``/``gate|up`` projections; torchtitan's fused
  ``wqkv``), every parameter of a block belongs to a split linear, a norm or a router, an attention whose heads are
  split does not read head counts from the shared config, an embedding layer holds only embedding tables, a head
  is an ``nn.Linear``; ``other`` layers hold no parameters. (Divisibility by the degree is the search's.)
- **pp** (``runtime.pipeline``): stages are cut from a ``torch.fx`` trace of the root's forward, or, where fx
  fails (Hugging Face, torchtitan), from a ``torch.export`` trace with the planned layers kept as calls; a model
  that capture could only trace with ``make_fx`` cannot be pipelined. (Weights tied across stages are the
  runtime's own check, which depends on the strategy, not only on the model.)
- **ep** (``runtime.expert_parallel``): a model with routed experts needs them in layers of a class the runtime
  splits (``RUNTIME_SPLITS["ep"]``: ``tessera.models.moe.MoELayer``) or in experts modules stacked over experts that
  their block calls with its router's choices (``models.moe.stacked_experts_problem``: Hugging Face Mixtral,
  Qwen2-MoE, Qwen3-MoE...). A dense model has no ep to lose. Stacked experts (``runtime.hf_experts``) do not run
  ep with cp, or under zero-bubble with ZeRO >= 1: those combinations are unavailable (ep x tp runs: each expert
  is split over tp as well, ``runtime.tp_experts``).
- **cp** (``runtime.context_parallel``, rule ``cost_models.cp_rules``): ring attention needs attention modules
  with an integer ``head_dim`` and positions the runtime knows how to give each rank (Tessera's RoPE tables or
  learned ``pos_emb``).
- **sp** (``runtime.tensor_parallel``): a model with a ``MoELayer`` has no sequence parallelism (its experts route a
  flat dispatch buffer, not a sequence).
- **BatchNorm** (``runtime.data_parallel.check_batch_norm``): exact under data parallelism only, so a model
  holding one has no tp, cp or pp, no ``accumulation`` (one micro-batch per step) and no ``recompute``.

Keys other than an axis are features of a strategy (``planner.space.model_features``); ``a+b`` is refused only
together.

Combinations the runtime refuses for every model (ep with sp...) are ``cost_models.types.RUNTIME_EXCLUSIVE``,
applied by the search. Context parallelism's position rule lives in ``runtime.context_parallel``; the search
checks cp combinations only, and the runtime refuses a model whose positions it does not know.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import nn

from tessera.cost_models.tp_rules import (
    STYLES, block_problem, declared_tp_plan, is_norm, uncovered_parameter,
)
from tessera.cost_models.tp_embeddings import tie_problem
from tessera.cost_models.cp_rules import context_parallel_problem
from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.types import runtime_splits
from tessera.planner.measure import ExampleInputs
from tessera.planner.tp_trial import local_forward_problem
from tessera.models.moe import stacked_experts_problem

FX_FRONT_END = "torch.fx.symbolic_trace"
EXPORT_FRONT_END = "torch.export"


def unavailable_axes(
    model: nn.Module, layers: dict[str, nn.Module], stats: Sequence[LayerStats], *,
    front_end: str, fallback_reasons: Sequence[str] = (), tp_plan: Mapping[str, str] | None = None,
    token_inputs: bool = True, revisited: tuple[str, str] | None = None,
    trial_inputs: tuple[ExampleInputs | None, int] | None = None,
) -> dict[str, str]:
    """Axis name -> one line saying why the runtime cannot apply it to ``model`` (absent: available); ``tp_plan``:
    the user's tensor-parallel plan, as the runtime will be given it (else the model's declared one);
    ``token_inputs``: the model was captured on token ids (not on ``example_inputs``); ``revisited``: a layer
    that runs again after a later one (``layer_flow.revisited``); ``trial_inputs``: ``(example_inputs, seq_len)``
    to run each distinct block as one tensor-parallel rank holds it (``tp_trial``), where the rules allow tp."""
    planned = [layer for layer in stats if layer.fqn in layers]
    reasons = {
        "tp": _tensor_parallel_problem(model, layers, planned, tp_plan) or (
            _local_forward_problem(model, layers, planned, tp_plan, trial_inputs) if trial_inputs else None),
        "pp": _revisit_problem(revisited) or _pipeline_problem(model, front_end=front_end,
                                                                  fallback_reasons=fallback_reasons,
                                                                  token_inputs=token_inputs),
        "ep": _expert_parallel_problem(model, layers, planned),
        "cp": context_parallel_problem(model),
    }
    if reasons["ep"] is None:
        reasons.update(_stacked_experts_combinations(layers, planned))
    reasons["sp"] = _dispatch_buffer_problem(model)
    for axis, reason in _batch_norm_problems(model).items():
        reasons[axis] = reasons.get(axis) or reason
    return {axis: reason for axis, reason in reasons.items() if reason is not None}


def _batch_norm_problems(model: nn.Module) -> dict[str, str]:
    """BatchNorm normalises over the batch: the runtime keeps it exact under data parallelism only, over one
    micro-batch per step, without recomputation (``runtime.data_parallel.check_batch_norm`` refuses the rest)."""
    name = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    if name is None:
        return {}
    layer = f"BatchNorm {name or type(model).__name__}"
    return {
        "tp": f"{layer} would normalise over each rank's shard of the channels (not implemented)",
        "cp": f"{layer} would normalise over each rank's shard of the tokens (not implemented)",
        "pp": f"{layer} would normalise over each pipeline micro-batch instead of the whole batch",
        "accumulation": f"{layer} would normalise over each accumulated micro-batch instead of the whole batch",
        "recompute": f"{layer} would update its running statistics a second time when recomputed",
    }


# ----------------------------------------------------------------------------------------------- tensor parallelism


def _tensor_parallel_problem(model: nn.Module, layers: dict[str, nn.Module], planned: list[LayerStats],
                             tp_plan: Mapping[str, str] | None) -> str | None:
    covered = {id(p) for layer in planned for p in layers[layer.fqn].parameters()}
    stray = next((name for name, p in model.named_parameters() if id(p) not in covered), None)
    if stray is not None:
        return f"parameter {stray} belongs to no planned layer, so the runtime does not know how to split it"
    odd = next(((glob, style) for glob, style in (tp_plan or {}).items() if style not in STYLES), None)
    if odd is not None:
        return f"tp_plan entry {odd[0]!r}: style {odd[1]!r} is not implemented by the runtime"
    plan = _tp_plan(model, tp_plan)
    return _first_problem(planned, layers, plan, lambda layer: _layer_problem(layer, layers[layer.fqn], plan)) or (
        tie_problem(model, {layer.fqn: layer.kind for layer in planned}, plan)) or _vocabulary_glue(model, planned, layers)


def _vocabulary_glue(model: nn.Module, planned: list[LayerStats], layers: dict[str, nn.Module]) -> str | None:
    """A refusal line when the root holds one value per vocabulary entry outside every planned layer (BART's
    ``final_logits_bias``, added to the logits after the head): tensor parallelism leaves the logits split over
    the vocabulary, so the root's sum would meet a shard."""
    heads = [layers[layer.fqn] for layer in planned if layer.kind == "head" and isinstance(layers[layer.fqn], nn.Linear)]
    if not heads:
        return None
    vocabulary = heads[0].out_features
    inside = tuple(f"{layer.fqn}." for layer in planned)
    planned_tensors = {id(t) for layer in planned for t in (*layers[layer.fqn].parameters(), *layers[layer.fqn].buffers())}
    for name, tensor in (*model.named_buffers(), *model.named_parameters()):
        if not name.startswith(inside) and id(tensor) not in planned_tensors and tensor.numel() == vocabulary > 1:
            return (f"{name}, of shape {tuple(tensor.shape)}, spans the vocabulary outside every planned layer: the "
                    f"root forward of {type(model).__name__} would meet logits that tensor parallelism splits over the "
                    "vocabulary; plan with tp=1")
    return None


def _local_forward_problem(model: nn.Module, layers: dict[str, nn.Module], planned: list[LayerStats],
                           tp_plan: Mapping[str, str] | None, trial_inputs: tuple[ExampleInputs | None, int]) -> str | None:
    example_inputs, seq_len = trial_inputs
    skip = {layer.fqn: _routers(layers[layer.fqn]) for layer in planned if layer.kind == "block"}
    return local_forward_problem(model, planned, _tp_plan(model, tp_plan), example_inputs=example_inputs,
                                 seq_len=seq_len, skip=skip)


def _tp_plan(model: nn.Module, tp_plan: Mapping[str, str] | None) -> dict[str, str]:
    return dict(tp_plan) if tp_plan is not None else declared_tp_plan(model)


def _routers(block: nn.Module) -> list[str]:
    """Linears tensor parallelism keeps whole: the routers of Tessera's expert layers."""
    return [f"{name}.router" if name else "router" for name, m in block.named_modules() if runtime_splits("ep", type(m))]


def _layer_problem(layer: LayerStats, module: nn.Module, plan: dict[str, str]) -> str | None:
    """Why the runtime's tensor parallelism would refuse this layer at any degree, or None."""
    if layer.kind == "block":
        return block_problem(module, layer.fqn, plan=plan, skip=_routers(module))
    if layer.kind == "embedding":
        tables = {name for name, m in module.named_modules() if isinstance(m, nn.Embedding)}
        return uncovered_parameter(module, layer.fqn, tables)
    splits = (layer.kind == "head" and isinstance(module, nn.Linear)) or (layer.kind == "norm" and is_norm(module))
    name = None if splits else next((n for n, _ in module.named_parameters()), None)
    if name is not None:
        return (f"layer {layer.fqn} ({type(module).__name__}) holds parameter {name} but has no tensor-parallel split; "
                "plan with tp=1")
    return None


def _first_problem(planned: list[LayerStats], layers: dict[str, nn.Module], plan: Mapping[str, str],
                   problem: Callable[[LayerStats], str | None]) -> str | None:
    """The first layer's ``problem``, in order. A layer alike to one already found fine is fine too and not checked
    again (a 61-block MoE model of 256 experts each checks 2 blocks, not 61): alike means the same signature (class,
    parameter shapes, every measured number), the same classes of submodules, and the same user or declared plan
    entries that can match under it."""
    fine: set[tuple] = set()
    for layer in planned:
        module = layers[layer.fqn]
        key = (layer.signature, tuple(type(m).__qualname__ for m in module.modules()), _entries_under(plan, layer.fqn))
        if key in fine:
            continue
        if (found := problem(layer)) is not None:
            return found
        fine.add(key)
    return None


def _entries_under(plan: Mapping[str, str], fqn: str) -> tuple[tuple[str, str], ...]:
    """The plan entries (glob, style) whose leading parts match ``fqn`` (``*`` matches one part): the only ones that
    can style a module inside it, each read relative to it."""
    parts = fqn.split(".")
    return tuple((glob, style) for glob, style in plan.items()
                 if len(pattern := glob.split(".")) >= len(parts) and all(p in ("*", q) for p, q in zip(pattern, parts)))


# ----------------------------------------------------------------------------------------------- pipeline, experts


RECORDED_OUTPUTS = ("output_hidden_states",)
"""Hugging Face config flags that make the model record values inside every layer that the pipeline split refuses
(``runtime.pipeline_records``; router logits and, measured, attention weights it hands on as submodule outputs)."""


def _pipeline_problem(model: nn.Module, *, front_end: str, fallback_reasons: Sequence[str],
                      token_inputs: bool) -> str | None:
    """The runtime cuts stages from a ``torch.fx`` trace of the root forward, else from a ``torch.export`` one at a
    micro-batch of token ids (``runtime.pipeline_split``): a model only ``make_fx`` could trace, or one fx cannot
    trace that takes other inputs, cannot be pipelined."""
    recorded = [flag for flag in RECORDED_OUTPUTS if getattr(getattr(model, "config", None), flag, False) is True]
    if recorded:
        return (f"{type(model).__name__} returns every layer's {recorded[0].removeprefix('output_').replace('_', ' ')} "
                f"(config.{recorded[0]}=True), values its layers compute and the pipeline's stages cannot hand on; "
                f"set {recorded[0]}=False for training, or plan with pp=1")
    if front_end == FX_FRONT_END or (front_end == EXPORT_FRONT_END and token_inputs):
        return None
    if front_end == EXPORT_FRONT_END:
        return (f"torch.fx cannot trace {type(model).__name__} and the runtime exports its forward only at token-id "
                "inputs, not at the example inputs it was captured with")
    why = next((r for r in fallback_reasons if r.startswith(EXPORT_FRONT_END)), "")
    cause = f" ({why.split('): ', 1)[-1]})" if why else ""
    return (f"the runtime cuts pipeline stages from a torch.fx or torch.export trace of the root forward, and "
            f"neither traces {type(model).__name__}{cause}")


def _revisit_problem(revisited: tuple[str, str] | None) -> str | None:
    if revisited is None:
        return None
    layer, later = revisited
    return (f"{layer} runs again after {later} (one module applied at two depths), and a pipeline stage holds each "
            "layer once")


def _expert_parallel_problem(model: nn.Module, layers: dict[str, nn.Module], planned: list[LayerStats]) -> str | None:
    routed = [layer for layer in planned if layer.experts]
    if not routed or any(runtime_splits("ep", type(m)) for m in model.modules()):
        return None
    for layer in routed:
        module = layers[layer.fqn]
        holder = _experts_holder(module)
        problem = stacked_experts_problem(module.get_submodule(holder)) if holder else "it has no module named experts"
        if problem is not None:
            parent = module.get_submodule(holder.rpartition(".")[0]) if holder else module
            return (f"the experts of {_join(layer.fqn, holder.rpartition('.')[0])} ({type(parent).__name__}) cannot "
                    f"be split by the runtime's expert parallelism: {problem} (it splits Hugging Face's stacked "
                    "experts and Tessera's MoELayer); plan with ep=1")
    return None


def _dispatch_buffer_problem(model: nn.Module) -> str | None:
    """Sequence parallelism needs the tokens in sequence order; a ``MoELayer`` routes a flat dispatch buffer, so
    ``runtime.tensor_parallel`` refuses sp through it (stacked experts get the whole sequence gathered first)."""
    name = next((n for n, m in model.named_modules() if runtime_splits("ep", type(m))), None)
    if name is None:
        return None
    return (f"sequence parallelism through the mixture-of-experts layer {name} is not implemented (its experts see "
            "a dispatch buffer, not a sequence)")


def _experts_holder(block: nn.Module) -> str:
    return next((name for name, _ in block.named_modules() if name.rpartition(".")[2] == "experts"), "")


def _stacked_experts_combinations(layers: dict[str, nn.Module], planned: list[LayerStats]) -> dict[str, str]:
    """What expert parallelism of stacked experts modules does not combine with (``runtime.hf_experts``)."""
    routed = next((layer for layer in planned if layer.experts and _experts_holder(layers[layer.fqn])), None)
    if routed is None or any(runtime_splits("ep", type(m)) for m in layers[routed.fqn].modules()):
        return {}
    where = f"expert parallelism of the stacked experts of {routed.fqn}"
    return {"ep+cp": f"{where} together with context parallelism is not implemented",
            "ep+zero-bubble+zero": f"{where} under zero-bubble with ZeRO >= 1 differs from one process (measured)"}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
