"""What every framework renderer and reader shares: the export and import records, the plan facts a renderer reads
(blocks per chunk, recomputation per block), the canonical form two strategies are compared in, and the checks
an imported value passes where it enters.

The renderers read a plan only through :class:`PlanLike` (its strategy, training and per-layer decisions), so
this package never imports ``tessera.planner.plan``: the plan stays data and may delegate to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from tessera.cost_models.types import MAX_BLOCKS, Strategy, TrainingConfig
from tessera.errors import ConfigError
from tessera.files import read_bounded
from tessera.topology.validation import MAX_DEVICES, quoted

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
"""The frameworks Tessera exports a plan to and reads a configuration from."""
FRAMEWORK_NAMES = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "deepspeed": "DeepSpeed"}
PROFILE_NAMES = {"megatron": "megatron", "torchtitan": "torchtitan", "deepspeed": "deepspeed"}
"""Framework -> its implementation profile in ``cost_models.profiles.PROFILES`` (what the framework does
differently with the same strategy: DeepSpeed ZeRO-3's gathers, Transformer Engine's FP8 memory)."""
MAX_CONFIG_BYTES = 4 * 2**20
"""Largest configuration file read (4 MiB; a torchtitan config_registry or a DeepSpeed JSON is a few KiB)."""


class LayerLike(Protocol):
    """What a renderer reads of one planned layer (``PlannedLayer``)."""

    fqn: str
    kind: str
    recompute: str
    chunk: int


class PlanLike(Protocol):
    """What a renderer reads of a plan (``tessera.planner.plan.Plan``)."""

    model_name: str
    cluster: str
    training: TrainingConfig
    strategy: Strategy
    layers: Sequence[LayerLike]


class _FrameworkRecord(BaseModel):
    """What an export and an import share: the framework, and the implementation profile its run is priced with."""

    model_config = FROZEN

    framework: str
    """``megatron``, ``torchtitan`` or ``deepspeed``."""
    variant: str | None = None
    """The framework's profile as this configuration runs it, where it differs from the framework's default (a
    torchtitan configuration that turns on compile, and so compiles its loss: ``torchtitan-compiled``)."""

    @property
    def profile(self) -> str:
        """The framework's implementation profile (``cost_models.profiles.PROFILES``) to estimate ``strategy`` with."""
        return self.variant or PROFILE_NAMES[self.framework]


class FrameworkExport(_FrameworkRecord):
    """A plan rendered for one framework, and what the framework will run."""

    text: str
    """The configuration, with a comment for every choice the framework cannot express exactly."""
    strategy: Strategy
    """The strategy the framework runs with this configuration: the plan's, or the nearest one it can express,
    with the framework's implementation behaviours (e.g. Megatron-LM's sequence-parallel memory)."""
    notes: tuple[str, ...] = ()
    """Every difference between the plan and what the framework runs, in words (the comments of ``text``)."""

    def differs_from(self, planned: Strategy) -> bool:
        """Whether the framework runs something other than ``planned`` (then Tessera evaluates ``strategy`` too)."""
        return canonical(self.strategy) != canonical(planned)


class ImportedConfig(_FrameworkRecord):
    """A framework's configuration read into Tessera's terms."""

    strategy: Strategy
    """The strategy the configuration runs, with the framework's implementation behaviours."""
    global_batch: int | None = None
    """Sequences per step the configuration states (None when it leaves it to the launch)."""
    seq_len: int | None = None
    """Tokens per sequence the configuration states."""
    precision: str | None = None
    """``bf16``/``fp16``/``fp32``/``fp8`` as the configuration states it."""
    fp8_scaling: str | None = None
    """Under FP8, the scaling recipe the configuration states (``TrainingConfig.fp8_scaling``)."""
    unread: tuple[str, ...] = ()
    """Flags or fields Tessera does not read (listed so nothing is silently ignored)."""
    notes: tuple[str, ...] = ()
    """Where the configuration was evaluated as the nearest thing the cost model has, in words."""
    layers: int | None = None
    """Transformer blocks the configuration states (Megatron-LM's ``--num-layers``), checked against the model."""
    mtp_layers: int = 0
    """Multi-token-prediction modules the configuration trains after the blocks (``planner.layer_graph.with_mtp_modules``;
    the strategy's ``chunk_blocks`` count them in the last chunk)."""


def pin_string(strategy: Strategy) -> str:
    """``strategy`` as a strategy string that pins every field (``Strategy.to_string`` leaves degrees of 1 and false
    flags out, which as pins the planner would fill): what evaluating a framework's configuration must pin."""
    s = strategy
    schedule = f"{s.schedule}:{s.virtual_stages}" if s.schedule == "interleaved" else s.schedule
    explicit = {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep, "sp": s.sp, "tp_overlap": s.tp_overlap,
                "sp_regather": s.sp_regather, "schedule": schedule}
    items = dict(item.split("=", 1) for item in s.to_string().split(","))
    merged = items | {key: str(value).lower() for key, value in explicit.items()}
    order = ("dp", "tp", "pp", "cp", "ep", "etp", "zero", "mbs", "recompute", "sp", "tp_overlap", "sp_regather",
             "block_recompute", "block_reshard", "chunk_blocks", "schedule", "pipeline_passes", "recompute_modules")
    return ",".join(f"{key}={merged[key]}" for key in order if key in merged)


