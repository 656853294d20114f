"""A plan as torchtitan 0.3 configuration, and a torchtitan configuration read back into a ``Strategy``.

torchtitan 0.3 configures a run in Python (a ``config_registry`` function returning ``Trainer.Config``; its
command-line surface is frozen), so the export is a function that sets the ``parallelism``, ``training``,
``activation_checkpoint`` (and for async TP ``compile``) fields Tessera decided on the user's ``Trainer.Config``.
Field names, defaults and rules are torchtitan 0.3.0's (``torchtitan/config/configs.py``,
``torchtitan/distributed/parallel_dims.py``, ``torchtitan/distributed/activation_checkpoint.py``).

What the fields express, and the nearest setting where they cannot:

- ZeRO-3 is FSDP (``data_parallel_shard_degree = dp``), ZeRO-0 is DDP (``data_parallel_replicate_degree = dp``).
  ZeRO-2 is FSDP that keeps parameters gathered after the forward (``fsdp_reshard_after_forward = "never"``:
  full parameters through the step, sharded gradients and optimizer state); ZeRO-1 has no counterpart (nearest:
  that ZeRO-2). With context parallelism torchtitan always shards over ``dp_shard * cp`` (ZeRO-3 at least).
  Expert parallelism borrows FSDP ranks, so ep needs a sharded data-parallel axis (nearest: ZeRO-3). With
  ``ep > 1`` the routed experts are sharded over ``efsdp x ep`` only, which also takes the tensor-parallel ranks
  (``ParallelDims``: ``efsdp = dp_shard * cp * tp / ep``): the experts' tensor-parallel degree is 1 (``etp=1``,
  Megatron's "MoE parallel folding"); without expert parallelism they are split by ``tp`` like the MLP.
- Pipeline chunks are ``module_fqns_per_model_part`` (the planned model's module names, chunk ``c`` on rank
  ``c % pp``); schedules ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``InterleavedZeroBubble``. All of a data-parallel
  rank's micro-batches run in one schedule: ``local_batch_size = global / dp``. Read back, a pipelined
  configuration that accumulates gradients over several local batches runs one schedule per local batch, each
  with its own fill and drain (``Strategy.pipeline_passes``, which Tessera's runtime does not run).
- Activation checkpointing is one policy for every block: ``FullAC``, ``SelectiveAC`` (per-op: saves
  compute-intensive ops except every second matmul, recomputes the rest; ``cost_models.profiles.TORCHTITAN``
  prices that, where Tessera's runtime recomputes the attention core) or None.
  A per-block mix is rendered as full if any block is full, else selective. torchtitan 0.3.0 has no activation
  offload (``training.enable_cpu_offload`` offloads FSDP's parameters, gradients and optimizer state): an
  offloaded block counts as full recomputation (the nearest that keeps its activations off the device).
- ``fsdp_reshard_after_forward`` is one setting for every FSDP unit: a per-block reshard mix (``block_reshard``)
  is rendered as ``"default"`` (every block reshards), every block kept as ``"never"`` (ZeRO-2).
- Precision: ``mixed_precision_param`` is bfloat16 or float32 (fp16 has no setting: nearest bf16).
"""

from __future__ import annotations

import re

from tessera.cost_models.profiles import TORCHTITAN_COMPILED
from tessera.cost_models.types import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, Strategy
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.frameworks.common import (
    FrameworkExport, ImportedConfig, PlanLike, block_policies, canonical, kept_blocks, offload_as_full, strategy_with,
    uniform_policy, whole, without_named_pieces,
)
from tessera.planner.frameworks.torchtitan_source import read_torchtitan
from tessera.topology.validation import quoted

