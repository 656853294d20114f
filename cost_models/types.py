"""Data models the cost model consumes and produces: TrainingConfig, Strategy, Estimate (the measured layer
record, LayerStats, is ``cost_models.layer_stats``).

They live here (not in ``planner``) because imports run one way, ``topology <- cost_models <- planner``,
and a cost model must never see a torch graph node, only these records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tessera.cost_models.strategy_text import MAX_BLOCKS, coerce_number, parse_item, run_lengths
from tessera.errors import ConfigError
from tessera.topology.validation import MAX_DEVICES, first_problem, quoted

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
CHECKED = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
"""Configuration of the models users fill in: ``FROZEN`` that also refuses infinite and NaN numbers."""
MAX_GLOBAL_BATCH = 2**30
"""Most sequences per step ``TrainingConfig`` takes (~10^9; published runs use up to ~10^4)."""
MAX_SEQ_LEN = 2**24
"""Longest sequence ``TrainingConfig`` takes (16M tokens; the longest published contexts are ~10M)."""

Precision = Literal["bf16", "fp16", "fp32", "fp8"]
Fp8Scaling = Literal["delayed", "current", "rowwise", "block", "mx"]
Recompute = Literal["none", "selective", "full", "offload"]
"""A block's activation policy: ``none`` keeps what autograd saves, ``selective`` recomputes the attention core (as
Tessera's runtime and Megatron run it; torchtitan's op-level policy differs: ``profiles.selective_policy``),
``full`` recomputes the block from its input, ``offload`` recomputes nothing and copies the saved tensors to host
memory in the forward and back before the block's backward (overlapped with compute)."""
RecomputeModule = Literal["mla_up_proj", "mlp", "layernorm", "shared_experts", "moe_act", "moe"]
"""A piece of a block Megatron-Core recomputes by name (``--recompute-modules``), besides the attention core that
``selective`` recomputes: ``mla_up_proj`` latent attention's up-projections and the rotary embedding after them,
``mlp`` a dense block's MLP, ``layernorm`` the norms in front of the attention and the MLP, ``shared_experts`` a MoE
block's shared experts, ``moe_act`` the routed experts' activation, ``moe`` a MoE block's MLP whole
(``planner.recompute_regions``, ``cost_models.module_recompute``)."""
BlockKind = Literal["", "attention", "local-attention", "moe", "local-moe", "ssm", "ssm-moe", "encoder"]
"""What a block is, for per-layer choices and the report: ``attention`` (global attention + dense MLP),
``local-attention`` (sliding-window attention + dense MLP), ``moe`` / ``local-moe`` (the same with routed experts),
``ssm`` / ``ssm-moe`` (a state-space mixer, with routed experts), ``encoder`` (a block of an encoder in front of the language model); ``""`` when
not a block or not known."""
Schedule = Literal["gpipe", "1f1b", "interleaved", "zero-bubble"]
LayerKind = Literal["embedding", "block", "norm", "head", "loss", "other"]


def config_error(exc: ValidationError, what: str) -> ConfigError:
    """A pydantic validation error of user input as one ``ConfigError`` line naming the field and the value."""
    return ConfigError(f"bad {what}: {first_problem(exc)}; fix that value")


