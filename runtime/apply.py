"""Apply a ``Plan`` to a real model on this rank and train it: ``apply_plan(model, plan) -> ParallelModel``.

Order of application (torchtitan's, for the same reasons):

1. refuse what the runtime cannot run (before any collective: alike on every rank, and without a process
   group; with ``pp > 1`` this traces the root forward and checks its chunk boundaries); build the
   ``("edp", "pp", "ep", "cp", "tp")`` mesh (``"dp"`` is ``edp`` x ``ep`` flattened;
   ``runtime.mesh``), check the plan is the same on every rank, broadcast rank 0's weights (so ranks need not
   be seeded identically; skipped for a model on meta); with ``dp > 1``, replace each BatchNorm layer by one
   that normalises over the whole data-parallel batch (``runtime.data_parallel.sync_batch_norms``); with
   ``ep > 1``, replace each MoE layer by its expert-parallel form holding this rank's experts
   (``runtime.expert_parallel``);
2. pipeline: free the layers of chunks other ranks run (a weight tied across chunks keeps a copy on each
   stage holding it: its gradients are summed over those stages before each optimizer step, step 10);
3. activations per layer: recomputation, full or selective, or offload to host memory (hooks: FQNs
   unchanged; ``runtime.recompute``, ``runtime.offload``);
4. tensor (+ sequence) parallelism on this rank's layers (``runtime.tensor_parallel``; after recomputation
   so a checkpointed first block re-runs the sequence scatter on recomputation);
5. ``torch.compile`` per block, when asked;
6. pipeline: one module per local chunk (``runtime.pipeline``), cut from the root forward traced in step 1
   (``torch.fx``, else ``torch.export`` at one micro-batch: any model whose forward exports);
7. the data-parallel axis on each module: DDP, FSDP2-``replicate``, ZeRO-1/2/3, under ZeRO-3 each block
   resharding after its forward or not as ``Strategy.block_reshard`` says (``runtime.data_parallel``);
8. a model on the meta device is materialised now, shard by shard (``runtime.materialize``);
9. with ``cp > 1``, ring attention and this rank's sequence positions (``runtime.context_parallel``; after
   materialisation, which recomputes the RoPE tables);
10. the optimizer over the rank's parameters; the pipeline schedule.

The runtime reads only the ``Plan`` data model (never the planner or the cost model's internals).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tessera.cost_models.layer_stats import LinearPair
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.plan import Plan, PlannedLayer
from tessera.runtime import pipeline as pp_
from tessera.runtime import pipeline_ties as ties_
from tessera.runtime.tied_state import tied_names
from tessera.runtime.compile import compile_blocks as compile_block_forwards
from tessera.runtime.data_parallel import (
    apply_data_parallel,
    broadcast_module_states,
    check_batch_norm,
    sync_batch_norms,
    uses_ddp,
)
from tessera.runtime.lr_schedule import LRSchedulerFactory, build_scheduler
from tessera.runtime.materialize import check_plan_agrees, is_on_meta, materialize_shards
from tessera.runtime.context_parallel import apply_context_parallel, check_context_parallel
from tessera.runtime.float8 import (
    MAX_BF16_SHARE, check_float8, check_float8_model, convert_blocks, gather_bytes_on_gloo,
)
from tessera.runtime.expert_parallel import apply_expert_parallel, check_expert_folding, check_expert_parallel
from tessera.runtime.mesh import PP, TP, build_mesh, device_type
from tessera.runtime.offload import OffloadStats, apply_offload
from tessera.runtime.parallel_model import LossFn, ParallelModel
from tessera.runtime.recompute import apply_recompute
from tessera.runtime.losses import TokenWeights, build_loss, target_check
from tessera.runtime.targets import output_classes
from tessera.runtime.tensor_parallel import (
    apply_tensor_parallel,
    check_sequence_parallel,
    check_tensor_parallel,
    sequence_entry,
)

log = logging.getLogger(__name__)
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
DEFAULT_LR = 1e-3


def default_optimizer_factory(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with ``lr=1e-3`` and PyTorch's other defaults."""
    return torch.optim.AdamW(params, lr=DEFAULT_LR)