TORCHTITAN_VERSION = "0.3.0"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble"}
"""Tessera schedule -> torchtitan ``pipeline_parallel_schedule`` (the torch.distributed.pipelining class names)."""
AC_CONFIG = {"full": "FullAC.Config()", "selective": "SelectiveAC.Config()", "none": "None"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}
DEFAULTS = {
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1, "enable_sequence_parallel": True,
                    "pipeline_parallel_degree": 1, "pipeline_parallel_schedule": "1F1B",
                    "pipeline_parallel_microbatch_size": 1, "module_fqns_per_model_part": None,
                    "context_parallel_degree": 1, "expert_parallel_degree": 1,
                    "pipeline_parallel_layers_per_stage": None, "pipeline_parallel_first_stage_less_layers": 1,
                    "pipeline_parallel_last_stage_less_layers": 1},
    "training": {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "mixed_precision_param": "bfloat16",
                 "dtype": "float32", "enable_cpu_offload": False},
    "compile": {"enable": False, "enable_async_tensor_parallel": False, "components": ["model", "loss"]},
}
"""torchtitan 0.3.0's defaults of the fields Tessera reads (``ParallelismConfig``, ``TrainingConfig``, ``CompileConfig``)."""
FP8_CONVERTERS = {"Float8LinearConverter": "rowwise", "MXFP8LinearConverter": "mx"}
"""torchtitan 0.3's FP8 converters (``torchtitan.components.quantization``) -> the scaling they train with
(``Float8LinearConverter.Config.recipe_name``: rowwise, or rowwise with bf16 weight gradients)."""
BLOCK_FQN = re.compile(r".*\.\d+")
"""A repeated block in ``module_fqns_per_model_part``: a child of a module list (``layers.3``)."""


# ----------------------------------------------------------------------------------------- export


def to_torchtitan(plan: PlanLike) -> FrameworkExport:
    """The plan as a torchtitan ``Trainer.Config`` edit (Python), a comment for every difference."""
    s, t = plan.strategy, plan.training
    notes: list[str] = []
    update = _sharding(s, notes)
    policy = _policy(plan, notes)
    precision = t.precision
    if precision == "fp16":
        notes.append("fp16: torchtitan's mixed precision is bfloat16 or float32; nearest is bfloat16 (Tessera's "
                     "estimate is the same for both 16-bit types)")
        precision = "bf16"
    elif precision == "fp8":
        notes.append("fp8: torchtitan sets FP8 in the model (a Float8LinearConverter / MXFP8LinearConverter in "
                     "model_spec's converters); add it there, these fields keep bfloat16 mixed precision")
        precision = "bf16"
    fields = _parallelism_fields(plan, zero=update["zero"])
    update |= without_named_pieces(s, "torchtitan", notes)
    local = t.global_batch // (s.dp * s.pipeline_passes)  # under pipelining, one schedule's micro-batches
    training = {"local_batch_size": local if s.pp > 1 else s.micro_batch,
                "global_batch_size": t.global_batch, "seq_len": t.seq_len, "mixed_precision_param": PRECISION[precision]}
    lines = [f"    config.parallelism.{k} = {v!r}" for k, v in fields.items() if k != "module_fqns_per_model_part"]
    if "module_fqns_per_model_part" in fields:
        parts = "".join(f"        {part!r},\n" for part in fields["module_fqns_per_model_part"])
        lines.append(f"    config.parallelism.module_fqns_per_model_part = [\n{parts}    ]")
    lines += [f"    config.training.{k} = {v!r}" for k, v in training.items()]
    if s.tp_overlap:
        lines += ["    config.compile.enable = True", "    config.compile.enable_async_tensor_parallel = True"]
    lines.append(f"    config.activation_checkpoint = {AC_CONFIG[policy]}")
    ac_import = {"full": "FullAC", "selective": "SelectiveAC"}.get(policy)
    text = "\n".join([
        f"# torchtitan {TORCHTITAN_VERSION} configuration for {plan.model_name} on {plan.cluster}: {s.to_string()}",
        "# Call apply_tessera_plan(config) on the Trainer.Config your config_registry function returns: it sets only",
        "# the fields Tessera decided. Pipeline chunks name the planned model's modules.",
        *(f"# {note}" for note in notes),
        *([f"from torchtitan.distributed.activation_checkpoint import {ac_import}", ""] if ac_import else []),
        "", "def apply_tessera_plan(config):", *lines, "    return config", "",
    ])
    if s.sp and s.sp_regather:
        notes.append("sp_regather: torchtitan's sequence parallelism (DTensor) keeps the gathered input, as Tessera's "
                     "runtime does; the strategy it runs has sp_regather off")
    runs = strategy_with(s, sp_regather=False, **update, **_policy_update(plan, policy), **_experts(s, notes))
    return FrameworkExport(framework="torchtitan", text=text, strategy=runs, notes=tuple(notes),
                           variant=TORCHTITAN_COMPILED.name if s.tp_overlap else None)  # compile's components: the loss too


