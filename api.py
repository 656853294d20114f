"""Public entry points: ``plan`` (no real weights) and ``auto_parallelize`` (plan, then run)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from tessera.cost_models import Estimate, Strategy, TrainingConfig
from tessera.cost_models.error_bands import ErrorBand, prediction_band
from tessera.cost_models.tp_rules import check_plan_matches
from tessera.cost_models.types import Fp8Scaling, Precision
from tessera.errors import CheckpointError, ConfigError, NotModelledError, RuntimeSetupError
from tessera.planner.capture import capture, capture_preset, spec_for_seq_len
from tessera.planner.measure import ExampleInputs
from tessera.planner.plan import Plan
from tessera.planner.refine import RUNTIME_BLOCK_OPTIONS, BlockOptions
from tessera.planner.layer_graph import LayerGraph
from tessera.planner.model_source import (
    absolute_spec, factory_file, looked_for, missing_file_reason, names_a_model, resolve_model, runs_user_code,
)
from tessera.topology import Cluster, load_cluster
from tessera.topology.hardware import LOCAL_CPU
from tessera.topology.validation import quoted

if TYPE_CHECKING:  # the runtime (torch.distributed.pipelining...) costs ~1.5 s to import; planning never needs it
    from tessera.planner.compare import Comparison
    from tessera.runtime.apply import ParallelModel
    from tessera.runtime.snapshots import SnapshotConfig

# The search (OR-Tools, which imports pandas) and the explanations (matplotlib) take ~1.5 s to import: each entry
# point imports them after capture, so a model that cannot be built or traced fails without that wait.

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.bfloat16}  # FP8 changes the linears' rate, not the graph: capture in bf16


def plan(
    model: nn.Module | str,
    cluster: Cluster | str,
    *,
    global_batch: int,
    seq_len: int,
    precision: Precision | None = None,
    strategy: Strategy | str | None = None,
    top: int = 5,
    progress: Callable[[int, int], None] | None = None,
    expert_capacity_factor: float | None = None,
    fp8_scaling: Fp8Scaling | None = None,
    tp_plan: Mapping[str, str] | None = None,
    block_options: BlockOptions = RUNTIME_BLOCK_OPTIONS,
    example_inputs: ExampleInputs | None = None,
) -> Plan:
    """Choose how to split training of ``model`` on ``cluster``; never allocates real weights.

    ``model`` is an ``nn.Module`` (on any device, meta included) or a preset name such as ``llama3-70b``.
    ``precision`` defaults to bf16 mixed precision on accelerators and fp32 on CPU ranks. ``strategy``
    pins strategy fields (``"tp=8,pp=4"``) and searches the rest; a complete strategy is just evaluated.
    ``expert_capacity_factor`` sets the load MoE experts are planned for (``tessera.planner.experts``).
    ``precision="fp8"`` plans the blocks' linears on FP8 matrix units, scaled as ``fp8_scaling`` says
    (``cost_models.fp8``; default ``current``), as the runtime runs them (torchao's float8 linears,
    ``runtime.float8``: ``current`` and ``rowwise`` scaling). ``tp_plan`` (module glob ->
    Hugging Face style name) replaces the tensor-parallel plan the model declares, as ``auto_parallelize`` does.
    ``block_options`` are the per-block choices beside recomputation the integer program may make (activation
    offload, ZeRO-3 blocks keeping their gathered weights); ``planner.refine.NO_BLOCK_OPTIONS`` turns them off.
    ``example_inputs``: one sample's inputs for a model that does not take token ids ``(1, seq_len)`` (an image
    batch, several tensors): a tensor, a tuple of positional inputs, a dict of keyword inputs, or a function of
    ``seq_len`` returning them (``planner.capture.capture``); a spec's factory returns ``(model, example_inputs)``.
    """
    started = time.perf_counter()
    graph, resolved, training = _prepare(model, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision,
                                         expert_capacity_factor=expert_capacity_factor, fp8_scaling=fp8_scaling,
                                         tp_plan=tp_plan, example_inputs=example_inputs)
    captured_s = time.perf_counter() - started
    if training.precision == "fp8":
        _check_fp8_runs(model, graph, training)
    from tessera.planner.search import search

    chosen = search(graph, resolved, training, pins=_pins(strategy), top=top, progress=progress,
                    block_options=block_options)
    return chosen.model_copy(update={"capture_time_s": captured_s})


def evaluate(
    model: nn.Module | str,
    cluster: Cluster | str,
    *,
    global_batch: int,
    seq_len: int,
    strategy: Strategy | str,
    precision: Precision | None = None,
    expert_capacity_factor: float | None = None,
    fp8_scaling: Fp8Scaling | None = None,
    runs_on: str = "tessera",
    mtp_layers: int = 0,
    blocks: int | None = None,
) -> Evaluation:
    """Predict ``strategy`` (fields left out are filled with the planner's best choice under the given ones).

    Unlike :func:`plan`, a strategy that does not fit is still returned; its ``Estimate.fits`` is False.
    The result unpacks as ``strategy, estimate``; its ``band`` is the prediction's error band. ``runs_on``: the
    framework that runs it, priced as it runs it (``cost_models.profiles``: ``torchtitan``'s op-level selective
    recomputation and forward-only async TP, ``deepspeed``'s ZeRO-3 gathers, ``megatron``'s attention kernels...);
    Tessera's runtime by default. ``mtp_layers``: multi-token-prediction modules the framework trains after the
    blocks (DeepSeek-V3's one; ``planner.layer_graph.with_mtp_modules``); Tessera's runtime trains none.
    ``blocks``: the block count a framework's configuration states (``--num-layers``), refused if the model's differs.
    """
    from tessera.cost_models.profiles import TESSERA, profile
    from tessera.planner.layer_graph import with_mtp_modules

    framework = profile(runs_on)  # an unknown name fails before the capture
    if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
        raise ConfigError(f"mtp_layers={mtp_layers!r} is not a count of modules; give a whole number, 0 or more")
    if mtp_layers and framework.name == TESSERA.name:
        raise NotModelledError(f"mtp_layers={mtp_layers}: Tessera's runtime trains no multi-token-prediction modules; "
                               "price a framework that does with runs_on (e.g. 'megatron')")
    graph, resolved, training = _prepare(model, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision,
                                         expert_capacity_factor=expert_capacity_factor, fp8_scaling=fp8_scaling)
    counted = sum(layer.kind == "block" for layer in graph.layers)
    if blocks is not None and blocks != counted:
        raise ConfigError(f"the configuration states {blocks} layers but model {graph.model_name} has {counted} blocks; "
                          "make them agree (another model, or fix the configuration's layer count)")
    graph = with_mtp_modules(graph, mtp_layers)
    from tessera.planner.search import fitting_or_leanest, rank_candidates

    chosen, estimate = fitting_or_leanest(rank_candidates(graph, resolved, training, pins=_pins(strategy),
                                                         profile=framework))
    band = prediction_band(chosen, training.precision, device_name=resolved.device.name,
                           block_kinds=(layer.block_kind for layer in graph.layers))
    return Evaluation(chosen, estimate, band)


class Evaluation(tuple):
    """What :func:`evaluate` returns: ``(strategy, estimate)``, and ``band``, the error band of the prediction's
    regime on the held-out published runs (``band.range_s(estimate.step_time_s)``: where the step time likely
    falls; ``None`` on this machine's CPU, which no published run used)."""

    def __new__(cls, strategy: Strategy, estimate: Estimate, band: ErrorBand | None) -> Evaluation:
        evaluation = super().__new__(cls, (strategy, estimate))
        evaluation.band = band
        return evaluation

    def __getnewargs__(self) -> tuple:  # pickle and copy rebuild it from these
        return (*self, self.band)

    @property
    def strategy(self) -> Strategy:
        return self[0]

    @property
    def estimate(self) -> Estimate:
        return self[1]


def compare(
    model: nn.Module | str,
    cluster: Cluster | str,
    *,
    global_batch: int,
    seq_len: int,
    baselines: Sequence[Strategy | str],
    precision: Precision | None = None,
    top: int = 5,
    expert_capacity_factor: float | None = None,
    fp8_scaling: Fp8Scaling | None = None,
    baselines_run_on: Sequence[str] | None = None,
) -> Comparison:
    """Tessera's plan next to hand-tuned ``baselines``, each evaluated on the same cost model.

    A baseline is evaluated as :func:`evaluate` does (fields left out are filled by the planner) on the
    same captured model, so the throughput ratio and the per-term differences compare like with like. A
    baseline whose every completion overflows memory is estimated at its leanest and reported with how
    far over it is; one that cannot run at all (dp does not divide the batch...) is reported with the
    reason. A malformed baseline string raises ``ConfigError`` before anything is searched. ``baselines_run_on``:
    the framework each baseline runs on, priced as it runs it (as :func:`evaluate`'s ``runs_on``; default: each
    on Tessera's runtime). Under FP8, Tessera's plan takes the scaling its runtime runs (:func:`runtime_training`).
    """
    from tessera.cost_models.profiles import profile

    pins = [(b if isinstance(b, str) else b.to_string(), _pins(b)) for b in baselines]  # parse all before searching
    names = list(baselines_run_on) if baselines_run_on is not None else ["tessera"] * len(pins)
    if len(names) != len(pins):
        raise ConfigError(f"baselines_run_on names {len(names)} framework(s) for {len(pins)} baseline(s); give one each")
    frameworks = [profile(name) for name in names]
    graph, resolved, training = _prepare(model, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision,
                                         expert_capacity_factor=expert_capacity_factor, fp8_scaling=fp8_scaling)
    from tessera.planner.compare import build_comparison, evaluate_baseline
    from tessera.planner.search import search

    chosen = search(graph, resolved, runtime_training(training), top=top)
    return build_comparison(chosen, [
        evaluate_baseline(graph, resolved, training, requested=requested, pins=pinned, plan=chosen.estimate, runs_on=runs_on)
        for (requested, pinned), runs_on in zip(pins, frameworks)
    ])


def _prepare(
    model: nn.Module | str, cluster: Cluster | str, *, global_batch: int, seq_len: int, precision: Precision | None,
    expert_capacity_factor: float | None = None, fp8_scaling: Fp8Scaling | None = None,
    tp_plan: Mapping[str, str] | None = None, example_inputs: ExampleInputs | None = None,
) -> tuple[LayerGraph, Cluster, TrainingConfig]:
    if not isinstance(model, (str, nn.Module)):
        raise ConfigError(f"model must be an nn.Module or a spec such as 'llama3-8b' or 'hf:llama:...', got "
                          f"{type(model).__name__}")
    if example_inputs is not None and isinstance(model, str):
        raise ConfigError(f"example_inputs go with a model object; a spec's factory returns them itself: "
                          f"(model, example_inputs) from {model!r}")
    if tp_plan and isinstance(model, nn.Module):  # a spec's model is built, whole, by the runtime, which checks it
        check_plan_matches(tp_plan, model)
    model = absolute_spec(model) if isinstance(model, str) else model  # the plan names it for any folder
    resolved = load_cluster(cluster)
    training = TrainingConfig(
        global_batch=global_batch, seq_len=seq_len, precision=precision or default_precision(resolved),
        **({"fp8_scaling": fp8_scaling} if fp8_scaling is not None else {}),
    )
    _check_fp8_scaling(resolved, training)
    dtype = DTYPES[training.precision]
    graph = (
        capture_preset(model, seq_len=seq_len, dtype=dtype, expert_capacity_factor=expert_capacity_factor, tp_plan=tp_plan)
        if isinstance(model, str)
        else capture(model, seq_len=seq_len, dtype=dtype, expert_capacity_factor=expert_capacity_factor, tp_plan=tp_plan,
                     example_inputs=example_inputs)
    )
    if expert_capacity_factor is not None and not any(layer.experts for layer in graph.layers):
        raise ConfigError(f"expert_capacity_factor={expert_capacity_factor:g} (--expert-capacity) sets the load of routed "
                          f"experts, and {graph.model_name} has none; leave it out")
    return graph, resolved, training


def runtime_training(training: TrainingConfig) -> TrainingConfig:
    """``training`` as Tessera's runtime runs it: an FP8 scaling it does not run (a framework's delayed, block or MX
    scaling, ``runtime.float8``) becomes current scaling, which it does, for Tessera's own plan beside baselines
    priced at their framework's."""
    from tessera.runtime.float8 import runtime_scaling

    if training.precision != "fp8" or runtime_scaling(training.fp8_scaling) == training.fp8_scaling:
        return training
    return training.model_copy(update={"fp8_scaling": runtime_scaling(training.fp8_scaling)})


def _check_fp8_scaling(cluster: Cluster, training: TrainingConfig) -> None:
    """Refuse an FP8 scaling the cluster's devices do not run (``DeviceSpec.fp8_scalings``: MXFP8 needs Blackwell)."""
    runs = cluster.device.fp8_scalings
    if training.precision == "fp8" and runs is not None and training.fp8_scaling not in runs:
        why = " (MXFP8 needs Blackwell tensor cores)" if training.fp8_scaling == "mx" else ""
        raise ConfigError(f"fp8_scaling={training.fp8_scaling}: {cluster.device.name} runs "
                          f"{', '.join(runs) or 'no FP8 scaling'}{why}; pick one it runs or another cluster")


def _check_fp8_runs(model: nn.Module | str, graph: LayerGraph, training: TrainingConfig) -> None:
    """Refuse, before the search, an FP8 plan the runtime would refuse after it: a scaling torchao does not run, or
    blocks the runtime would leave largely in bf16 (stacked experts, ``Conv1D``, dimensions not multiples of 16:
    ``runtime.float8``). A factory's model is not built a second time for this (its user code ran for capture):
    ``apply_plan`` checks it."""
    from tessera.runtime.float8 import check_float8_model, check_float8_scaling

    check_float8_scaling(training.fp8_scaling)
    if isinstance(model, str) and runs_user_code(model):
        return
    module = resolve_model(model)[0] if isinstance(model, str) else model  # presets and hf: configs, on meta
    check_float8_model(module, [layer.fqn for layer in graph.layers if layer.kind == "block"])


def _pins(strategy: Strategy | str | Mapping[str, object] | None) -> dict[str, object]:
    """The fields ``strategy`` pins: a ``Strategy``, its string form (``"tp=8,pp=4"``) or a mapping of the same
    keys (``{"tp": 8}``), checked as the string is."""
    if strategy is None:
        return {}
    if isinstance(strategy, Strategy):  # every field it holds; its empty per-block lists and etp are no pins
        return {key: value for key, value in strategy.model_dump().items() if value not in ((), None)}
    if isinstance(strategy, Mapping):
        strategy = ",".join(f"{key}={value}" for key, value in strategy.items())
    if not isinstance(strategy, str):
        raise ConfigError(f"strategy must be a Strategy, a string such as 'tp=8,pp=4' or a dict of its fields, got "
                          f"{type(strategy).__name__}")
    return Strategy.parse_fields(strategy)


def model_to_train(spec: str, seq_len: int) -> nn.Module:
    """The model a spec names, on meta, as a plan of it at ``seq_len`` was captured: a preset's rotary tables
    extended as capture extended them; ``hf:...`` and ``file.py:factory`` specs built as planning built them. What
    ``auto_parallelize`` applies a spec's plan to, and what a launched ``train.py`` builds from ``Plan.model_name``."""
    module = resolve_model(spec)[0]
    if (longer := spec_for_seq_len(spec, seq_len, module)) != spec:
        module = resolve_model(longer)[0]
    return module


def auto_parallelize(
    model: nn.Module | str,
    cluster: Cluster | str,
    *,
    global_batch: int,
    seq_len: int,
    precision: Precision | None = None,
    strategy: Strategy | str | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    optimizer_factory: Callable[..., torch.optim.Optimizer] | None = None,
    lr_scheduler_factory: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
    resume_from: str | Path | None = None,
    snapshots: SnapshotConfig | None = None,
    tp_plan: Mapping[str, str] | None = None,
    example_inputs: ExampleInputs | None = None,
) -> ParallelModel:
    """Plan ``model`` for ``cluster`` and apply the plan on this process's rank.

    Run it on every rank (under ``torchrun`` or ``tessera.runtime.launch.spawn``) after the process group
    is initialised; the plan is deterministic, so every rank makes the same one (``apply_plan`` checks it
    and fails loudly otherwise). A preset name is built on the meta device and only this rank's shards are
    materialised, initialised exactly as the unsharded model would be from the current torch seed (seed
    every rank identically).

    ``example_inputs``: one sample's inputs for a model that does not take token ids (as :func:`plan`).

    ``resume_from``: a checkpoint folder (the root given to ``ParallelModel.save``). The cluster is fitted to
    the ranks actually running (an elastic restart on fewer or more devices re-plans for them), and the
    newest intact checkpoint there, saved under any plan, is loaded (``pm.step``, ``pm.resumed``); with no
    checkpoint there yet, training starts from scratch. See ``tessera.runtime.elastic``.

    ``lr_scheduler_factory``: ``factory(optimizer) -> LRScheduler`` (e.g. ``lambda opt: LambdaLR(opt, warmup)``);
    ``train_step`` steps it after every optimizer step, and checkpoints and snapshots save and restore it, so a
    resumed run continues the schedule (step it no more yourself).

    ``tp_plan``: your tensor-parallel plan, module glob -> Hugging Face style name (``colwise``, ``rowwise``,
    ``packed_colwise``, ``embedding_rowwise``...); it replaces the plan the model declares, for planning (which
    axes are available) and for the runtime alike.

    ``snapshots``: in-memory snapshots every ``snapshots.every`` steps (default: the reliability model's best
    interval for the plan) on this node and a buddy node (``tessera.runtime.snapshots``; the buddy crosses a
    switch where the cluster has one). A (re)start then first
    recovers the newest complete snapshot, resharded to the new plan, and falls back to ``resume_from``'s disk
    checkpoints (the second line of defence) when a disk checkpoint is newer or no snapshot is complete.
    """
    from tessera.runtime.apply import apply_plan, check_not_applied, check_precision

    check_precision(precision)  # before the search, which would plan it
    check_not_applied(model)
    if resume_from is not None:
        from tessera.runtime.checkpoint_files import check_resume_root

        check_resume_root(resume_from)
    resolved = load_cluster(cluster)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    elastic = resume_from is not None or snapshots is not None
    if elastic:
        from tessera.runtime.elastic import fit_cluster_to_world

        resolved = fit_cluster_to_world(resolved, world)
    if world != resolved.num_devices:
        raise RuntimeSetupError(
            f"this run has {world} rank(s) but cluster {resolved.name} has {resolved.num_devices} devices; "
            f"launch {resolved.num_devices} processes ({_torchrun_shape(resolved)}) or plan for the world you have"
        )
    chosen = plan(model, resolved, global_batch=global_batch, seq_len=seq_len, precision=precision, strategy=strategy,
                  tp_plan=tp_plan, example_inputs=example_inputs)
    module = model_to_train(model, seq_len) if isinstance(model, str) else model
    parallel = apply_plan(module, chosen, loss_fn=loss_fn, optimizer_factory=optimizer_factory,
                          lr_scheduler_factory=lr_scheduler_factory, tp_plan=tp_plan)
    if snapshots is not None:
        parallel.enable_snapshots(_with_switches(snapshots, resolved))
    if elastic:
        from tessera.runtime.elastic import resume_if_possible

        resume_if_possible(parallel, resume_from)
    return parallel


def _torchrun_shape(cluster: Cluster) -> str:
    """The torchrun arguments that give ``cluster``'s world: ``--nnodes 2 --nproc-per-node 8`` on two 8-GPU nodes."""
    nodes, per_node = cluster.num_hosts, cluster.host_size
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node}" if nodes > 1 else f"torchrun --nproc-per-node {per_node}"


def _with_switches(config: SnapshotConfig, cluster: Cluster) -> SnapshotConfig:
    """``config`` with the nodes under one switch from ``cluster`` (its level above the node), unless given."""
    if config.nodes_per_switch is not None or len(cluster.levels) < 3:
        return config
    per_switch = cluster.levels[1].group_size // cluster.host_size
    return config.model_copy(update={"nodes_per_switch": max(1, per_switch)})


def resume(
    checkpoint: str | Path,
    cluster: Cluster | str,
    *,
    model: nn.Module | str | None = None,
    strategy: Strategy | str | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    optimizer_factory: Callable[..., torch.optim.Optimizer] | None = None,
    lr_scheduler_factory: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
    trust_model_factory: bool = False,
) -> ParallelModel:
    """Continue the run saved in ``checkpoint`` on ``cluster`` (re-planned for it): run on every rank.

    The model (the spec stored with the checkpoint, unless ``model`` is given), global batch, sequence
    length and precision come from the checkpoint's plan; the strategy is planned afresh for the devices now
    available (``cluster`` is fitted to the live world size) and the newest intact checkpoint is loaded under
    it. Continue with ``for step in range(pm.step, total)``; ``pm.resumed.data_state`` is the saved data position.
    Pass the run's ``lr_scheduler_factory`` again: the scheduler's saved state is loaded into the one it builds.

    A checkpoint whose plan names a model factory (``file.py:make_model``, ``module:make_model``) would import and
    run that code: it is used only when ``model`` names it again or with ``trust_model_factory=True``.
    """
    from tessera.runtime.saved_plans import saved_plan

    saved = saved_plan(checkpoint)
    training = saved.training
    return auto_parallelize(
        checkpoint_model(saved, checkpoint, model=model, trust_model_factory=trust_model_factory), cluster,
        global_batch=training.global_batch, seq_len=training.seq_len, precision=training.precision,
        strategy=strategy, loss_fn=loss_fn, optimizer_factory=optimizer_factory,
        lr_scheduler_factory=lr_scheduler_factory, resume_from=checkpoint,
    )


def checkpoint_model(
    saved: Plan, checkpoint: str | Path, *, model: nn.Module | str | None, trust_model_factory: bool
) -> nn.Module | str:
    """The model to resume ``checkpoint`` with: ``model`` if given, else the spec its plan names, which may run
    user code (a factory) only when the caller trusts it."""
    if model is not None:
        return model
    if not names_a_model(saved.model_name):
        raise CheckpointError(
            f"checkpoint {checkpoint} was saved from a model object ({quoted(saved.model_name)}), which its plan.json "
            "cannot rebuild; pass the model: tessera.resume(..., model=your_model), or tessera resume ... --model SPEC"
        )
    _check_factory_file(saved.model_name, checkpoint)
    if runs_user_code(saved.model_name) and not trust_model_factory:
        spec = saved.model_name[:160]
        raise CheckpointError(
            f"checkpoint {checkpoint} names the model factory {spec!r} in its plan.json; building it would import "
            f"and run that code. Read it, then name it yourself (tessera resume ... --model '{spec}', or "
            "tessera.resume(..., model=...)) or pass --trust-model-factory (trust_model_factory=True)"
        )
    return saved.model_name


def _check_factory_file(spec: str, checkpoint: str | Path) -> None:
    """Refuse a saved factory spec whose file is not where it would be read (before any trust is asked): a plan made
    before Tessera recorded absolute paths names it relative to the folder the plan was made in."""
    path = factory_file(spec)
    if path is not None and not os.path.isfile(looked_for(path)):  # isfile: False for any name, however long
        reason = missing_file_reason(str(path), spec.rpartition(":")[2])
        raise CheckpointError(f"checkpoint {checkpoint}'s plan.json names the model factory {quoted(spec)}, but "
                              f"{reason} (tessera resume ... --model SPEC, or tessera.resume(..., model=SPEC))")


def default_precision(cluster: Cluster) -> Precision:
    """bf16 mixed precision on accelerators; fp32 on CPU ranks, where bf16 is slow and inexact."""
    return "fp32" if cluster.device.name == LOCAL_CPU else "bf16"