class TrainingConfig(BaseModel):
    """What one optimizer step processes and in which precision. Invalid values raise ``ConfigError``."""

    model_config = CHECKED

    global_batch: int = Field(gt=0, le=MAX_GLOBAL_BATCH)
    """Sequences per optimizer step, summed over all data-parallel ranks (at most ``MAX_GLOBAL_BATCH``)."""
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    """Tokens per sequence (at most ``MAX_SEQ_LEN``)."""
    precision: Precision = "bf16"
    """Compute dtype. ``bf16``/``fp16`` mean mixed precision: fp32 master weights, fp32 Adam state. ``fp8``: the
    blocks' linears run on the FP8 matrix units (Transformer Engine, torchao float8, MXFP8), everything else in bf16
    (attention cores, norms, the embedding and the head), with bf16 mixed precision's model state."""
    fp8_scaling: Fp8Scaling = "current"
    """How FP8 tensors are scaled (``precision="fp8"`` only): ``delayed`` per-tensor scales from an amax history
    (Transformer Engine's ``DelayedScaling``), ``current`` per-tensor scales from the tensor itself (torchao
    ``tensorwise``, TE ``Float8CurrentScaling``), ``rowwise`` one scale per row (torchao ``rowwise``), ``block``
    one scale per 128-element tile (DeepSeek-V3, TE ``Float8BlockScaling``), ``mx`` one power-of-two scale per 32
    elements (OCP MX, MXFP8 on Blackwell)."""

    @field_validator("global_batch", "seq_len", mode="before")
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # an int to Python, so pydantic would take True as 1
            raise ValueError("must be a whole number, not a bool")
        if isinstance(value, (str, bytes)):  # pydantic would read "8" (and "٨") as 8
            raise ValueError(f"must be a whole number, not a {type(value).__name__} ({value!r})")
        return value

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, "training config") from None

    @model_validator(mode="after")
    def _scaling_needs_fp8(self) -> "TrainingConfig":
        if self.fp8_scaling != "current" and self.precision != "fp8":
            raise ConfigError(f"fp8_scaling={self.fp8_scaling} needs precision=fp8 (got {self.precision}); drop it or use fp8")
        return self

    @property
    def tokens_per_step(self) -> int:
        """Tokens processed by one optimizer step."""
        return self.global_batch * self.seq_len