def _sharding(s: Strategy, notes: list[str]) -> dict[str, object]:
    """The ZeRO stage torchtitan runs for ``s`` (see the module docstring), with a note where it differs; every
    block reshards alike."""
    zero = _reshard_mix(s, notes)
    if s.dp * s.cp == 1:
        if zero:
            notes.append(f"zero={zero} on one data-parallel rank: nothing to shard; torchtitan runs it unsharded")
        return {"zero": 0, "block_reshard": ()}
    if s.cp > 1 and zero < 3:
        notes.append(f"zero={zero} with cp={s.cp}: torchtitan shards parameters over dp x cp (FSDP); nearest is ZeRO-3")
        zero = 3
    elif s.ep > 1 and zero == 0:
        notes.append("zero=0 with expert parallelism: torchtitan's experts borrow FSDP ranks; nearest is ZeRO-3")
        zero = 3
    elif zero == 1:
        notes.append("zero=1: torchtitan has no ZeRO-1; nearest is FSDP without resharding after the forward (ZeRO-2)")
        zero = 2
    return {"zero": zero, "block_reshard": ()}


def _reshard_mix(s: Strategy, notes: list[str]) -> int:
    """The ZeRO stage of ``s`` without its per-block resharding: ZeRO-2 where every block keeps its weights."""
    kept, blocks = kept_blocks(s), len(s.block_reshard)
    if not kept:
        return s.zero
    nearest = "every block kept (ZeRO-2)" if kept == blocks else "every block resharding"
    notes.append(f"block_reshard keeps {kept} of {blocks} blocks gathered to their backward: torchtitan's "
                 f"fsdp_reshard_after_forward is one setting for every block; nearest is {nearest}")
    return 2 if kept == blocks else s.zero


def _experts(s: Strategy, notes: list[str]) -> dict[str, object]:
    """The experts' tensor-parallel degree torchtitan runs: 1 with expert parallelism (see the module docstring)."""
    if s.ep == 1 or s.tp == 1:
        return {}
    if s.expert_tp != 1:
        notes.append(f"etp={s.expert_tp}: torchtitan shards routed experts over efsdp x ep, taking the tensor-parallel "
                     "ranks too; the experts run with etp=1")
    return {"etp": 1}


def _parallelism_fields(plan: PlanLike, *, zero: int) -> dict[str, object]:
    s = plan.strategy
    fields: dict[str, object] = {
        "data_parallel_replicate_degree": s.dp if zero == 0 else 1,
        "data_parallel_shard_degree": s.dp if zero else 1,
        "fsdp_reshard_after_forward": "never" if zero == 2 else "default",
        "tensor_parallel_degree": s.tp, "enable_sequence_parallel": s.sp and s.tp > 1,
        "pipeline_parallel_degree": s.pp, "context_parallel_degree": s.cp, "expert_parallel_degree": s.ep,
    }
    if s.pp > 1:
        fields["pipeline_parallel_schedule"] = SCHEDULES[s.schedule]
        fields["pipeline_parallel_microbatch_size"] = s.micro_batch
        chunks = max(layer.chunk for layer in plan.layers) + 1
        fields["module_fqns_per_model_part"] = [
            [layer.fqn for layer in plan.layers if layer.chunk == c and layer.kind != "loss"] for c in range(chunks)]
    return fields