def apply_plan(
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    lr_scheduler_factory: LRSchedulerFactory | None = None,
    tp_pairs: Mapping[str, tuple[LinearPair, ...]] | None = None,
    tp_plan: Mapping[str, str] | None = None,
    compile_blocks: bool = False,
) -> ParallelModel:
    """Parallelise ``model`` (in place) as ``plan`` says and return the rank's ``ParallelModel``.

    ``model`` is on this rank's device, or on the meta device: then only this rank's shards are ever
    allocated and they are initialised exactly as ``model.reset_parameters()`` would initialise the whole
    model (every rank must be seeded identically; see ``runtime.materialize``). Without an initialised
    process group the plan must have world size 1. ``tp_pairs`` optionally gives each block's column/row
    linear pairs (``LayerStats.tp_pairs``; found from the module tree otherwise); ``tp_plan`` maps module globs to
    Hugging Face tensor-parallel style names (``{"model.layers.*.mlp.gate_up_proj": "packed_colwise", ...}``) and
    replaces the plan the model declares (``config.base_model_tp_plan``). ``compile_blocks`` compiles
    each block with ``torch.compile``. ``lr_scheduler_factory(optimizer)`` builds a learning-rate scheduler on the
    rank's optimizer: ``train_step`` steps it after every optimizer step, checkpoints and snapshots keep its state
    (``runtime.lr_schedule``).

    The loss: ``loss_fn(outputs, targets) -> scalar`` gets the model's output for one micro-batch and the
    matching rows of the targets. Without ``loss_fn``, :func:`default_loss_fn` (cross-entropy) reads the logits
    from a tensor output, a ``.logits`` attribute or ``"logits"`` key (Hugging Face ``ModelOutput``, dicts), or
    a tuple's first element, under every strategy; for other outputs pass ``loss_fn`` (with tensor parallelism
    it receives vocabulary-sharded logits as a ``DTensor``, on which ``F.cross_entropy`` works; see
    :func:`build_loss`).

    BatchNorm: with ``dp > 1`` each BatchNorm layer normalises over the whole data-parallel batch, so data
    parallelism (DDP, ZeRO-1/2/3) trains as one process does (``runtime.data_parallel.sync_batch_norms``);
    where its statistics could not be the whole batch's (``tp``/``cp``/``pp > 1``, more than one micro-batch
    per step, recomputation of a layer holding it) ``NotModelledError`` names the layer and the fix.

    Raises ``NotModelledError`` for parts of a plan the runtime does not implement or layers it cannot split,
    ``RuntimeSetupError`` when the world does not match the plan. Expert parallelism (``ep > 1``) needs
    ``tessera.models.moe`` layers (a model on meta is materialised whole before its experts are split, as for
    DDP) and composes with pipelining; context parallelism (``cp > 1``) needs batches of the planned
    ``seq_len`` and does not compose with pipelining (``NotModelledError`` names the combination).
    """
    check_supported(plan)
    check_plan_is_for(model, plan)
    if plan.training.precision == "fp8":
        check_float8_model(model, plan.block_fqns)
    check_batch_norm(model, plan)
    _check_experts_and_context(model, plan, compile_blocks=compile_blocks)  # before any process group is made
    classes = output_classes(model) if loss_fn is None else None  # before the head is split or freed
    on_meta = is_on_meta(model)
    ties = _cross_stage_ties(model, plan)
    aliases = tied_names(model)  # before splitting unties them
    traced = pp_.trace_plan(model, plan) if plan.strategy.pp > 1 else None  # before any process group
    mesh = None if _runs_without_process_group(plan) else build_mesh(plan.strategy)
    device = _target_device(model, on_meta=on_meta)
    if mesh is not None:
        check_plan_agrees(plan)
    _claim(model)  # what follows changes the model in place
    if mesh is not None:
        broadcast_module_states(model)
        sync_batch_norms(model, mesh)
    if plan.training.precision == "fp8":
        _convert_to_float8(model, plan)
    on_meta = _split_experts(model, plan, mesh, on_meta=on_meta, device=device)
    chunks = pp_.local_chunks(plan, mesh.get_local_rank(PP)) if mesh is not None else [0]
    layers = [layer for layer in plan.layers if layer.chunk in chunks and layer.kind != "loss"]
    offloads = _shard_layers(model, plan, layers, mesh, chunks=chunks, tp_pairs=tp_pairs, tp_plan=tp_plan,
                             compile_blocks=compile_blocks)
    modules = _chunk_modules(model, plan, chunks, traced)
    pipeline_output = _pipeline_output(plan, traced, modules, chunks)
    modules = _data_parallel(model, plan, modules, mesh, on_meta=on_meta, device=device)
    if plan.gathers_fp8() and device.type == "cpu":
        gather_bytes_on_gloo(modules)
    if plan.strategy.cp > 1:
        apply_context_parallel(model, mesh, seq_len=plan.training.seq_len)
    optimizer = (optimizer_factory or default_optimizer_factory)(_unique_parameters(modules))
    _sum_tied_gradients(plan, ties, modules, mesh, optimizer, on_meta=on_meta)
    weights = TokenWeights() if loss_fn is None else None  # a custom loss's reduction is its own
    loss = build_loss(loss_fn, plan, mesh, pipeline_output=pipeline_output, classes=classes, weights=weights)
    schedule = _schedule(plan, modules, chunks, mesh, device=device, loss_fn=loss)
    return ParallelModel(plan, modules, optimizer=optimizer, loss_fn=loss, mesh=mesh, device=device,
                         schedule=schedule, chunks=chunks, offloads=offloads, token_weights=weights,
                         check_targets=target_check(loss_fn, classes),
                         lr_scheduler=build_scheduler(lr_scheduler_factory, optimizer), tied_names=aliases)


_APPLIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models ``apply_plan`` changed in place (sharded, moved, wrapped): a second plan on one would split shards."""


def check_not_applied(model: object) -> None:
    """Refuse a model ``apply_plan`` already parallelised (under pp, its second pipeline aborted in gloo)."""
    if isinstance(model, nn.Module) and model in _APPLIED:
        raise ConfigError(f"this {type(model).__name__} object was already parallelised (apply_plan or "
                          "auto_parallelize changed it in place, also when it then failed); keep using the "
                          "ParallelModel returned then, or build a fresh model for another plan")


def check_plan_is_for(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan made for another model (a plan file from another run): it would train under the other model's
    predictions and save checkpoints that name the other model, which a resume into that model then loads in part."""
    count = sum(p.numel() for p in model.parameters())
    missing = [fqn for fqn in _layer_fqns(plan) if not _holds(model, fqn)]
    if missing or count != plan.param_count:
        found = f"has no module {missing[0]}" if missing else f"has {count:,} parameters"
        raise ConfigError(f"this plan was made for {plan.model_name} ({plan.param_count:,} parameters) but this "
                          f"{type(model).__name__} {found}; plan this model (tessera.plan(model, ...)) and apply "
                          "that plan")


def _claim(model: nn.Module) -> None:
    check_not_applied(model)
    _APPLIED.add(model)


def _convert_to_float8(model: nn.Module, plan: Plan) -> None:
    """The blocks' linears on FP8 matmuls (``runtime.float8``); says once which matrix weights stay bf16."""
    kept = list(convert_blocks(model, plan.block_fqns, plan.training.fp8_scaling,
                               gather_fp8=plan.gathers_fp8()))
    if kept and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("fp8: %d matrix weight(s) inside the blocks stay bf16 though the plan priced them FP8 (under "
                    "%.0f%% of the blocks' weights): %s", len(kept), 100 * MAX_BF16_SHARE,
                    ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))