class Strategy(BaseModel):
    """How a training run is split. String form: ``dp=16,tp=8,pp=8,cp=2,ep=8,zero=1,mbs=1,recompute=full``.

    **Mesh convention** (what the cost model assumes and the runtime builds). The world is
    ``dp * tp * pp * cp`` ranks, laid out innermost first ``tp -> cp -> pp -> dp`` (Llama 3's order, Llama 3
    Herd paper Sec. 3.3.2): rank ``r = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i`` when ``ep == 1``.

    - **Expert parallelism is carved out of the data-parallel axis** (Megatron-Core's and DeepSpeed-MoE's
      choice, and DeepSeek-V3's "EP64 + ZeRO-1 DP" on 128 data-parallel replicas): ``ep`` divides ``dp``; the
      dp axis is split ``dp = edp * ep`` and the ``ep`` part sits inside the pipeline axis, innermost first
      ``tp -> cp -> ep -> pp -> edp`` (Megatron-Core's ``tp-cp-ep-dp-pp`` keeps ep inside pp likewise; DeepSeek-V3's
      EP 64 spans 8 consecutive nodes): rank ``r = (((edp_i * pp + pp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i``.
      So an expert-parallel group is ``ep`` ranks ``tp * cp`` apart (inside a node when ``tp * cp * ep`` fits one),
      pipeline neighbours are ``tp * cp * ep`` apart, and data-parallel rank ``dp_i = edp_i * ep + ep_i``. With
      ``pp == 1`` this is exactly the ``dp`` axis split into ``(edp, ep)``, ep innermost. Each ep rank holds ``experts / ep``
      whole experts of every MoE layer and exchanges tokens with its group by all-to-all (dispatch and
      combine). Dense parameters (attention, norms, router, shared expert, embeddings) stay replicated over
      all ``dp`` ranks; expert parameters are replicated over the ``edp = dp / ep`` ranks that hold the
      same experts. Tensor parallelism splits expert weights like the dense MLP (Megatron-Core's default
      expert tensor-parallel size = tp).
    - **Context parallelism** splits every sequence into ``2 * cp`` chunks, rank ``i`` holding chunks ``i``
      and ``2cp - 1 - i`` (zig-zag, as Megatron-LM / Transformer Engine and Llama 3 do, so causal attention
      work is balanced); keys and values circulate in a ring over the ``cp`` axis. cp ranks hold identical
      weights, so gradients are reduced (and ZeRO state sharded) over ``dp * cp`` ranks for dense
      parameters and ``edp * cp`` ranks for expert parameters. The global batch is split over ``dp`` only.

    Invalid values raise ``ConfigError`` naming the field (degrees are at most ``MAX_DEVICES``).
    """

    model_config = CHECKED

    dp: int = Field(default=1, gt=0, le=MAX_DEVICES)
    """Data-parallel degree."""
    tp: int = Field(default=1, gt=0, le=MAX_DEVICES)
    """Tensor-parallel degree."""
    pp: int = Field(default=1, gt=0, le=MAX_DEVICES)
    """Pipeline-parallel degree (stages)."""
    cp: int = Field(default=1, gt=0, le=MAX_DEVICES)
    """Context-parallel degree: ranks that share one sequence (a mesh axis of its own)."""
    ep: int = Field(default=1, gt=0, le=MAX_DEVICES)
    """Expert-parallel degree: carved out of ``dp`` (it divides ``dp`` and adds no ranks; see above)."""
    zero: Literal[0, 1, 2, 3] = 0
    """ZeRO stage over the ranks that hold the same weights (``dp * cp`` of them): 0 replicated (DDP), 1 optimizer,
    2 +grads, 3 +params (FSDP)."""
    micro_batch: int = Field(default=1, gt=0, le=MAX_GLOBAL_BATCH)
    """Sequences per micro-batch on one data-parallel rank."""
    recompute: Recompute = "none"
    """Activation recomputation applied to every repeated block."""
    sp: bool = False
    """Sequence parallelism on the tensor-parallel axis."""
    tp_overlap: bool = False
    """Tensor-parallel collectives decomposed and overlapped with the matmuls they feed (Megatron-Core
    ``--tp-comm-overlap``; Wang et al., ASPLOS'23, arXiv:2105.05720). Tessera's runtime does not do this, so
    the planner never chooses it; pin it to evaluate a configuration that used it."""
    sp_regather: bool = False
    """Sequence parallelism saves each column-parallel input's local ``s/tp`` shard and all-gathers it again
    in the backward, overlapped with the input-gradient matmul (Megatron-LM's ``sequence_parallel``; what
    Korthikanti et al.'s ``34 sbh / t`` assumes). Tessera's runtime saves the gathered input instead
    (``cost_models.memory.sp_gathered_input_bytes``), so the planner never chooses it; pin it to evaluate a
    Megatron-LM configuration."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule (ignored when ``pp == 1``)."""
    virtual_stages: int = Field(default=1, gt=0, le=MAX_BLOCKS)
    """Model chunks per pipeline rank for the ``interleaved`` schedule (``schedule=interleaved:V``)."""
    chunk_blocks: tuple[Annotated[int, Field(gt=0, le=MAX_BLOCKS)], ...] = Field(default=(), max_length=MAX_BLOCKS)
    """Blocks in each of the ``pp * virtual_stages`` pipeline chunks, in order; empty = as even as possible."""
    block_recompute: tuple[Recompute, ...] = Field(default=(), max_length=MAX_BLOCKS)
    """Activation policy of each block in model order (recomputation or offload); empty = ``recompute`` for every block."""
    block_reshard: tuple[bool, ...] = Field(default=(), max_length=MAX_BLOCKS)
    """Under ``zero=3``, whether each block frees its gathered weights after its forward (FSDP2
    ``reshard_after_forward``), in model order; empty = every block does. ``False`` keeps the block's weights
    gathered until its backward: one all-gather fewer per micro-batch, the unsharded weights held meanwhile
    (a per-layer ZeRO-2/ZeRO-3 mix)."""
    recompute_modules: tuple[RecomputeModule, ...] = Field(default=(), max_length=6)
    """Pieces of every block not fully recomputed or offloaded that are recomputed besides what ``recompute`` does
    (Megatron-Core's ``--recompute-modules`` beyond ``core_attn``; ``cost_models.module_recompute``). Tessera's
    runtime does not run them, so the planner never chooses them; pin them to evaluate a configuration that used
    them."""
    pipeline_passes: int = Field(default=1, gt=0, le=MAX_GLOBAL_BATCH)
    """Pipeline schedule calls a step's micro-batches run in, each filling and draining the pipeline: NeMo AutoModel
    accumulates gradients over local batches and calls its schedule once per local batch. 1 (one call for all of
    them) is what Tessera's runtime and Megatron-Core run, and torchtitan's pipelined runs of 2024; the planner
    never chooses more."""
    etp: int | None = Field(default=None, gt=0, le=MAX_DEVICES)
    """Tensor-parallel degree of the routed experts (Megatron-Core's ``expert_tensor_parallel_size``); ``None`` =
    ``tp``. Smaller than ``tp`` folds the rest of the tensor-parallel axis into expert parallelism (Megatron's
    "MoE parallel folding"): the experts' grid ``etp x ep x edp`` covers the same ``tp * dp`` ranks as the dense
    layers' ``tp x dp``, so ``ep`` must divide ``dp * tp / etp``."""

    def __init__(self, /, **data: Any) -> None:  # pydantic calls it from model_validate too
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, "strategy") from None

    @field_validator("recompute_modules")
    @classmethod
    def _modules_in_one_order(cls, modules: tuple[str, ...]) -> tuple[str, ...]:
        """One order per meaning (``RecomputeModule``'s): the same pieces are the same strategy."""
        order = get_args(RecomputeModule)
        return tuple(sorted(modules, key=order.index))

    @model_validator(mode="after")
    def _virtual_stages_need_interleaving(self) -> "Strategy":
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs schedule=interleaved:{self.virtual_stages}")
        if len(set(self.recompute_modules)) < len(self.recompute_modules):
            raise ConfigError(f"recompute_modules {'/'.join(self.recompute_modules)} names a module twice; name each once")
        if self.recompute_modules and self.recompute in ("full", "offload") and not self.block_recompute:
            raise ConfigError(f"recompute_modules with recompute={self.recompute}: no block keeps what they would "
                              "recompute; drop recompute_modules or recompute none or selective")
        if self.pipeline_passes > 1 and self.pp == 1:
            raise ConfigError(f"pipeline_passes={self.pipeline_passes} needs pp > 1: only a pipeline fills and drains")
        if self.block_reshard and self.zero != 3:
            raise ConfigError(f"block_reshard needs zero=3 (got zero={self.zero}): only FSDP reshards weights; drop it or set zero=3")
        if self.tp % self.expert_tp:
            raise ConfigError(f"etp={self.expert_tp} must divide tp={self.tp}: the experts' tensor-parallel group lies inside the dense one")
        if self.expert_tp != self.tp:
            if (self.dp * self.tp // self.expert_tp) % self.ep:
                raise ConfigError(
                    f"ep={self.ep} must divide dp*tp/etp = {self.dp}*{self.tp}/{self.expert_tp}: with etp < tp the "
                    "experts' grid etp x ep x edp covers the dense layers' tp x dp ranks"
                )
        elif self.dp % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide dp={self.dp}: expert parallelism is carved out of the data-parallel "
                f"axis (dp counts every replica of the dense weights); e.g. dp={self.dp * self.ep},ep={self.ep}"
            )
        return self

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor-parallel degree: ``etp``, or ``tp`` when not set."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the ranks holding the same expert shard (``dp * tp / (etp * ep)``; ``dp / ep``
        when the experts use the dense tensor-parallel degree)."""
        return self.dp * self.tp // (self.expert_tp * self.ep)

    @property
    def layout_ep(self) -> int:
        """The ep axis of the dense layers' mesh: ``ep`` carved out of dp, or 1 when the experts are folded
        (``etp < tp``: they get a grid of their own over the plain ``(dp, pp, cp, tp)`` layout, ``runtime.mesh``)."""
        return self.ep if self.expert_tp == self.tp else 1

    def reshards_block(self, index: int) -> bool:
        """Whether the ``index``-th block frees its gathered weights after its forward (``zero=3`` only)."""
        return self.block_reshard[index] if self.block_reshard else self.zero == 3

    def recompute_of_block(self, index: int) -> Recompute:
        """The recomputation policy of the ``index``-th block."""
        return self.block_recompute[index] if self.block_recompute else self.recompute

    @property
    def cost_model_only(self) -> tuple[str, ...]:
        """The items of this strategy that only the cost model knows, for evaluating a configuration another
        framework ran (``tp_overlap=true``, ...): Tessera's runtime refuses a strategy with any of them."""
        items = (("tp_overlap=true", self.tp_overlap), ("sp_regather=true", self.sp_regather),
                 (f"pipeline_passes={self.pipeline_passes}", self.pipeline_passes > 1),
                 ("recompute_modules=" + "/".join(self.recompute_modules), bool(self.recompute_modules)))
        return tuple(item for item, present in items if present)

    @property
    def world_size(self) -> int:
        """Ranks this strategy occupies: ``dp * tp * pp * cp`` (``ep`` is part of ``dp``)."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def name(self) -> str:
        """Short family name used in tables: the data-parallel mode (``DDP``, ``ZeRO-1``, ``FSDP``...) and the
        model-parallel axes beside it (``FSDP+TP+PP``); ``TP+PP`` without data parallelism, or ``one device``."""
        axes = [axis.upper() for axis in ("tp", "pp", "cp", "ep") if getattr(self, axis) > 1]
        if self.dp == 1:
            return "+".join(axes) or "one device"
        return "+".join([{0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[self.zero], *axes])

    def gradient_accumulation(self, global_batch: int) -> int:
        """Micro-batches per rank per step; raises if the batch does not divide evenly."""
        per_step = self.dp * self.micro_batch
        if global_batch % per_step:
            raise ConfigError(
                f"global batch {global_batch} is not divisible by dp*micro_batch = {self.dp}*{self.micro_batch}; "
                + ("pick a dp that divides it" if global_batch % self.dp else "pick a micro-batch that divides "
                   f"{global_batch // self.dp} (the batch per dp rank)")
            )
        micro_batches = global_batch // per_step
        if micro_batches % self.pipeline_passes:
            raise ConfigError(f"{micro_batches} micro-batches a step do not split into pipeline_passes="
                              f"{self.pipeline_passes} passes of one size; pick passes that divide them")
        return micro_batches

    def to_string(self) -> str:
        """Compact ``key=value`` form that :meth:`parse` reads back."""
        parts = [f"dp={self.dp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(self, k) != 1]
        parts += [f"zero={self.zero}", f"mbs={self.micro_batch}", f"recompute={self.recompute}"]
        if self.sp:
            parts.append("sp=true")
        if self.tp_overlap:
            parts.append("tp_overlap=true")
        if self.sp_regather:
            parts.append("sp_regather=true")
        if self.etp is not None:
            parts.append(f"etp={self.etp}")
        if self.block_recompute:
            parts.append("block_recompute=" + "/".join(run_lengths(self.block_recompute)))
        if self.block_reshard:
            parts.append("block_reshard=" + "/".join(run_lengths(tuple(map(str, self.block_reshard)))).lower())
        if self.chunk_blocks:
            parts.append("chunk_blocks=" + "/".join(map(str, self.chunk_blocks)))
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}" + (f":{self.virtual_stages}" if self.schedule == "interleaved" else ""))
        if self.pipeline_passes > 1:
            parts.append(f"pipeline_passes={self.pipeline_passes}")
        if self.recompute_modules:
            parts.append("recompute_modules=" + "/".join(self.recompute_modules))
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Read ``dp=4,zero=3,mbs=2,recompute=full``; unknown keys and bad values raise ConfigError."""
        return cls.model_validate(cls.parse_fields(text))

    @classmethod
    def parse_fields(cls, text: str) -> dict[str, object]:
        """The fields a (possibly partial) strategy string pins, validated: ``"tp=8,pp=4"`` -> ``{tp: 8, pp: 4}``.

        An unknown key, a key given twice, a malformed value or one out of range raises ``ConfigError``."""
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, value = parse_item(item, known=cls.model_fields)
            if key in values:
                raise ConfigError(f"bad strategy {quoted(text)}: {key} is given twice; keep one")
            values[key] = value
        if isinstance(values.get("schedule"), str) and ":" in values["schedule"]:
            schedule, chunks = values["schedule"].split(":", 1)
            values["schedule"], values["virtual_stages"] = schedule, coerce_number(chunks)
        # A partial pin leaves dp to the search: check ep against a dp it divides (ep is carved out of dp).
        try:  # as the field will read it ("2.0" is 2); a bad value is the validation's to refuse
            ep = int(float(values.get("ep", 1)))
        except (TypeError, ValueError, OverflowError):
            ep = 1
        validated = cls.model_validate({"dp": ep if 0 < ep <= MAX_DEVICES else 1, **values})
        return {key: getattr(validated, key) for key in values}  # as the fields hold them: tp=1.0 is the int 1


