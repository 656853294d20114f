"""The Plan: what the planner decided, saved as JSON and applied later by the runtime.

Keyed by module FQNs (never integer ids) so a plan can be reviewed, diffed and applied on another machine.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tessera.cost_models.types import Estimate, LayerKind, Recompute, Strategy, TrainingConfig

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
SCHEMA_VERSION = 1
GiB = 2**30


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
    """Recomputation applied to this layer."""
    chunk: int = 0
    """Pipeline chunk the layer belongs to (0 without pipelining). With ``pp`` stages and ``V`` chunks per
    rank (interleaved schedule) chunk ``c`` runs on pipeline rank ``c % pp``; otherwise chunk = stage."""


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
    param_count: int
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
    search_time_s: float = 0.0
    """Wall time the search took (capture excluded)."""
    solver: SolverStats = SolverStats()
    """Integer-program statistics."""

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to JSON (and write it to ``path`` when given)."""
        text = self.model_dump_json(indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """Read a plan from a JSON string or a file path."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text).read_text()
        return cls.model_validate_json(text)

    def summary(self) -> str:
        """A few plain-text lines: the strategy, predicted step time and throughput, memory per device."""
        e = self.estimate
        memory = ", ".join(f"{k} {v / GiB:.1f}" for k, v in e.memory_by_category_bytes.items())
        return "\n".join(
            [
                f"{self.model_name} ({format_count(self.param_count)} params) on {self.cluster} ({self.device_name})",
                f"strategy   {self.strategy.name}: {self.strategy.to_string()}",
                f"step time  {e.step_time_s:.3f} s   {e.tokens_per_s:,.0f} tokens/s   MFU {e.mfu:.1%}",
                f"memory     {e.peak_memory_bytes / GiB:.1f} of {e.memory_budget_bytes / GiB:.1f} GiB per device "
                f"({memory} GiB)",
            ]
        )

    def to_markdown(self, path: str | Path | None = None, *, plan_path: str = "plan.json") -> str:
        """The strategy report as Markdown; with ``path``, write it there and its charts (PNG) beside it.

        ``plan_path`` is where the launch command expects this plan's JSON.
        """
        from tessera.planner.explain import plan_markdown

        return plan_markdown(self, path, plan_path=plan_path)

    def to_html(self, path: str | Path | None = None, *, plan_path: str = "plan.json") -> str:
        """The strategy report as one self-contained HTML page (charts embedded); with ``path``, write it there."""
        from tessera.planner.explain import plan_html

        return plan_html(self, path, plan_path=plan_path)

    def chunk_fqns(self) -> list[tuple[str, ...]]:
        """FQNs of each pipeline chunk's layers, in chunk order (the runtime's stage split)."""
        chunks = max((layer.chunk for layer in self.layers), default=0) + 1
        return [tuple(layer.fqn for layer in self.layers if layer.chunk == c) for c in range(chunks)]

    @property
    def block_fqns(self) -> tuple[str, ...]:
        """FQNs of the repeated blocks: the FSDP wrapping and recomputation units."""
        return tuple(layer.fqn for layer in self.layers if layer.kind == "block")
