"""The Plan: what the planner decided, saved as JSON and applied later by the runtime.

Keyed by module FQNs (never integer ids) so a plan can be reviewed, diffed and applied on another machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from tessera.cost_models.error_bands import ErrorBand, prediction_band
from tessera.cost_models.profiles import TESSERA
from tessera.cost_models.types import (
    BlockKind, Estimate, LayerKind, Recompute, Strategy, TrainingConfig, schedule_refusal,
)
from tessera.cost_models.units import format_bytes, format_seconds
from tessera.errors import ConfigError
from tessera.files import read_bounded, write_text_atomically
from tessera.topology.validation import first_problem, quoted, short

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
SCHEMA_VERSION = 1
GiB = 2**30
MAX_PLAN_BYTES = 64 * 2**20
"""Largest plan file read (64 MiB; a 1000-layer plan with its runners-up is ~1 MiB)."""


def format_count(count: float) -> str:
    """``70.55B``, ``124.0M``, ``118.3K``: a parameter count people can read."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.{2 if suffix in 'TB' else 1}f}{suffix}"
    return str(int(count))


class PlannedLayer(BaseModel):
    """The plan's decision for one layer."""

    model_config = FROZEN

    fqn: str
    """Module FQN in the user's model (``blocks.0``)."""
    kind: LayerKind
    """Role of the layer; repeated ``block`` layers are the sharding and recomputation units."""
    recompute: Recompute
    """Activation policy of this layer (recomputation, or offload to host memory)."""
    chunk: int = 0
    """Pipeline chunk the layer belongs to (0 without pipelining). With ``pp`` stages and ``V`` chunks per
    rank (interleaved schedule) chunk ``c`` runs on pipeline rank ``c % pp``; otherwise chunk = stage."""
    block_kind: BlockKind = ""
    """What the block is (``attention``, ``local-attention``, ``moe``...; ``""`` for other layers or unknown)."""
    reshard: bool = True
    """Under ZeRO-3, whether the block frees its gathered weights after its forward (False: kept to its backward,
    ``Strategy.block_reshard``); True for every other layer and stage."""
    memory_bytes: int = 0
    """Predicted bytes the layer holds on one device when its pipeline stage peaks: its model state, and its saved
    activations if the stage peaks in the backward (``cost_models.layer_costs``; 0 in plans written before per-layer
    costs)."""
    time_s: float = 0.0
    """Predicted seconds the layer takes per micro-batch on one device (forward, backward, recomputation, its
    communication; ``cost_models.layer_costs``; 0 in plans written before per-layer costs)."""


class Candidate(BaseModel):
    """A strategy the search evaluated, with its estimate and, for runners-up, why it lost."""

    model_config = FROZEN

    strategy: Strategy
    """The strategy."""
    estimate: Estimate
    """Its predicted cost."""
    verdict: str
    """``chosen``, or why it lost (slower by how much, or over memory by how much)."""


class SolverStats(BaseModel):
    """What the integer-program refinement did during the search."""

    model_config = FROZEN

    ilp_solved: int = 0
    """Integer programs solved."""
    ilp_pruned: int = 0
    """Outer candidates skipped because their lower bound could not beat the incumbent."""
    ilp_infeasible: int = 0
    """Outer candidates whose program had no solution within memory."""
    ilp_time_s: float = 0.0
    """Total CP-SAT wall time."""
    worst_gap: float = 0.0
    """Largest relative optimality gap among the solves (0 = all proven optimal)."""
    ilp_improvements: int = 0
    """Times a solve beat the best uniform strategy."""


