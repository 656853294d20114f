"""What an implementation profile says of a framework: the behaviours the cost model distinguishes between frameworks
that run the same strategy (``ImplementationProfile``'s fields) and their checks. Each framework's own profile, and
what each field means for it, are ``cost_models.profiles``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.cost_models.stage_views import CROSS_ENTROPY_KERNELS
from tessera.cost_models.types import RUNTIME_EXCLUSIVE, Strategy, TrainingConfig
from tessera.errors import ConfigError


@dataclass(frozen=True)
class ParameterGathering:
    """ZeRO-3 that gathers parameter by parameter (DeepSpeed's stage 3) instead of a whole unit at a time: at most
    ``live_params`` gathered elements stay resident (a larger parameter is gathered whole), ``prefetch_params`` more
    are fetched ahead, and gradients are reduced through a bucket of ``reduce_bucket_params`` elements."""

    live_params: float
    prefetch_params: float
    reduce_bucket_params: float


@dataclass(frozen=True)
class ImplementationProfile:
    """The behaviours of one framework the cost model distinguishes (see the module docstring)."""

    name: str
    zero3_comm_slowdown: float = 1.0
    """Factor on ZeRO-3's parameter all-gathers and gradient reduce-scatters over the ideal ring time."""
    fp8_saves_inputs: bool = False
    """Under FP8, the linears save their inputs for the backward in FP8 (1 byte) instead of bf16."""
    weight_fp8_bytes: float = 0.0
    """Under FP8, bytes per block-linear parameter of FP8 weight copies kept across micro-batches."""
    fp8_casts_per_linear: bool = False
    """Under FP8, every linear casts its input on its own (torchao's eager ``Float8Linear``: q, k and v cast one tensor
    three times; ``LayerStats.linear_call_input_bytes``). False: each distinct input is cast once (Transformer
    Engine's fused QKV and gate/up modules, and a compiled graph, which computes one cast once)."""
    fp8_all_gather: bool = False
    """Under FP8 with ZeRO-3, block parameters are all-gathered in FP8 (1 byte each): see :meth:`gathers_fp8`."""
    fp8_all_gather_under_tp: bool = True
    """``fp8_all_gather`` holds under tensor parallelism too (torchtitan's float8 tensor-parallel styles); False where
    the framework gathers FP8 only without it."""
    fp8_cast_bytes_per_element: float = 0.0
    """Under FP8, bytes an eager cast allocates per element of the tensor it casts, alive while it runs (torchao's
    eager cast: an fp32 copy, the scaled fp32 tensor, the FP8 result); 0 where the cast is one fused kernel (Transformer
    Engine; torch.compile) whose FP8 result is all it allocates."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages the framework runs (Megatron-Core: DDP or its distributed optimizer, ZeRO-1)."""
    tp_overlap_backward: bool = True
    """Under ``Strategy.tp_overlap``, the backward's tensor-parallel collectives are overlapped too (not only the
    forward's and the recomputation's)."""
    zero3_by_parameter: ParameterGathering | None = None
    """ZeRO-3 gathering parameter by parameter, with its limits (``memory_transients.parameter_gathered_bytes``);
    ``None``: FSDP's whole units (a block, and the next one prefetched)."""
    backward_prefetch: str = "pre"
    """When ZeRO-3 issues a block's backward all-gather: ``pre`` (before the later block's gradient computation,
    hidden behind it) or ``post`` (after it: exposed), as FSDP1's ``BackwardPrefetch``."""
    autocast_copies: bool = False
    """Mixed precision by ``torch.autocast`` where the model is not FSDP-wrapped (plain modules, DDP): a micro-batch
    holds a compute-dtype copy of every local weight from its forward to its backward (autocast's cast cache, and
    the copies autograd saves). FSDP casts once per gathered unit instead; Megatron-style frameworks keep bf16
    weights themselves. Such frameworks also leave gradient accumulation on those modules to autograd
    (``cost_models.memory.accumulation_bytes``), where Megatron-style ones fuse it into an fp32 buffer."""
    replicate_by_fsdp2: bool = False
    """ZeRO-0 beside tp, pp, cp or ep runs as FSDP2's ``replicate``, one unit over the model: its gradients come in
    the compute dtype and are accumulated and all-reduced through fp32 copies of the whole unit
    (``cost_models.memory.replicate_reduction_bytes``). Frameworks with a persistent fp32 gradient buffer reduce
    it in place (Megatron-Core's DDP)."""
    gradient_bytes: int = 4
    """Bytes per element of the gradients the framework accumulates and reduces over data parallelism: 4 (fp32 main
    gradients) or 2 (reduced in bf16, as NeMo's ``grad_sync_dtype: bf16`` does)."""
    master_bytes: int = 4
    """Bytes per element of the parameters the optimizer steps on: 4 (fp32 master weights, mixed precision's; what
    Tessera's runtime keeps) or 2 (the bf16 model itself, no master copy: a model cast to bf16 and trained so)."""
    moment_bytes: int = 4
    """Bytes per element of each of Adam's two moments: 4 (fp32) or 2 (bf16: ``torch.optim.Adam`` keeps them in its
    parameters' dtype, so a bf16 model's are bf16)."""
    attention_kernels: tuple[str, ...] = ("fa2",)
    """The fused attention kernels the framework runs, in the order it prefers them: the first one the device's
    catalog entry has a figure for prices the attention cores; none of them (or empty): the calibrated fallback."""
    cp_attention_kernels: tuple[str, ...] | None = None
    """The kernels of its context-parallel ring's steps, where they are not ``attention_kernels`` (None: the same):
    a ring that calls one kernel's op itself runs that kernel whatever SDPA would choose."""
    refused_together: tuple[tuple[str, str], ...] = RUNTIME_EXCLUSIVE
    """Strategy features the framework does not combine (``cost_models.types.RUNTIME_EXCLUSIVE``'s vocabulary): the
    planner's space for a run of it leaves those out. Tessera's runtime's by default; none for the other
    frameworks, whose runs Tessera evaluates as given (torchtitan's 4D runs combine context parallelism with
    pipelining and sequence parallelism, which Tessera's runtime does not)."""
    model_limits: bool = True
    """Whether what Tessera's runtime cannot apply to one model (``LayerGraph.unavailable_axes``: the layers its ep
    splits, the combinations it runs on stacked experts...) and the expert tensor-parallel degrees it folds to (``etp``
    1 or ``tp``) bound the strategies priced for this framework. True for
    Tessera's runtime only: another framework runs its own code, evaluated as given (as ``refused_together``)."""
    fused_rms_norm: bool = False
    """``torch.rms_norm`` (``nn.RMSNorm``) runs on GPUs as CUDA's fused kernel, which keeps its input alone for the
    backward (``stage_views.with_fused_norms``): PyTorch's since its fused RMSNorm (2.8; under autocast since the fix of
    pytorch/pytorch#167308), Transformer Engine's RMSNorm; and writes no fp32 copies of it, which the elementwise time
    charges no traffic for (``compute.stage_compute_s``). False: the composite capture measures (two fp32 tensors of
    the input's size, written and kept), as torch ran it before."""
    fused_declared_norms: bool = False
    """The framework builds the model from its own modules, so the norms a stand-in model writes out by hand but
    declares RMSNorm kernel layers (transformers' ``LlamaRMSNorm``, ``Qwen3MoeRMSNorm``: ``planner.kernels``) run as its
    fused RMSNorm, like ``fused_rms_norm``'s (``stage_views.with_fused_declared_norms``,
    ``compute.fused_traffic_saving_bytes``): Megatron-Core, whose models norm with Transformer Engine's RMSNorm (its
    q/k norms too), when a published run of it is priced on a Hugging Face model of the same shape. False: the
    model's own code runs, as in Tessera's runtime and torchtitan."""
    fused_gated_activation: bool = False
    """A gated MLP (SwiGLU, GeGLU) runs its activation and product as one fused kernel, which keeps the gate's and
    up's outputs alone for the backward, not the activation's output too (``stage_views.with_fused_gates``), and
    does not write it (``compute.fused_traffic_saving_bytes``): Megatron-Core's ``bias_activation_fusion``
    (``megatron/core/fusions/fused_bias_swiglu.py``, whose autograd functions save their input alone; on in
    Megatron-LM unless ``--no-bias-swiglu-fusion``, and in Megatron-Bridge's Llama bridge) and Transformer Engine's
    ``LayerNormMLP``. False: the composite capture measures, as eager PyTorch runs it."""
    cross_entropy: str = "torch"
    """The loss's kernel (``stage_views.CROSS_ENTROPY_KERNELS``): ``torch`` (cross-entropy over fp32 log-probabilities;
    ``loss_parallel`` under tensor parallelism), ``flash-attn`` (one fused kernel on the logits as they come: it saves
    the logits and its backward allocates one gradient of their size; without tensor parallelism), ``compiled`` (torch's
    under ``torch.compile``: the same, as one fused kernel) or ``megatron``
    (vocabulary-parallel: it saves an fp32 softmax and turns it into the gradient in place). See
    ``stage_views.with_loss_kernel`` and ``memory_state.loss_gradient_bytes``."""
    cp_rotation: str = "ring"
    """How context parallelism moves the keys and values (``CP_ROTATIONS``): ``ring`` (each step sends one K/V block
    on while the attention of the one received runs: Tessera's ``runtime.context_parallel``, Transformer Engine's
    ``cp_comm_type="p2p"``) or ``allgather`` (PyTorch's ring attention with its default ``ALL_GATHER`` rotation: every
    layer all-gathers the whole sequence's K/V behind its first step only, again in the backward, where the fp32
    dK/dV travel a ring one step per block: ``cost_models.sparse.cp_comm_s``)."""
    cp_kv_repeated: bool = False
    """The keys and values the context-parallel exchange carries are repeated to every query head (a model that
    calls SDPA after its own ``repeat_kv`` under grouped-query attention): ``heads / kv_heads`` times the bytes."""
    cp_ring_slowdown: bool = True
    """Split over a context-parallel ring, the attention cores run ``Calibration.cp_attention_slowdown`` times slower
    than the unsplit kernel. True for PyTorch's ring attention (torchtitan), whose published runs imply ~1.5 at CP 2
    to 8 (``benchmarks/attention_gap.py``; the cause is not identified), and for Tessera's runtime, whose ring calls
    the flash kernel per block and merges the partial outputs in PyTorch ops as PyTorch's does (assumed alike: no GPU
    has run it). False for Transformer Engine's ring (Megatron-Core, NeMo): NeMo 24.03's context-parallel runs, priced
    on the FlashAttention-2 their launcher ran, imply 0.95-1.00 at CP 2 to 32."""
    dp_overlap: bool = True
    """Without ZeRO-3, the data-parallel collectives overlap compute (DDP's all-reduce and ZeRO-1/2's reduce-scatter
    the backward, ZeRO-1/2's parameter all-gather the next forward); False where the framework runs them between
    steps, none hidden: Megatron-LM's default ``local`` DDP before Megatron-Core's ``--overlap-grad-reduce`` and
    ``--overlap-param-gather`` (``megatron/training.py`` ``train_step`` of 2021-2022 calls ``allreduce_gradients`` once
    ``forward_backward_func`` has returned)."""
    pp_scatter_gather: bool = False
    """Without sequence parallelism, each tensor-parallel rank sends only its ``1/tp`` share of a pipeline stage's
    boundary activation (all ``tp`` ranks hold the same tensor) and the receiving stage all-gathers the shares over its
    tensor-parallel group: Megatron-LM's scatter/gather optimisation (Narayanan et al., SC'21, Sec. 4.1;
    ``--no-scatter-gather-tensors-in-pipeline`` turns it off, so it is on by default in ``megatron/arguments.py``
    of 2021-2022 and ``megatron/p2p_communication.py`` applies it whenever sequence parallelism is off)."""
    selective_policy: str = "attention"
    """What ``recompute=selective`` re-runs: ``attention`` (the attention core), ``op`` (torchtitan's op-level
    policy: every second matmul of the block and its elementwise work; the attention core is kept) or ``matmuls``
    (Tessera's runtime: everything but the matmuls, which keep their outputs)."""

    pipeline_keeps_outputs: bool = False
    """Under pipelining, the last stage keeps every micro-batch's output (the logits) of a schedule call and
    concatenates them at its end: ``torch.distributed.pipelining``'s default (``step(return_outputs=True)``), which
    NeMo AutoModel's recipes run (``schedule.step(input_ids, target=..., losses=...)``). False: Tessera's runtime,
    which passes ``return_outputs=False`` (``runtime/parallel_model.py``), and the frameworks whose published
    memory says they keep no more (``memory.pipeline_output_bytes``)."""

    ep_dispatch: str = "per-expert"
    """How the expert-parallel dispatch and combine cross nodes (``EP_DISPATCHES``): ``per-expert`` (a copy of a token
    for each chosen expert on another rank: Megatron-Core's ``alltoall`` dispatcher, Tessera's ``runtime.experts_exchange``)
    or ``per-node`` (one copy for each other node that holds a chosen expert, fanned out over NVLink there: DeepEP's
    normal kernels and Megatron-Core's ``flex`` dispatcher with its DeepEP or HybridEP backend): the bytes beyond a node
    shrink by ``sparse.per_node_share``."""
    ep_routing: str = "uniform"
    """Which experts a token goes to (``EP_ROUTINGS``): ``uniform`` (any ``k`` of them alike, the balanced load of a
    trained or force-balanced router; Megatron-Core's ``moe_router_force_load_balancing``) or ``consecutive`` (``k``
    neighbouring experts starting at a multiple of ``k``: NeMo AutoModel's ``FakeBalancedGate``, which gives token
    ``t`` experts ``k t .. k t + k - 1`` modulo their number), which a per-node dispatch sends to fewer nodes
    (``sparse.per_node_share``)."""
    offload_copies_overlap: bool = False
    """An offloaded block's copies to and from host memory run on a stream of their own, beside the compute
    (``cost_models.offload.exposed_offload_s``): Transformer Engine's CPU offloading, which Megatron-Core runs for
    ``cpu_offloading_num_layers`` blocks (``transformer_engine/pytorch/cpu_offload.py``: the offload and the reload are
    issued on its ``offload_stream``). False: Tessera's runtime, whose side-stream copies on CUDA have not run on a GPU
    yet (``tests/gpu/test_offload_cuda.py``), so its plans never count on an overlap nobody has seen."""
    offload_buffered: bool = True
    """An offloading stage's copies come back from host into buffers of their own: the block whose backward runs and
    the next one, prefetched (``StageTotals.offload_buffer_bytes``; Tessera's ``runtime.offload``). False: Transformer
    Engine's offload synchronizer, whose documented peak is the kept blocks' activations alone (``(num_layers -
    num_offloaded_layers) * T``, ``transformer_engine/pytorch/cpu_offload.py``): reloads land in memory the kept
    blocks' backward has freed."""
    fp8_params: bool = False
    """Under FP8, the model's weights are FP8 tensors (with their transposes or, under MXFP8, their column-wise copies:
    2 bytes a parameter in place of bf16's) and no FP8 copies are kept beside them; ZeRO-3 gathers them in FP8.
    Megatron-Core's ``--fp8-param-gather`` ("Keep the compute param in fp8 ... and perform the param all-gather in
    fp8", ``megatron/training/arguments.py``; under MXFP8 "keeping params in MXFP8", its
    ``distributed_data_parallel_config.py`` at d7288711, the Megatron-LM that Megatron-Bridge v0.4.1 pins), which every
    FP8 precision config of Megatron-Bridge sets (``src/megatron/bridge/training/mixed_precision.py`` at v0.2.0 and
    v0.4.1)."""
    fused_optimizer: bool = False
    """Adam steps with fused multi-tensor kernels that update in place (Megatron-Core's Transformer Engine or apex
    ``FusedAdam``, ``megatron/core/optimizer/__init__.py``): no parameter-sized temporaries, where PyTorch's
    ``foreach`` AdamW materialises one (``memory_transients.optimizer_temporary_bytes``). DeepSpeed's ZeRO-3 keeps the
    temporary's place: it steps on an fp32 copy of each gradient shard."""
    contiguous_grad_buffer: bool = False
    """Under DDP and the distributed optimizer (ZeRO-0/1), the gradients live in one persistent buffer over every local
    parameter (Megatron-Core's ``ParamAndGradBuffer``), which the data-parallel collectives reduce in place (no DDP
    buckets, no reduce-scatter input copy) and which stays whole after the distributed optimizer's reduce-scatter;
    and below ZeRO-3 the compute-dtype weights stay beside their fp32 masters (``Float16Module`` under its
    mixed-precision optimizers). Tessera's runtime: DDP's buckets and FSDP2's shards."""
    ep_overlap: bool = False
    """The dispatch and combine all-to-alls of one micro-batch run beside another micro-batch's compute (Megatron-Core's
    ``overlap_moe_expert_parallel_comm``, Megatron-Bridge's ``moe_a2a_overlap``; DeepSeek-V3's DualPipe): only what the
    compute does not cover stays on the critical path (``sparse.exposed_ep_comm_s``)."""

    def kernels_at(self, cp: int) -> tuple[str, ...]:
        """The attention kernels that run the cores at context-parallel degree ``cp``."""
        return self.cp_attention_kernels if cp > 1 and self.cp_attention_kernels is not None else self.attention_kernels

    def __post_init__(self) -> None:
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ConfigError(f"ep_dispatch={self.ep_dispatch!r} is not one of {', '.join(EP_DISPATCHES)}")
        if self.ep_routing not in EP_ROUTINGS:
            raise ConfigError(f"ep_routing={self.ep_routing!r} is not one of {', '.join(EP_ROUTINGS)}")
        if self.selective_policy not in SELECTIVE_POLICIES:
            raise ConfigError(f"selective_policy={self.selective_policy!r} is not one of "
                              f"{', '.join(SELECTIVE_POLICIES)}")
        if self.cross_entropy not in CROSS_ENTROPY_KERNELS:
            raise ConfigError(f"cross_entropy={self.cross_entropy!r} is not one of {', '.join(CROSS_ENTROPY_KERNELS)}")
        if self.cp_rotation not in CP_ROTATIONS:
            raise ConfigError(f"cp_rotation={self.cp_rotation!r} is not one of {', '.join(CP_ROTATIONS)}")
        for field in ("gradient_bytes", "master_bytes", "moment_bytes"):
            if getattr(self, field) not in (2, 4):  # the search's data-parallel floor counts 2 bytes at least
                raise ConfigError(f"{field}={getattr(self, field)!r} is not 2 (bf16) or 4 (fp32)")

    def gathers_fp8(self, training: TrainingConfig, strategy: Strategy) -> bool:
        """Whether ZeRO-3 all-gathers the blocks' parameters in FP8 for ``training`` under ``strategy``: where the
        framework does (``fp8_all_gather``), under FP8 at current scaling (torchao's FP8 all-gather casts each
        weight with one scale, its tensorwise recipe's), and under tensor parallelism only where
        ``fp8_all_gather_under_tp``."""
        if self.fp8_params and training.precision == "fp8":
            return strategy.zero == 3  # the weights are FP8 themselves
        return (self.fp8_all_gather and training.precision == "fp8" and training.fp8_scaling == "current"
                and strategy.zero == 3 and (strategy.tp == 1 or self.fp8_all_gather_under_tp))

    def gathers_fp8_weights(self, training: TrainingConfig, strategy: Strategy) -> bool:
        """Whether the data-parallel all-gathers of the blocks' weights move FP8: ZeRO-3's (:meth:`gathers_fp8`), and,
        where the weights are FP8 themselves (``fp8_params``), ZeRO-1/2's gather of the updated weights after the
        step (Megatron-Core's parameter buffer for FP8 weights is ``uint8``: ``distributed_data_parallel.py``)."""
        if self.fp8_params and training.precision == "fp8" and strategy.zero in (1, 2):
            return True
        return self.gathers_fp8(training, strategy)


SELECTIVE_POLICIES = ("attention", "op", "matmuls")
"""What ``recompute=selective`` can mean (``ImplementationProfile.selective_policy``)."""
CP_ROTATIONS = ("ring", "allgather")
"""How context parallelism can move keys and values (``ImplementationProfile.cp_rotation``)."""
EP_DISPATCHES = ("per-expert", "per-node")
"""How the expert-parallel all-to-alls can cross nodes (``ImplementationProfile.ep_dispatch``)."""
EP_ROUTINGS = ("uniform", "consecutive")
"""Which experts a token's copies go to (``ImplementationProfile.ep_routing``)."""
