"""A plan as a DeepSpeed JSON config, and a DeepSpeed config read back into a ``Strategy``.

A DeepSpeed config holds data parallelism and ZeRO (``zero_optimization.stage``), the batch split
(``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world``) and the precision
(``bf16`` / ``fp16``). Tensor, pipeline, context and expert parallelism live in the model code (Megatron-DeepSpeed,
``PipelineModule``, AutoTP), so a plan using them is refused with the export that can run it. Recomputation, too,
is switched on in the model code (``model.gradient_checkpointing_enable()``, ``deepspeed.checkpointing.checkpoint``
per block); the config's ``activation_checkpointing`` section, written for a plan that recomputes, tunes it and
tells the reader the run recomputes every block. DeepSpeed's ``cpu_checkpointing`` moves the checkpoints of
recomputed blocks to the host, which is not Tessera's offload (saved tensors on the host, nothing recomputed): an
offloaded block is rendered as full recomputation. ZeRO-3 keeps parameters gathered by size
(``stage3_param_persistence_threshold``), not per block: a per-block reshard mix (``block_reshard``) is rendered as
every block resharding. JSON has no comments: the notes are ``FrameworkExport.notes``.
Key names are DeepSpeed's (docs: deepspeed.ai/docs/config-json).
"""

from __future__ import annotations

import json

from tessera.cost_models.types import MAX_GLOBAL_BATCH, Strategy
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.frameworks.common import (
    FrameworkExport, ImportedConfig, PlanLike, block_policies, kept_blocks, read_config_file, strategy_with,
    uniform_policy, whole, without_named_pieces,
)
from tessera.topology.validation import quoted, short

READ_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
             "bf16", "fp16", "activation_checkpointing", "tensor_parallel")
"""The top-level keys Tessera reads; every other key is listed as not read."""
ACTIVATION_CHECKPOINTING = {"partition_activations": False, "contiguous_memory_optimization": False,
                            "cpu_checkpointing": False}


def to_deepspeed(plan: PlanLike) -> FrameworkExport:
    """The plan as a DeepSpeed config (JSON text); a plan with tp, pp, cp or ep raises ``ConfigError``."""
    s, t = plan.strategy, plan.training
    split = {axis: getattr(s, axis) for axis in ("tp", "pp", "cp", "ep") if getattr(s, axis) > 1}
    if split:
        axes = ", ".join(f"{axis}={degree}" for axis, degree in split.items())
        raise ConfigError(f"a DeepSpeed config runs data parallelism and ZeRO only; this plan uses {axes} (model code "
                          "in DeepSpeed): export it with --format megatron or torchtitan, or plan a ZeRO-only strategy "
                          "with --fix tp=1,pp=1,cp=1,ep=1")
    notes: list[str] = []
    policies = block_policies(plan)
    policy = uniform_policy(policies) or ("none" if not policies else "mixed")
    config: dict[str, object] = {
        "train_batch_size": t.global_batch, "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.gradient_accumulation(t.global_batch), "zero_optimization": {"stage": s.zero},
    }
    if t.precision != "fp32":
        config["fp16" if t.precision == "fp16" else "bf16"] = {"enabled": True}
    if t.precision == "fp8":
        notes.append("fp8: a DeepSpeed config has no FP8 setting (Transformer Engine linears in the model code do "
                     "it); the config runs bf16 mixed precision around them")
    update: dict[str, object] = without_named_pieces(s, "deepspeed", notes)
    if kept_blocks(s):
        notes.append(f"block_reshard keeps {kept_blocks(s)} blocks gathered to their backward: DeepSpeed ZeRO-3 keeps "
                     "parameters by size (stage3_param_persistence_threshold), not per block; nearest is every block "
                     "resharding")
        update["block_reshard"] = ()
    if policy != "none":
        config["activation_checkpointing"] = dict(ACTIVATION_CHECKPOINTING)
        notes.append("recompute: enable activation checkpointing of every block in the model code (e.g. "
                     "model.gradient_checkpointing_enable()); the activation_checkpointing section only tunes it")
        if policy != "full":
            offload = (" and has no offload without recomputation (cpu_checkpointing moves a recomputed block's "
                       "checkpoint to the host)") if "offload" in (*policies, s.recompute) else ""
            notes.append(f"recompute {policy}: DeepSpeed checkpoints whole blocks{offload}; nearest is full on every block")
            update |= {"recompute": "full", "block_recompute": ()}
    return FrameworkExport(framework="deepspeed", text=json.dumps(config, indent=2), strategy=strategy_with(s, **update),
                           notes=tuple(notes))