def _policy(plan: PlanLike, notes: list[str]) -> str:
    policies = [offload_as_full(p) for p in block_policies(plan)]
    policy = uniform_policy(policies) or offload_as_full(plan.strategy.recompute)
    if "offload" in block_policies(plan) or plan.strategy.recompute == "offload":
        notes.append(f"offload on {block_policies(plan).count('offload') or 'every'} blocks: torchtitan has no activation "
                     "offload; nearest is full recomputation of those blocks")
    if uniform_policy(policies) is None and policies:
        policy = "full" if "full" in policies else "selective"
        counts = ", ".join(f"{p} on {policies.count(p)}" for p in ("full", "selective", "none") if p in policies)
        notes.append(f"recompute per block ({counts} blocks): torchtitan applies one policy to every block; nearest "
                     f"is {policy} on every block")
    if policy == "selective":
        notes.append("SelectiveAC is torchtitan's per-op policy (saves compute-intensive ops except every second "
                     "matmul, which it re-runs with the elementwise work); the plan priced selective as Tessera's "
                     "runtime runs it (the attention core recomputed): expect more recompute time and fewer saved "
                     "activations (tessera evaluate --from-torchtitan prices this config as torchtitan runs it)")
    return policy


def _policy_update(plan: PlanLike, policy: str) -> dict[str, object]:
    return {"recompute": policy, "block_recompute": ()} if uniform_policy(block_policies(plan)) != policy else {}


# ----------------------------------------------------------------------------------------- import


def from_torchtitan(source: str, *, world_size: int) -> ImportedConfig:
    """Read a torchtitan configuration (``FILE.py[:function]``, ``FILE.json``, ``FILE.toml``; nothing in it runs) for
    a run on ``world_size`` devices. A bad value raises one ``ConfigError`` naming the field."""
    sections, unread = read_torchtitan(source)
    fields = {name: DEFAULTS[name] | dict(sections.get(name) or {}) for name in DEFAULTS}
    unread += [f"{name}.{key}={value!r}" for name in DEFAULTS for key, value in (sections.get(name) or {}).items()
               if key not in DEFAULTS[name]]
    par, train = fields["parallelism"], fields["training"]
    notes: list[str] = []
    tp, pp, cp, ep = (_degree(par, key) for key in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                                    "context_parallel_degree", "expert_parallel_degree"))
    replicate, shard = _data_parallel(par, world_size=world_size, inner=tp * pp * cp)
    dp = replicate * shard
    _refuse_unmodelled(train, par, fields["compile"], dp=dp, tp=tp, ep=ep)
    local = whole(train["local_batch_size"], name="training.local_batch_size", framework="torchtitan",
                  at_most=MAX_GLOBAL_BATCH)
    global_batch = train["global_batch_size"]
    global_batch = local * dp if global_batch == -1 else whole(global_batch, name="training.global_batch_size",
                                                               framework="torchtitan", at_most=MAX_GLOBAL_BATCH)
    schedule, virtual, chunks, micro_batch = _pipeline(par, pp=pp, local=local, notes=notes)
    # Gradient accumulation under pipelining runs one schedule per local batch, each filling and draining the pipeline
    passes = global_batch // (local * dp) if pp > 1 else 1
    if replicate > 1 and shard > 1:
        notes.append(f"HSDP ({replicate} replicas x {shard} shards): evaluated as ZeRO-3 over all {dp} ranks")
    policy = _read_policy(sections.get("activation_checkpoint", "selective"))
    strategy = Strategy(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=_zero(par, shard=shard, cp=cp), micro_batch=micro_batch or local,
        recompute=policy, sp=bool(par["enable_sequence_parallel"]) and tp > 1,
        tp_overlap=bool(fields["compile"]["enable_async_tensor_parallel"]) and tp > 1, schedule=schedule,
        virtual_stages=virtual, chunk_blocks=chunks, etp=1 if ep > 1 and tp > 1 else None, pipeline_passes=passes,
    )
    precision = {"bfloat16": "bf16", "float32": "fp32"}.get(train["mixed_precision_param"])
    if precision is None:
        raise ConfigError(f"bad torchtitan setting training.mixed_precision_param {quoted(train['mixed_precision_param'])}"
                          ": use bfloat16 or float32")
    fp8_scaling = _fp8_scaling(sections.get("converters") or [], unread=unread, notes=notes)
    seq_len = whole(train["seq_len"], name="training.seq_len", framework="torchtitan", at_most=MAX_SEQ_LEN)
    return ImportedConfig(framework="torchtitan", strategy=canonical(strategy), global_batch=global_batch,
                          variant=TORCHTITAN_COMPILED.name if _compiles_loss(fields["compile"]) else None,
                          seq_len=seq_len, precision="fp8" if fp8_scaling else precision, fp8_scaling=fp8_scaling,
                          unread=tuple(unread), notes=tuple(notes))