def check_precision(precision: str | None) -> None:
    """Refuse a precision the runtime does not train in (``auto_parallelize`` asks before it plans)."""
    if precision == "fp16":
        raise NotModelledError(
            "precision fp16 needs dynamic loss scaling (a GradScaler whose overflow check agrees across "
            "sharded ranks), which the runtime does not implement yet; plan with bf16 or fp32"
        )


def check_supported(plan: Plan) -> None:
    """Raise ``NotModelledError``/``ConfigError`` naming the problem if the runtime cannot run ``plan``."""
    check_expert_folding(plan.strategy)
    if plan.training.precision == "fp8":
        check_float8(plan.training.fp8_scaling)
    check_precision(plan.training.precision)
    if plan.strategy.schedule == "zero-bubble" and plan.strategy.pp > 1 and any(
        layer.recompute in ("selective", "full") for layer in plan.layers
    ):
        raise NotModelledError(
            "schedule=zero-bubble with activation recomputation: the schedule runs each backward as separate input- "
            "and weight-gradient passes, and torch 2.13's non-reentrant checkpoint then recomputes a second time "
            "and fails ('_GeneratorContextManager' object has no attribute 'args'); use schedule=1f1b or "
            "interleaved with recomputation, or zero-bubble without it"
        )
    check_per_block(plan)
    s = plan.strategy
    if s.pp > 1 and s.schedule == "zero-bubble" and s.zero == 3 and s.dp * s.cp > 1:  # types.RUNTIME_EXCLUSIVE
        raise NotModelledError(
            f"schedule=zero-bubble with ZeRO-3 over {s.dp * s.cp} ranks: it trains differently "
            "from one process (torch 2.13's split input- and weight-gradient passes under FSDP2, measured on gloo); "
            "use schedule=1f1b or interleaved with zero=3, or zero-bubble with zero=2")
    if plan.strategy.tp_overlap:
        raise NotModelledError(
            "tp_overlap (tensor-parallel collectives overlapped with their matmuls) is a cost-model option for "
            "evaluating published configurations; the runtime does not implement it: drop tp_overlap=true"
        )
    if plan.strategy.pipeline_passes > 1:
        raise NotModelledError(
            f"pipeline_passes={plan.strategy.pipeline_passes} (a step's micro-batches run as separate pipeline "
            "schedule calls) is a cost-model option for evaluating published configurations; the runtime runs all "
            "of a step's micro-batches in one schedule call: drop pipeline_passes"
        )
    if plan.strategy.recompute_modules:
        raise NotModelledError(
            f"recompute_modules={'/'.join(plan.strategy.recompute_modules)} (Megatron-Core's recomputation of named "
            "pieces of a block) is a cost-model option for evaluating published configurations; the runtime "
            "recomputes whole blocks or their attention cores: drop recompute_modules"
        )
    if plan.strategy.sp_regather:
        raise NotModelledError(
            "sp_regather (Megatron-LM's sequence parallelism: save the input shard, all-gather it again in the "
            "backward) is a cost-model option for evaluating published configurations; the runtime saves the "
            "gathered input instead: drop sp_regather=true"
        )
    if plan.strategy.sp and plan.strategy.tp > 1:
        check_sequence_parallel(plan.training.seq_len, plan.strategy.tp)
    if plan.strategy.pp > 1:
        pp_.check_chunks(plan)


def _check_experts_and_context(model: nn.Module, plan: Plan, *, compile_blocks: bool) -> None:
    """Check expert and context parallelism against the model, on every rank, before anything is changed."""
    strategy = plan.strategy
    if strategy.cp > 1:
        check_context_parallel(model, strategy, seq_len=plan.training.seq_len, compile_blocks=compile_blocks)
    if strategy.ep > 1:
        check_expert_parallel(model, strategy, selective_recompute=bool(recompute_fqns(plan, "selective")))


def _split_experts(
    model: nn.Module, plan: Plan, mesh: DeviceMesh | None, *, on_meta: bool, device: torch.device
) -> bool:
    """Keep this rank's experts (``ep > 1``); returns whether the model is still on meta.

    A meta model is materialised whole first, as for DDP: the sharded initialisation draws every parameter
    of the model tree in order, and the remote experts are no longer in it once split.
    """
    if plan.strategy.ep == 1:
        return on_meta
    if on_meta:
        materialize_shards(model, [model], layer_fqns=_layer_fqns(plan), device=device)
    apply_expert_parallel(model, mesh, ep=plan.strategy.ep)
    return False