class Estimate(BaseModel):
    """Predicted step time, throughput and per-device memory of one strategy, with its breakdown."""

    model_config = FROZEN

    step_time_s: float
    """Predicted wall time of one optimizer step."""
    compute_time_s: float
    """Forward + backward compute (without recomputation) on one device per step."""
    recompute_time_s: float
    """Extra forward compute spent on activation recomputation per step."""
    optimizer_time_s: float
    """Optimizer update time per step (memory-bandwidth bound)."""
    exposed_comm_time_s: float
    """Communication time not hidden behind compute."""
    comm_time_by_kind_s: dict[str, float]
    """Total (hidden + exposed) communication time per kind, e.g. ``dp_allreduce``, ``fsdp_allgather``."""
    memory_by_category_bytes: dict[str, int]
    """Peak per-device memory by category: parameters, gradients, optimizer, activations, buffers, reserve."""
    peak_memory_bytes: int
    """Sum of ``memory_by_category_bytes``: the predicted per-device peak."""
    memory_budget_bytes: int
    """Device memory the estimate was checked against."""
    tokens_per_s: float
    """Whole-cluster training throughput."""
    model_flops_per_step: float
    """Model FLOPs (forward + backward, no recomputation) of one step over the whole cluster."""
    mfu: float
    """Model FLOPs utilisation: model FLOP/s achieved divided by the cluster's peak. Model FLOPs count attention's
    whole ``s x s`` score and value products, as PaLM (appendix B), Megatron-LM and torchtitan count them for their
    published MFU, though a causal kernel performs about half of them (``compute.CAUSAL_WORK`` prices that)."""
    num_devices: int = 1
    """Devices the step runs on."""
    hardware_flops_per_step: float = 0.0
    """FLOPs actually executed in one step over the cluster (recomputation included)."""
    hfu: float = 0.0
    """Hardware FLOPs utilisation: executed FLOP/s divided by the cluster's peak."""
    bubble_time_s: float = 0.0
    """Pipeline idle time per step on the slowest stage. Negative where ranks share CPU cores and the idle ranks'
    share lets the slowest stage run faster than its all-ranks-busy time (``cost_models.pipeline``)."""
    straggler_time_s: float = 0.0
    """Seconds a step waits for its slowest rank beyond one rank's mean (``Calibration.jitter``)."""
    offload_time_s: float = 0.0
    """Seconds of activation-offload copies per step that the compute does not hide (``cost_models.offload``)."""
    contention_time_s: float = 0.0
    """Seconds per step the compute loses to the collectives it hides (``Calibration.overlap_contention``)."""
    stage_peak_memory_bytes: tuple[int, ...] = ()
    """Predicted peak memory of each pipeline stage (``memory_by_category_bytes`` is the worst one)."""
    stage_memory_by_category_bytes: tuple[dict[str, int], ...] = ()
    """Per pipeline stage, its peak memory by category (for per-stage memory charts)."""
    stage_time_per_micro_batch_s: tuple[dict[str, float], ...] = ()
    """Per pipeline stage, seconds one micro-batch spends there by part (forward, backward, recompute,
    tp_comm, pp_comm): what a pipeline timeline draws."""
    micro_batches: int = 1
    """Micro-batches per step on each data-parallel rank (gradient accumulation steps)."""
    notes: tuple[str, ...] = ()
    """Assumptions that shaped this estimate, in words."""

    @property
    def model_tflops_per_device(self) -> float:
        """Model TFLOP/s achieved per device (recomputation not counted)."""
        return self.model_flops_per_step / self.step_time_s / self.num_devices / 1e12

    @property
    def hardware_tflops_per_device(self) -> float:
        """Executed TFLOP/s per device (recomputation counted), the metric of Megatron's SC'21 tables."""
        return self.hardware_flops_per_step / self.step_time_s / self.num_devices / 1e12

    @property
    def fits(self) -> bool:
        """Whether the predicted peak fits in the device budget."""
        return self.peak_memory_bytes <= self.memory_budget_bytes

    @model_validator(mode="after")
    def _peak_is_sum(self) -> "Estimate":
        if self.peak_memory_bytes != sum(self.memory_by_category_bytes.values()):
            raise ValueError("peak_memory_bytes must equal the sum of memory_by_category_bytes")
        return self