def _fp8_scaling(converters: list[dict], *, unread: list[str], notes: list[str]) -> str | None:
    """The FP8 scaling the model spec's converters train the linears with (torchtitan 0.3's
    ``Float8LinearConverter``: rowwise, ``MXFP8LinearConverter``: MX), or None; NVFP4 is refused, converters
    Tessera does not price are listed."""
    scaling = None
    for converter in converters:
        name = converter["class"]
        if name == "NVFP4LinearConverter":
            raise NotModelledError("model_spec converter NVFP4LinearConverter: Tessera prices FP8 (rowwise, MXFP8) but "
                                   "not NVFP4; evaluate the run's FP8 or bf16 counterpart")
        if name not in FP8_CONVERTERS:
            unread.append(f"model_spec converter {name}")
            continue
        if converter.get("emulate"):
            notes.append(f"{name} with emulate=True runs FP8 in emulation (a test mode): priced as the bf16 run")
            continue
        scaling = _recipe_scaling(name, converter.get("recipe_name"), notes=notes)
        if converter.get("fqns") or converter.get("filter_fqns"):
            notes.append(f"{name} converts only some linears (fqns / filter_fqns): priced as if every block linear "
                         "ran in FP8")
    return scaling


def _recipe_scaling(name: str, recipe: object, *, notes: list[str]) -> str:
    """The scaling of ``name``'s ``recipe_name`` (torchao's recipes for ``Float8LinearConverter``; MXFP8 has one)."""
    if name == "MXFP8LinearConverter" or recipe in (None, "rowwise"):
        return FP8_CONVERTERS[name]
    if recipe == "rowwise_with_gw_hp":
        notes.append(f"{name} recipe rowwise_with_gw_hp keeps the weight gradients' matmul in bf16: priced as rowwise "
                     "throughout")
        return "rowwise"
    if recipe == "tensorwise":
        return "current"
    raise ConfigError(f"torchtitan {name} recipe_name {quoted(recipe)}: Tessera reads rowwise, rowwise_with_gw_hp or "
                      "tensorwise")


def _compiles_loss(compile_: dict) -> bool:
    """Whether torchtitan compiles the loss (``BaseLoss._maybe_compile``: ``compile.enable`` and ``loss`` among
    ``compile.components``), which the cost model prices as one fused kernel."""
    components = compile_["components"]
    if not isinstance(components, list) or not all(isinstance(name, str) for name in components):
        raise ConfigError(f"bad torchtitan setting compile.components {quoted(components)}: use a list of names such "
                          "as [\"model\", \"loss\"]")
    return bool(compile_["enable"]) and "loss" in components


def _degree(par: dict, key: str) -> int:
    return whole(par[key], name=f"parallelism.{key}", framework="torchtitan")


def _data_parallel(par: dict, *, world_size: int, inner: int) -> tuple[int, int]:
    """(replicate, shard) degrees; a shard degree of -1 takes the ranks left over, as ``ParallelDims`` does."""
    replicate = _degree(par, "data_parallel_replicate_degree")
    shard = par["data_parallel_shard_degree"]
    if shard == -1:
        shard = world_size // (replicate * inner) if world_size % (replicate * inner) == 0 else world_size
    shard = whole(shard, name="parallelism.data_parallel_shard_degree", framework="torchtitan")
    if replicate * shard * inner != world_size:
        raise ConfigError(f"torchtitan: dp_replicate {replicate} x dp_shard {shard} x (cp x tp x pp = {inner}) = "
                          f"{replicate * shard * inner} ranks, not the cluster's {world_size} devices (ParallelDims "
                          "refuses it); fix the degrees or --cluster")
    return replicate, shard