class Plan(BaseModel):
    """A chosen strategy, its prediction and the alternatives, ready to apply or review."""

    model_config = FROZEN

    schema_version: int = SCHEMA_VERSION
    """Version of this JSON layout; bumped on incompatible change."""
    model_name: str
    """Model preset or class the plan was made for."""
    param_count: NonNegativeInt
    """Total trainable parameters of the model."""
    cluster: str
    """Cluster spec the plan was made for (``dgx-h100:nodes=8``)."""
    device_name: str
    """Device every rank runs on."""
    training: TrainingConfig
    """Global batch, sequence length and precision."""
    strategy: Strategy
    """The chosen strategy."""
    estimate: Estimate
    """Predicted cost of the chosen strategy."""
    layers: tuple[PlannedLayer, ...]
    """Per-layer decisions in model order."""
    alternatives: tuple[Candidate, ...] = ()
    """Runners-up, best first."""
    degree_alternatives: tuple[Candidate, ...] = ()
    """The best estimated strategy at each other expert-/context-parallel degree (``ep``, ``cp``) the search
    reached: why the chosen degrees won (``planner.degrees``). Empty for a dense, short-sequence search."""
    candidates_evaluated: int = 1
    """Strategies the search estimated."""
    search_time_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Wall time the search took (capture excluded)."""
    capture_time_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Wall time building and capturing the model took before the search (``tessera.plan``; 0 when not measured)."""
    solver: SolverStats = SolverStats()
    """Integer-program statistics."""
    uniform: Candidate | None = None
    """The best uniform plan (one activation policy for every block, even stages, every ZeRO-3 block resharding)
    when the chosen plan is not uniform, its verdict saying what the per-layer choices gain over it."""
    unavailable_axes: dict[str, str] = {}
    """Parallel axes the runtime cannot apply to this model -> why (``LayerGraph.unavailable_axes``): the search
    planned without them. Empty in plans written before capture recorded it."""
    token_inputs: bool = True
    """The model was planned on token ids (``LayerGraph.token_inputs``); False: on ``example_inputs``, whose rows are
    samples, so the summaries count samples per second, not tokens."""
    unavailable_gains: tuple[Candidate, ...] = ()
    """For each unavailable axis whose use would change the plan: the fastest strategy with it, were the runtime
    to apply it (predicted), its verdict saying what it would gain."""

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to JSON (and write it to ``path`` when given, atomically: whole or not at all)."""
        text = self.model_dump_json(indent=2)
        if path is not None:
            write_text_atomically(path, text, what="plan file")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """Read a plan from a JSON string or a file path; anything wrong raises one ``ConfigError`` line naming
        the file and the problem (a plan written by a newer Tessera says to upgrade)."""
        text, where = _plan_text(text_or_path)
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"{where} is not valid JSON ({short(str(exc), limit=120)}); pass a plan.json written by "
                              "tessera plan --json") from None
        _check_schema_version(raw, where=where)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(f"{where} is not a valid plan: {first_problem(exc)}; re-create it with tessera plan --json"
                              ) from None
        except ConfigError as exc:
            raise ConfigError(f"{where} is not a valid plan: {exc}") from None

    def summary(self) -> str:
        """A few plain-text lines: the strategy, predicted step time and throughput, memory per device."""
        e = self.estimate
        memory = ", ".join(f"{k} {format_bytes(v)}" for k, v in e.memory_by_category_bytes.items())
        return "\n".join(
            [
                f"{self.model_name} ({format_count(self.param_count)} params) on {self.cluster} ({self.device_name})",
                f"strategy   {self.strategy.name}: {self.strategy.to_string()}",
                f"step time  {format_seconds(e.step_time_s)}   {self.throughput()}   MFU {e.mfu:.1%}",
                *((f"likely     {band.describe(e.step_time_s)}",) if (band := self.error_band()) else ()),
                f"memory     {format_bytes(e.peak_memory_bytes)} of {format_bytes(e.memory_budget_bytes)} per device "
                f"(held at the peak: {memory})",
                *(line for axis, reason in self.unavailable_axes.items() for line in (
                    f"no {axis:<7} {reason}",
                    *(f"           {c.verdict} ({c.strategy.to_string()}, {format_seconds(c.estimate.step_time_s)})"
                      for c in self.unavailable_gains if c.verdict.startswith(f"{axis} would gain")))),
            ]
        )

    def throughput(self) -> str:
        """``54,023 tokens/s``, or for a model planned on ``example_inputs`` ``1,234 samples/s`` (rows of the batch)."""
        if self.token_inputs:
            return f"{self.estimate.tokens_per_s:,.0f} tokens/s"
        return f"{self.training.global_batch / self.estimate.step_time_s:,.0f} samples/s"

    def gathers_fp8(self) -> bool:
        """Whether Tessera's runtime all-gathers this plan's FP8 block weights in FP8 under ZeRO-3, as the cost model
        priced it (``ImplementationProfile.gathers_fp8``)."""
        return TESSERA.gathers_fp8(self.training, self.strategy)

    def precision_summary(self) -> str:
        """The precision as the reports state it: under FP8, its scaling and whether ZeRO-3 all-gathers the blocks'
        weights in FP8 on Tessera's runtime (:meth:`gathers_fp8`)."""
        training = self.training
        if training.precision != "fp8":
            return training.precision
        return f"fp8 ({training.fp8_scaling} scaling{'; ZeRO-3 all-gathers FP8 weights' if self.gathers_fp8() else ''})"

    def not_on_the_runtime(self) -> str | None:
        """Why Tessera's runtime will not launch this plan (its strategy's cost-model-only items,
        ``Strategy.cost_model_only``, or a micro-batch count its pipeline schedule refuses), or None."""
        if (refused := schedule_refusal(self.strategy, self.training)) is not None:
            return f"a pipeline schedule PyTorch refuses: {refused}; pick a global batch or micro-batch that fits it"
        if not self.strategy.cost_model_only:
            return None
        return (f"{', '.join(self.strategy.cost_model_only)}: cost-model options for evaluating another framework's "
                "configuration, which Tessera's runtime does not run (--format megatron writes the plan for "
                "Megatron-LM); drop them to launch it here")

    def error_band(self) -> ErrorBand | None:
        """The error band of the plan's regime (FP8, context parallelism, mixture of experts, ZeRO-3 or not) on the
        held-out published runs (``cost_models.error_bands``); None on this machine's CPU (those are GPU runs)."""
        return prediction_band(self.strategy, self.training.precision, device_name=self.device_name,
                               block_kinds=(layer.block_kind for layer in self.layers))

    def chunk_fqns(self) -> list[tuple[str, ...]]:
        """FQNs of each pipeline chunk's layers, in chunk order (the runtime's stage split)."""
        chunks = max((layer.chunk for layer in self.layers), default=0) + 1
        return [tuple(layer.fqn for layer in self.layers if layer.chunk == c) for c in range(chunks)]

    @property
    def block_fqns(self) -> tuple[str, ...]:
        """FQNs of the repeated blocks: the FSDP wrapping and recomputation units."""
        return tuple(layer.fqn for layer in self.layers if layer.kind == "block")

    def to_megatron_args(self):
        """The plan as Megatron-LM arguments (``planner.frameworks.megatron``): a ``FrameworkExport``."""
        from tessera.planner.frameworks.megatron import to_megatron_args

        return to_megatron_args(self)

    def to_torchtitan(self):
        """The plan as an edit of a torchtitan 0.3 ``Trainer.Config`` (``planner.frameworks.torchtitan``)."""
        from tessera.planner.frameworks.torchtitan import to_torchtitan

        return to_torchtitan(self)

    def to_deepspeed(self):
        """The plan as a DeepSpeed JSON config; ``ConfigError`` for plans with tp, pp, cp or ep."""
        from tessera.planner.frameworks.deepspeed import to_deepspeed

        return to_deepspeed(self)