def block_reshard(plan: Plan) -> dict[str, bool]:
    """Under ZeRO-3, whether each block (by FQN) reshards after its forward (``Strategy.reshards_block``)."""
    if plan.strategy.zero != 3:
        return {}
    return {fqn: plan.strategy.reshards_block(index) for index, fqn in enumerate(plan.block_fqns)}


def check_per_block(plan: Plan) -> None:
    """Refuse per-block settings that do not fit the plan's blocks (``ConfigError`` naming the fix)."""
    blocks = len(plan.block_fqns)
    for key, example in (("block_reshard", f"{blocks}xtrue"), ("block_recompute", f"{blocks}xnone")):
        given = len(getattr(plan.strategy, key))
        if given and given != blocks:
            raise ConfigError(f"{key} has {given} entries but the plan has {blocks} blocks; give one per block in "
                              f"model order (e.g. {key}={example}) or drop it")


def recompute_fqns(plan: Plan, policy: str = "full", layers: Iterable[PlannedLayer] | None = None) -> tuple[str, ...]:
    """FQNs of the layers the plan recomputes with ``policy`` (the plan's per-layer decisions are authoritative)."""
    return tuple(layer.fqn for layer in (plan.layers if layers is None else layers) if layer.recompute == policy)


def _shard_layers(
    model: nn.Module, plan: Plan, layers: list[PlannedLayer], mesh: DeviceMesh | None, *, chunks: list[int],
    tp_pairs: Mapping[str, tuple[LinearPair, ...]] | None, tp_plan: Mapping[str, str] | None, compile_blocks: bool,
) -> dict[str, OffloadStats]:
    """Steps 2-5: free other ranks' layers, recomputation or offload, tensor parallelism, compilation (all in
    place); returns what each offloaded block's hooks move."""
    strategy = plan.strategy
    if strategy.tp > 1:  # the whole plan, on every rank: a layer another pipeline rank runs must fail here too
        check_tensor_parallel(model, plan.layers, tp=strategy.tp, sp=strategy.sp, pairs=tp_pairs, tp_plan=tp_plan)
    if strategy.pp > 1:
        pp_.free_remote_layers(model, plan, chunks)
    apply_recompute(model, recompute_fqns(plan, "full", layers), selective_fqns=recompute_fqns(plan, "selective", layers))
    offloads = apply_offload(model, recompute_fqns(plan, "offload", layers))
    if strategy.tp > 1:  # after recomputation: see tensor_parallel._add_sequence_hooks
        apply_tensor_parallel(model, layers, mesh[TP], sequence_parallel=strategy.sp,
                              sequence_entry=sequence_entry(plan.layers), pairs=tp_pairs, tp_plan=tp_plan)
    if compile_blocks:
        compile_block_forwards(model, [layer.fqn for layer in layers if layer.kind == "block"])
    return {fqn: offload.stats for fqn, offload in offloads.items()}


def _chunk_modules(model: nn.Module, plan: Plan, chunks: list[int], traced: pp_.TracedForward | None) -> list[nn.Module]:
    if traced is None:
        return [model]
    node_chunks = pp_.node_chunks(traced.graph, pp_.layer_chunks(plan))
    modules = [pp_.build_chunk_module(model, traced.graph, node_chunks, chunk, attributes=traced.attributes)
               for chunk in chunks]
    if traced.exported is not None and 0 in chunks:  # the export holds its input shape as constants
        pp_.check_input_shapes(modules[0], traced.exported.input_shapes)
    return modules


def _cross_stage_ties(model: nn.Module, plan: Plan) -> list[ties_.TiedWeight]:
    """Weights tied across pipeline chunks (embedding and head), checked before any collective."""
    if plan.strategy.pp == 1:
        return []
    ties = ties_.cross_chunk_ties(model, plan)
    ties_.check_ties(ties, plan.strategy)
    return ties