def canonical(strategy: Strategy) -> Strategy:
    """``strategy`` in one form per meaning: a per-block recomputation that is one policy everywhere becomes that
    policy, every block resharding is the default, an expert tensor-parallel degree equal to ``tp`` is the default,
    an even chunk split becomes the default, fields pipelining ignores at ``pp == 1`` take their defaults, and
    sequence-parallel settings are dropped without tensor parallelism."""
    update: dict[str, object] = {}
    blocks = strategy.block_recompute
    if blocks and len(set(blocks)) == 1:
        update |= {"recompute": blocks[0], "block_recompute": ()}
    if all(strategy.block_reshard):
        update["block_reshard"] = ()
    if strategy.etp == strategy.tp:
        update["etp"] = None
    if strategy.chunk_blocks and len(set(strategy.chunk_blocks)) == 1:
        update["chunk_blocks"] = ()
    if strategy.pp == 1:
        update |= {"schedule": "1f1b", "virtual_stages": 1, "chunk_blocks": ()}
    if strategy.tp == 1:
        update |= {"sp": False, "sp_regather": False, "tp_overlap": False}
    elif not strategy.sp:
        update["sp_regather"] = False
    return strategy.model_copy(update=update)


def chunk_block_counts(plan: PlanLike) -> list[int]:
    """Blocks in each pipeline chunk of ``plan``, in chunk order (from the per-layer decisions)."""
    chunks = max((layer.chunk for layer in plan.layers), default=0) + 1
    counts = [0] * chunks
    for layer in plan.layers:
        if layer.kind == "block":
            counts[layer.chunk] += 1
    return counts


def block_policies(plan: PlanLike) -> list[str]:
    """The recomputation of each block of ``plan`` in model order."""
    return [layer.recompute for layer in plan.layers if layer.kind == "block"]


def chunk_policies(plan: PlanLike) -> list[list[str]]:
    """The recomputation of each block, grouped by pipeline chunk."""
    chunks: list[list[str]] = [[] for _ in chunk_block_counts(plan)]
    for layer in plan.layers:
        if layer.kind == "block":
            chunks[layer.chunk].append(layer.recompute)
    return chunks


def kept_blocks(strategy: Strategy) -> int:
    """Blocks that keep their gathered weights from the forward to the backward (``block_reshard`` False)."""
    return sum(not flag for flag in strategy.block_reshard)


def offload_as_full(policy: str) -> str:
    """A framework without activation offload: the nearest policy that also keeps a block's activations off the
    device is full recomputation."""
    return "full" if policy == "offload" else policy


def uniform_policy(policies: Sequence[str]) -> str | None:
    """The one policy every block has, or None for a mix."""
    return policies[0] if policies and len(set(policies)) == 1 else None


def without_named_pieces(s: Strategy, framework: str, notes: list[str]) -> dict[str, object]:
    """The strategy change, with a note, for a framework that recomputes no named pieces of a block
    (``Strategy.recompute_modules``, Megatron-Core's ``--recompute-modules``)."""
    if not s.recompute_modules:
        return {}
    notes.append(f"recompute_modules {'/'.join(s.recompute_modules)}: {FRAMEWORK_NAMES[framework]} recomputes no "
                 "named pieces of a block (Megatron-Core's --recompute-modules); nearest is keeping them")
    return {"recompute_modules": ()}


def strategy_with(base: Strategy, **update: object) -> Strategy:
    """``base`` with ``update`` applied and validated (a ``model_copy`` would skip the checks)."""
    return Strategy.model_validate(base.model_dump() | update)


def whole(value: object, *, name: str, framework: str, at_least: int = 1, at_most: int = MAX_DEVICES) -> int:
    """An imported integer setting in ``[at_least, at_most]``, else one ``ConfigError`` naming it and the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= at_most:
        raise ConfigError(f"bad {FRAMEWORK_NAMES[framework]} setting {name} {quoted(value)}: expected a whole number "
                          f"from {at_least:,} to {at_most:,}; fix that value")
    return value


def data_parallel(world_size: int, *, inner: int, framework: str, inner_names: str) -> int:
    """The data-parallel degree a framework derives: the ranks left over by its model-parallel axes."""
    if world_size % inner:
        raise ConfigError(f"{FRAMEWORK_NAMES[framework]}: {inner_names} = {inner} does not divide the cluster's "
                          f"{world_size} devices; pick degrees whose product divides it (or another --cluster)")
    return world_size // inner


def expand_recompute(chunk_sizes: Sequence[int], first_full: int) -> tuple[str, ...]:
    """Per-block recomputation of a layout where the first ``first_full`` blocks of every chunk are recomputed
    in full and the rest are not (Megatron-LM's ``block`` method)."""
    if sum(chunk_sizes) > MAX_BLOCKS:
        raise ConfigError(f"more than {MAX_BLOCKS:,} layers; check the layer count")
    return tuple("full" if i < first_full else "none" for size in chunk_sizes for i in range(size))


def read_config_file(path: str, *, framework: str) -> str:
    """The text of a configuration file (UTF-8, at most ``MAX_CONFIG_BYTES``), or one ``ConfigError`` line."""
    from pathlib import Path

    name = FRAMEWORK_NAMES[framework]
    target = Path(path)
    try:
        if not target.is_file():
            raise ConfigError(f"{name} config {path} is not a file; give the path of the configuration to read")
        return read_bounded(target, MAX_CONFIG_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{name} config {path} is not UTF-8 text") from None
    except ValueError:
        raise ConfigError(f"{name} config {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB; it is not a "
                          "configuration") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {name} config {path}: {exc.strerror or exc}; check the path") from None


def comment_block(notes: Sequence[str], *, prefix: str = "# ") -> list[str]:
    """Each note as a comment line (``# ...``)."""
    return [f"{prefix}{note}" for note in notes]