def _plan_text(text_or_path: str | Path) -> tuple[str, str]:
    """The JSON text of a plan given as text or as a path, and how errors name it (``plan file X``)."""
    text = str(text_or_path)
    if isinstance(text_or_path, str) and text.lstrip().startswith("{"):
        return text, "plan JSON"
    path = Path(text)
    where = f"plan file {path}"
    try:
        data = read_bounded(path, MAX_PLAN_BYTES)
    except ValueError:
        raise ConfigError(f"{where} is larger than {MAX_PLAN_BYTES // 2**20} MiB; it is not a plan.json") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}; check the path") from None
    try:
        return data.decode("utf-8"), where
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text; pass a plan.json written by tessera plan --json") from None


def _check_schema_version(raw: Any, *, where: str) -> None:
    """Raise unless ``raw`` is a plan object of a layout this Tessera reads."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} holds {type(raw).__name__}, not a plan object; pass a plan.json written by "
                          "tessera plan --json")
    version = raw.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"{where}: schema_version must be a positive integer, got {quoted(version)}")
    if version > SCHEMA_VERSION:
        raise ConfigError(f"{where} was written by a newer Tessera (plan schema_version {version}; this Tessera reads "
                          f"up to {SCHEMA_VERSION}): upgrade Tessera (pip install -U tessera) or re-plan with this one")