def _refuse_unmodelled(train: dict, par: dict, compile_: dict, *, dp: int, tp: int, ep: int) -> None:
    if train["enable_cpu_offload"]:
        raise NotModelledError("training.enable_cpu_offload: Tessera's cost model has no CPU offload; set it False "
                               "to evaluate the GPU-resident run")
    if train["dtype"] != "float32":
        raise NotModelledError(f"training.dtype {quoted(train['dtype'])}: Tessera models mixed precision with fp32 "
                               "master weights; set training.dtype float32")
    if (dp * tp) % ep:
        raise NotModelledError(f"parallelism.expert_parallel_degree {ep} does not divide data-parallel x tensor-parallel "
                               f"degrees {dp} x {tp}: torchtitan may borrow context-parallel ranks for experts, Tessera "
                               "folds ep into dp x tp only")
    if compile_["enable_async_tensor_parallel"] and not compile_["enable"]:
        raise ConfigError("torchtitan: compile.enable_async_tensor_parallel needs compile.enable (torchtitan refuses it)")


def _pipeline(par: dict, *, pp: int, local: int, notes: list[str]) -> tuple[str, int, tuple[int, ...], int | None]:
    """(schedule, chunks per rank, blocks per chunk, micro-batch) of the pipeline fields."""
    if pp == 1:
        return "1f1b", 1, (), None
    names = {v: k for k, v in SCHEDULES.items()}
    name = par["pipeline_parallel_schedule"]
    if name not in names:
        raise NotModelledError(f"parallelism.pipeline_parallel_schedule {quoted(name)}: Tessera models "
                               f"{', '.join(names)}; pick one of them")
    micro = whole(par["pipeline_parallel_microbatch_size"], name="parallelism.pipeline_parallel_microbatch_size",
                  framework="torchtitan", at_most=MAX_GLOBAL_BATCH)
    if local % micro:
        raise ConfigError(f"torchtitan: training.local_batch_size {local} is not divisible by "
                          f"parallelism.pipeline_parallel_microbatch_size {micro} (Trainer.Config refuses it)")
    parts = par["module_fqns_per_model_part"]
    if parts is None:
        if names[name] == "interleaved":
            raise ConfigError("torchtitan: Interleaved1F1B without module_fqns_per_model_part; Tessera reads the chunks "
                              "from it (the layer count is in the model, not the config)")
        split = ("pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
                 "pipeline_parallel_last_stage_less_layers")
        given = ", ".join(f"{key}={par[key]!r}" for key in split)
        notes.append(f"no module_fqns_per_model_part: torchtitan splits the model's layers by {given} (the layer "
                     "count is in the model, not the config); evaluated with Tessera's even split of the blocks")
        return names[name], 1, (), micro
    counts = _part_blocks(parts, pp=pp)
    virtual = len(counts) // pp
    if names[name] != "interleaved" and virtual > 1:
        raise NotModelledError(f"{name} with {virtual} chunks per rank: Tessera models several chunks per rank "
                               "with Interleaved1F1B only")
    return names[name], virtual, tuple(counts) if len(set(counts)) > 1 else (), micro


def _part_blocks(parts: object, *, pp: int) -> list[int]:
    if not isinstance(parts, list) or not all(isinstance(p, list) and all(isinstance(f, str) for f in p) for p in parts):
        raise ConfigError(f"bad torchtitan setting parallelism.module_fqns_per_model_part {quoted(parts)}: expected a "
                          "list of lists of module names")
    if not parts or len(parts) % pp:
        raise ConfigError(f"parallelism.module_fqns_per_model_part has {len(parts)} parts, not a multiple of "
                          f"pipeline_parallel_degree {pp}; give pp x chunks-per-rank parts")
    return [sum(bool(BLOCK_FQN.fullmatch(fqn)) for fqn in part) for part in parts]


def _zero(par: dict, *, shard: int, cp: int) -> int:
    reshard = par["fsdp_reshard_after_forward"]
    if reshard not in ("default", "always", "never"):
        raise ConfigError(f"bad torchtitan setting parallelism.fsdp_reshard_after_forward {quoted(reshard)}: use "
                          "default, always or never")
    if shard * cp == 1:
        return 0
    return 2 if reshard == "never" else 3


def _read_policy(policy: object) -> str:
    if policy == "memory-budget":
        raise NotModelledError("activation_checkpoint MemoryBudgetAC: Tessera models none, selective and full "
                               "recomputation; use FullAC or SelectiveAC")
    return str(policy)