def _sum_tied_gradients(plan: Plan, ties: list[ties_.TiedWeight], modules: list[nn.Module],
                        mesh: DeviceMesh | None, optimizer: torch.optim.Optimizer, *, on_meta: bool) -> None:
    """Each tied weight's copies (one per stage holding it) start equal (a model built on meta: the last stage's
    value) and get the summed gradient before every optimizer step (``pipeline_ties.TiedGradients``; Megatron-LM's
    embedding all-reduce), so they stay equal."""
    if not ties:
        return
    local = ties_.local_tied_parameters(ties, modules, mesh, pp=plan.strategy.pp, pp_rank=mesh.get_local_rank(PP))
    if on_meta:  # each stage initialised its own copy
        ties_.share_initial_values(ties, local, pp=plan.strategy.pp, pp_rank=mesh.get_local_rank(PP))
    if local:
        optimizer.register_step_pre_hook(ties_.TiedGradients(local))


def _pipeline_output(plan: Plan, traced: pp_.TracedForward | None, modules: list[nn.Module],
                     chunks: list[int]) -> pp_.DictOutput | pp_.TreeOutput | None:
    """On the last chunk's rank, what its output held: the export's output structure, or the dict an fx trace
    returned, which the chunk now returns as a tuple (``pipeline.return_dict_as_tuple``)."""
    last = len(plan.chunk_fqns()) - 1
    if traced is None or last not in chunks:
        return None
    if traced.exported is not None:
        return pp_.TreeOutput(traced.exported.output_spec, traced.exported.output_constants)
    return pp_.return_dict_as_tuple(modules[chunks.index(last)])


def _data_parallel(
    model: nn.Module, plan: Plan, modules: list[nn.Module], mesh: DeviceMesh | None, *, on_meta: bool,
    device: torch.device,
) -> list[nn.Module]:
    """Step 7 (and 8): wrap or shard each module over ``dp``; materialise a meta model around it."""
    strategy = plan.strategy
    wraps = mesh is not None and (strategy.dp * strategy.cp > 1 or strategy.zero > 0)  # cp ranks average too
    ddp = wraps and uses_ddp(strategy)
    layer_fqns = _layer_fqns(plan)
    if on_meta and (ddp or not wraps):  # DDP cannot wrap a meta model: materialise first
        materialize_shards(model, modules, layer_fqns=layer_fqns, device=device)
    if wraps:
        modules = [
            apply_data_parallel(module, mesh, strategy=strategy, precision=plan.training.precision,
                                block_fqns=[fqn for fqn in plan.block_fqns if _holds(module, fqn)],
                                block_reshard=block_reshard(plan))
            for module in modules
        ]
    if on_meta and wraps and not ddp:
        materialize_shards(model, modules, layer_fqns=layer_fqns, device=device)
    return modules


def _schedule(plan: Plan, modules: list[nn.Module], chunks: list[int], mesh: DeviceMesh | None, *,
              device: torch.device, loss_fn: LossFn):
    if plan.strategy.pp == 1:
        return None
    stages = pp_.build_stages(modules, chunks, num_chunks=len(plan.chunk_fqns()), device=device,
                              group=mesh.get_group(PP), schedule=plan.strategy.schedule)
    micro_batches = plan.strategy.gradient_accumulation(plan.training.global_batch)
    return pp_.build_schedule(stages, plan.strategy, micro_batches=micro_batches, loss_fn=loss_fn)


def _layer_fqns(plan: Plan) -> list[str]:
    return [layer.fqn for layer in plan.layers if layer.kind != "loss"]


def _holds(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def _unique_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def _target_device(model: nn.Module, *, on_meta: bool) -> torch.device:
    if not on_meta:
        return next(model.parameters()).device
    if dist.is_initialized() and device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _runs_without_process_group(plan: Plan) -> bool:
    return plan.strategy.world_size == 1 and not dist.is_initialized()