def from_deepspeed(path: str, *, world_size: int) -> ImportedConfig:
    """Read a DeepSpeed JSON config for a run of ``world_size`` data-parallel ranks. A bad value raises one
    ``ConfigError`` naming the key; offloading or tensor parallelism, ``NotModelledError``."""
    config = _load(path)
    _refuse_unmodelled(config)
    zero = _zero_stage(config.get("zero_optimization", {}))
    micro, _, global_batch = _batch(config, world_size=world_size)
    precision = "bf16" if _enabled(config, "bf16") else "fp16" if _enabled(config, "fp16") else "fp32"
    recompute = "full" if config.get("activation_checkpointing") is not None else "none"
    strategy = Strategy(dp=world_size, zero=zero if world_size > 1 else 0, micro_batch=micro, recompute=recompute)
    unread = [f"{key}={short(json.dumps(value), limit=60)}" for key, value in config.items() if key not in READ_KEYS]
    unread += [f"zero_optimization.{key}" for key in config.get("zero_optimization", {}) if key != "stage"]
    notes = ["ZeRO-3 is priced as DeepSpeed ran it in SC'21's runs (cost_models.profiles.DEEPSPEED: parameter by "
             "parameter within its 2021 default limits, its collectives 5x the ring's time as fitted there); this "
             "config's zero_optimization settings are listed, not read"] if strategy.zero == 3 else []
    return ImportedConfig(framework="deepspeed", strategy=strategy, global_batch=global_batch, precision=precision,
                          unread=tuple(unread), notes=tuple(notes))


def _load(path: str) -> dict:
    text = read_config_file(path, framework="deepspeed")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON ({short(str(exc), limit=100)})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config {path} holds {type(config).__name__}, not an object of settings")
    return config


def _refuse_unmodelled(config: dict) -> None:
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"bad DeepSpeed setting zero_optimization {quoted(zero)}: expected an object")
    for key in ("offload_optimizer", "offload_param"):
        device = zero.get(key, {}).get("device", "none") if isinstance(zero.get(key), dict) else "none"
        if device not in ("none", None):
            raise NotModelledError(f"zero_optimization.{key} to {quoted(device)}: Tessera's cost model has no "
                                   "offloading; remove it to evaluate the GPU-resident run")
    tensor = config.get("tensor_parallel")
    if isinstance(tensor, dict) and tensor.get("autotp_size", 1) not in (0, 1):
        raise NotModelledError(f"tensor_parallel.autotp_size {quoted(tensor.get('autotp_size'))}: Tessera reads "
                               "DeepSpeed's ZeRO data parallelism only; evaluate with --strategy tp=N instead")
    checkpointing = config.get("activation_checkpointing")
    if isinstance(checkpointing, dict) and checkpointing.get("cpu_checkpointing"):
        raise NotModelledError("activation_checkpointing.cpu_checkpointing (recomputed blocks' checkpoints on the "
                               "host): Tessera models recomputation with device checkpoints, or offload without "
                               "recomputation; set it false")


def _zero_stage(zero: dict) -> int:
    stage = zero.get("stage", 0)
    return whole(stage, name="zero_optimization.stage", framework="deepspeed", at_least=0, at_most=3)


def _batch(config: dict, *, world_size: int) -> tuple[int, int | None, int | None]:
    """(micro-batch, accumulation steps, global batch): DeepSpeed's rule ``train = micro x accumulation x world``,
    any two of them giving the third (``"auto"`` counts as not given)."""
    values = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.get(key)
        if value is not None and value != "auto":
            values[key] = whole(value, name=key, framework="deepspeed", at_most=MAX_GLOBAL_BATCH)
    train, micro, steps = (values.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                    "gradient_accumulation_steps"))
    if micro is None and train is not None:
        micro = train // ((steps or 1) * world_size) or None
    if micro is None:
        raise ConfigError("DeepSpeed config: give train_micro_batch_size_per_gpu (or train_batch_size with "
                          "gradient_accumulation_steps)")
    steps = steps or (train // (micro * world_size) if train else None)
    if train is not None and train != micro * (steps or 0) * world_size:
        raise ConfigError(f"DeepSpeed config: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {steps} x {world_size} devices (DeepSpeed refuses it); fix one")
    return micro, steps, train if train is not None else (micro * steps * world_size if steps else None)


def _enabled(config: dict, key: str) -> bool:
    section = config.get(key)
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConfigError(f"bad DeepSpeed setting {key} {quoted(section)}: expected an object such as {{\"enabled\": true}}")
    return section.get("enabled") is True