# ----------------------------------------------------------------------------------- what the runtime applies
# One table for both sides of the one-way imports: capture checks a model against it (``planner.capabilities``) and
# the search never combines what it excludes, and the runtime splits by the same table (``runtime.tensor_parallel``,
# ``runtime.expert_parallel``). Widen it where the runtime learns a new module type or combination, never on one side.

RUNTIME_SPLITS: Mapping[str, frozenset[str]] = {
    "tp": frozenset({"torch.nn.modules.linear.Linear"}),
    "ep": frozenset({"tessera.models.moe.MoELayer"}),
}
"""Axis -> the module classes (import path; a subclass counts) the runtime splits on it: tensor parallelism splits
column/row pairs of these linears, expert parallelism these mixture-of-experts layers, and also, by structure rather
than class, experts modules stacked over experts (``models.moe.stacked_experts_problem``; ``runtime.hf_experts``)."""

RUNTIME_EXCLUSIVE: tuple[tuple[str, str], ...] = (
    ("expert-folding", "sp"), ("ep", "selective"), ("cp", "sp"), ("cp", "pp"), ("zero-bubble", "zero-3"))
"""Strategy features the runtime refuses together (``runtime.expert_parallel.check_expert_parallel``,
``runtime.context_parallel.check_context_parallel``; ep with sp runs for stacked experts, and a ``MoELayer`` model
has no sp at all, ``planner.capabilities``): a feature is an axis of degree > 1, ``sp`` (sequence
parallelism), ``selective`` / ``offload`` (that activation policy on any block), ``block-reshard`` (a ZeRO-3 block
that keeps its weights gathered to its backward), ``expert-folding`` (experts on a tensor-parallel degree below
``tp``), ``zero-bubble`` (that schedule on a pipeline) or ``zero-3`` (ZeRO-3 over more than one rank). Zero-bubble
with ZeRO-3 ran but trained differently from one process (dp=2, pp=2 on gloo, torch 2.13), so it is refused."""


def runtime_splits(axis: str, cls: type) -> bool:
    """Whether the runtime splits modules of class ``cls`` on ``axis`` (``RUNTIME_SPLITS``)."""
    names = RUNTIME_SPLITS[axis]
    return any(f"{c.__module__}.{c.__qualname__}" in names for c in cls.__mro__)


def strategy_features(strategy: Strategy) -> set[str]:
    """The features of ``strategy`` that ``RUNTIME_EXCLUSIVE`` speaks of."""
    used = {axis for axis, degree in (("tp", strategy.tp), ("pp", strategy.pp), ("cp", strategy.cp),
                                       ("ep", strategy.ep)) if degree > 1}
    if strategy.sp:
        used.add("sp")
    for policy in ("selective", "offload"):
        if strategy.recompute == policy or policy in strategy.block_recompute:
            used.add(policy)
    if False in strategy.block_reshard:
        used.add("block-reshard")
    if strategy.expert_tp != strategy.tp:
        used.add("expert-folding")
    if strategy.pp > 1 and strategy.schedule == "zero-bubble":
        used.add("zero-bubble")
    if strategy.zero == 3 and strategy.dp * strategy.cp > 1:
        used.add("zero-3")
    return used


def runtime_conflict(
    features: set[str], exclusive: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE
) -> tuple[str, str] | None:
    """The first pair of ``features`` the runtime refuses together (``exclusive``: Tessera's by default), or None."""
    return next((pair for pair in exclusive if pair[0] in features and pair[1] in features), None)


def schedule_refusal(strategy: Strategy, training: TrainingConfig) -> str | None:
    """Why PyTorch's multi-chunk schedules (interleaved 1F1B and zero-bubble, which Tessera's runtime runs) would
    refuse the step's micro-batch count, or None: they run ``m`` micro-batches in ``max(1, m // pp)`` rounds and
    only a multiple of the rounds (``torch.distributed.pipelining.schedules``); 13 on pp=4 is refused."""
    if strategy.pp == 1 or strategy.schedule not in ("interleaved", "zero-bubble"):
        return None
    micro_batches = training.global_batch // (strategy.dp * strategy.micro_batch) // strategy.pipeline_passes
    rounds = max(1, micro_batches // strategy.pp)
    if micro_batches % rounds == 0:
        return None
    return (f"its {strategy.schedule} schedule runs a step's micro-batches in {rounds} rounds and needs a multiple of "
            f"{rounds}; {micro_batches} is not")
