"""Implementation profiles: what a training framework does differently with the same strategy.

A strategy says how a run is split; the framework that runs it decides how well its data-parallel collectives
overlap and what FP8 keeps in memory. A published run is evaluated as the framework that ran it, a Tessera
plan as Tessera's runtime (``TESSERA``, the default of ``cost_models.estimate``). Behaviours that are Strategy
knobs today because a framework chooses them per run (``Strategy.tp_overlap``, ``Strategy.sp_regather``) stay
there.

- **Sharded data parallelism** (ZeRO-3 / FSDP). PyTorch FSDP (FSDP1 with ``BACKWARD_PRE`` prefetch, FSDP2 always)
  gathers each block's parameters in one flat all-gather issued a block ahead and reduce-scatters each block's
  gradients as soon as its backward ends, on their own streams: the collectives move at the fabric's rate and
  hide behind compute (``communication.exposed_dp_comm_s``). DeepSpeed ZeRO-3 as measured in 2021 (Narayanan
  et al. SC'21 Table 2: 174.6B and 529.6B on 384-2240 A100s) gathered parameter by parameter, its collectives
  ``zero3_comm_slowdown`` times slower than the ideal ring: fitted on those rows (``benchmarks/published.py``);
  what it holds gathered is bounded by its live-parameter limit and its buckets, not a block and the next one
  (``zero3_by_parameter``).
  How far ahead the backward gathers are issued is the framework's (``backward_prefetch``). FSDP1's
  ``BackwardPrefetch.BACKWARD_PRE`` (and FSDP2, always) issues the next block's all-gather before the current
  block's gradient computation, so it hides behind it; ``BACKWARD_POST`` issues it only after that computation
  (torch ``BackwardPrefetch`` docstring: it overlaps the current reduce-scatter with the next gradient
  computation, not the next all-gather), so every block's backward waits for its own gather. MosaicML Composer
  defaults to ``BACKWARD_POST`` (``composer.utils.parallelism.FSDPConfig.backward_prefetch``) and llm-foundry's
  benchmark sweep (``scripts/train/benchmarking/submit_benchmarks.py`` at 061f2c7ce64e) does not override it.
- **Tensor-parallel overlap** (``Strategy.tp_overlap``). Megatron-Core's userbuffers overlap (Transformer
  Engine ``ub_tp_comm_overlap``) splits the collectives of the forward and of the backward behind their GEMMs.
  torchtitan's async TP (inductor's micro-pipeline pass, late 2024) overlaps the forward's only
  (``tp_overlap_backward`` False): its announcement (PyTorch dev-discuss, "[Distributed w/ TorchTitan]
  Introducing Async Tensor Parallelism in PyTorch", 2024) reports ~20% forward speedup but ~8% end to end on
  Llama 3 70B, about what a forward-only overlap saves of a step that also runs the backward. The recomputed
  forward is priced as hidden too: inductor runs its micro-pipeline pass on the backward's compiled graph as well
  (``torch/_inductor/fx_passes/post_grad.py``), where a checkpointed block's recomputation runs. torchtitan's two
  measurements of its 70B with full recomputation disagree about it: async TP saved 5.4% of the step in
  docs/performance.md (December 2024) and 14.1% in benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025,
  Float8 tensorwise).
- **FP8 memory**. Transformer Engine keeps an FP8 copy of each linear's weight and of its transpose across
  micro-batches (``weight_fp8_bytes`` = 2) and saves FP8 inputs for the backward (``fp8_saves_inputs``); torchao
  float8 casts on the fly from the bf16 weight and saves what autograd saves (bf16). FSDP2 with torchao may
  all-gather FP8 weights (``fp8_all_gather``: 1 byte per parameter on the wire and in the gathered buffer).
  Megatron-Core with ``--fp8-param-gather`` (every Megatron-Bridge FP8 recipe) keeps the weights themselves in FP8
  and no copies beside them (``fp8_params``).
- **Activation offload** (``Recompute`` ``"offload"``). Transformer Engine copies on a stream of its own beside the
  compute and reloads into memory the kept blocks' backward frees (``offload_copies_overlap``,
  ``offload_buffered``); Tessera's runtime, unmeasured on a GPU, is priced copying in line with two blocks in transit.
- **Attention kernel** (``attention_kernels``): which fused attention kernel runs the attention cores; its rate on
  the device is a published kernel benchmark (``topology/catalog.yaml`` ``attention_tflops``), priced by
  ``cost_models.compute.attention_efficiency``. Tessera's runtime and torchtitan call
  ``F.scaled_dot_product_attention``, whose flash backend is FlashAttention-2 from PyTorch 2.2 (its release blog,
  2024-01: SDPA "now supports FlashAttention-2, yielding around 2x speedups"). torchtitan's published runs
  (Hopper, 2024-2025) pinned that backend; Tessera's runtime leaves the choice to torch 2.13, which prefers cuDNN
  on Hopper and Blackwell (``TESSERA``). Megatron-Core and NeMo run
  Transformer Engine's ``DotProductAttention``, which "prefers cuDNN flash attention on Hopper+ architectures, and
  Tri Dao flash attention on pre-Hopper" (NeMo docs, memory_optimizations.rst, NVIDIA/NeMo PR 9188): the catalog
  gives cuDNN figures for Hopper and Blackwell parts only, so an A100 resolves to FA2. llm-foundry's 2023 benchmark sweep ran
  ``attn_impl: triton`` (``scripts/train/benchmarking/submit_benchmarks.py`` default and the ``mpt-*.yaml``
  configs at 061f2c7ce64e), the Triton FlashAttention. Megatron-LM of 2021-2022 (SC'21, Korthikanti et al.)
  and DeepSpeed's SC'21 runs of its model ran attention unfused (cuBLAS batched GEMMs over the whole ``s x s``
  around a fused softmax): no kernel figure, the calibrated fallback.
- **Loss kernel** (``cross_entropy``): what the cross-entropy holds around the backward's start. Tessera's runtime and
  torchtitan call torch's cross-entropy (fp32 log-probabilities saved, two more of their size in its backward; what
  capture measures). llm-foundry's MPT runs flash-attn's fused ``xentropy`` kernel (saves the logits as they come, one
  logits-sized gradient), Megatron-LM and DeepSpeed's SC'21 runs of its model Megatron's vocabulary-parallel
  cross-entropy (an fp32 softmax saved and overwritten by the gradient): ``stage_views.with_loss_kernel``. The fused
  kernel's fewer passes over the logits also shorten the elementwise time charged for them.
- **RMSNorm kernel** (``fused_rms_norm``): CUDA's fused ``torch.rms_norm`` (PyTorch 2.8 on, as Tessera's runtime
  runs on torch 2.13) and Transformer Engine's RMSNorm keep the norm's input alone for the backward; the composite
  that capture measures (and that torch ran on GPUs before, as in torchtitan's 2024 tables) keeps two fp32 tensors of
  its size: ``stage_views.with_fused_norms``, on GPUs only; nor does the fused kernel write them, so they come off the
  elementwise time too (``compute.stage_compute_s``).
- **Context-parallel exchange** (``cp_rotation``, ``cp_kv_repeated``). Tessera's runtime and Transformer Engine pass
  K/V blocks along a ring, each step hidden by the attention of the block before; PyTorch's ring attention, which
  torchtitan runs, all-gathers each layer's K/V behind its first block only (its default ``ALL_GATHER`` rotation),
  and torchtitan's 2024 Llama repeated them to every query head first (``TORCHTITAN_2024``, its published tables):
  ``cost_models.sparse.cp_comm_s`` and the gathered sequence's memory.
- **Expert all-to-alls** (``ep_dispatch``, ``ep_overlap``; ``cost_models.sparse``). Megatron-Core's ``alltoall``
  dispatcher and Tessera's runtime send a token's hidden state once for each chosen expert, in line with the compute;
  Megatron-Core's ``flex`` dispatcher with its DeepEP or HybridEP backend sends it once to each other node holding one
  of its experts and fans it out over NVLink there; Megatron-Bridge's ``moe_a2a_overlap``
  (``overlap_moe_expert_parallel_comm``) runs one micro-batch's all-to-alls beside another's compute. Both are a run's
  choice: off in the frameworks' own profiles, on in Megatron-Core's variants named for them (what an imported
  Megatron-LM command line with those flags runs: ``planner.frameworks.megatron_import``), and for a published row where its
  recipe states them (``benchmarks/published_rows.framework_profile``).
- **Megatron-LM of 2021-2022** (SC'21, Korthikanti et al.; ``MEGATRON_2021``). Without sequence parallelism its
  pipeline sends are scattered over the tensor-parallel ranks and gathered on arrival (``pp_scatter_gather``:
  ``communication.pp_comm_s``), and its default local DDP reduces gradients after the step's last backward,
  overlapping none of it (``dp_overlap``: ``communication.exposed_dp_comm_s`` with ``overlap`` off).
- **What selective recomputation re-runs** (``selective_policy``). Megatron recomputes the attention core
  (Korthikanti et al. 2022's selective recomputation; under a flash kernel, its forward). Tessera's runtime
  (``runtime.recompute``) keeps the outputs of every matmul (``aten.mm``, ``aten.addmm``) and of its collectives
  and re-runs everything else: the attention core, the norms, the activation functions, the residual adds and,
  under autocast, the casts (``matmuls``: its blocks keep their inputs and matmul outputs,
  ``LayerStats.saved_bytes_matmul_selective``, and under sequence parallelism its collectives' outputs:
  ``stage_views.as_selective_memory``; measured on 4 gloo ranks, ``benchmarks/memory_truth.py --pins``).
  torchtitan's ``selective_ac_option = "op"`` (the default of its Llama training configs) is an op-level policy
  instead: its checkpoint wrapper saves the outputs of ``aten.mm``, the SDPA kernels and the reduce-scatters,
  "except every second mm" (``parallelisms/parallelize_llama.py`` at 1ea476e9f, April 2024, the commit of its
  A100 tables, and at 9dec370, December 2024, the version its H100 tables name; ``distributed/activation_checkpoint.py``
  in 0.3.0), and recomputes everything else: the attention core is kept, and every second matmul of a block
  (``LayerStats.op_selective_recompute_flops``; in a Llama block wk, wo and w3: 36.5% of Llama 3 8B's linear
  FLOPs) and all of its elementwise work run again. Its blocks keep their inputs and the outputs of the other
  matmuls and of the attention cores (``LayerStats.saved_bytes_op_selective``; in a Llama block, per token, the
  input, the q, v, gate and down outputs, and the attention output and logsumexp: ``tests/graph/test_capture.py``),
  and one block's recomputed activations are live during its backward. Measured at tp = 1: under tensor
  parallelism the sequence-parallel gathers it recomputes are still charged as saved, and the reduce-scatter
  outputs it keeps are not; under context parallelism its blocks are still priced as re-running the K/V ring. A
  selective block not measured for it (replayed experts) in a stage with measured ones has its attention core
  re-run at the blocks' mixed rate. Published torchtitan runs (``benchmarks/published.py``) and torchtitan
  configurations (``tessera evaluate --from-torchtitan``, ``--runs-on torchtitan``) are priced with this profile.
"""

from __future__ import annotations

from dataclasses import replace

from tessera.cost_models.profile_fields import ImplementationProfile, ParameterGathering
from tessera.errors import ConfigError


DEEPSPEED_ZERO3_SLOWDOWN = 5.0
"""Fitted on SC'21 Table 2's DeepSpeed ZeRO-3 rows (``benchmarks/published.py`` prints the fit); re-fit there."""

TESSERA = ImplementationProfile(name="tessera", autocast_copies=True, fp8_cast_bytes_per_element=9.0,
                                fp8_casts_per_linear=True, fp8_all_gather=True, fp8_all_gather_under_tp=False, replicate_by_fsdp2=True,
                                selective_policy="matmuls", fused_rms_norm=True, attention_kernels=("cudnn", "fa2"),
                                cp_attention_kernels=("fa2",))
"""Tessera's runtime: FSDP2 for ZeRO-1 to 3 (``runtime.data_parallel``); ``nn.RMSNorm`` on torch 2.13, fused on
CUDA; SDPA at torch 2.13's default backend order, which puts cuDNN first on sm90 and sm100 parts (H100, H200,
B200) when the cuDNN it loads is newer than 9.15.0 (``check_prefer_cudnn_attention`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, in torch since 2.10; the cuDNN its wheels bundle crosses
that version from 2.11, as huggingface/transformers PR 48163 found, 2026-08-31) and FlashAttention-2 elsewhere (the
A100, whose catalog entry has no cuDNN figure); ``tests/gpu/test_cuda_smoke.py`` checks the choice where a GPU is lent.
Its context-parallel ring calls the flash kernel's op itself (``runtime.context_parallel``): FlashAttention-2 there; FP8 through torchao's float8 linears (``runtime.float8``), eager unless ``compile_blocks``: each casts its
input on its own, on the fly from the bf16/fp32 weight, bf16 inputs saved; ZeRO-3 all-gathers the blocks' FP8 weights in FP8 at current scaling without tensor parallelism (bf16
otherwise); its eager casts allocate 9 bytes per element cast (``tests/distributed/test_float8.py`` measures it with
``benchmarks/memory_meter.AllocatorMeter``)."""
TORCHTITAN = ImplementationProfile(name="torchtitan", tp_overlap_backward=False, autocast_copies=True,
                                   selective_policy="op", refused_together=(), model_limits=False,
                                   cp_rotation="allgather", fp8_casts_per_linear=True)
"""torchtitan: FSDP2, torchao float8 (``enable_fsdp_float8_all_gather`` off by default; eager, each linear casting
its input), async TP on the
forward only, op-level selective recomputation. Context parallelism through PyTorch's ring attention at its default
rotation, ``ALL_GATHER`` (``_ContextParallelOptions.rotate_method``, torch 2.6 to 2.13; torchtitan's
``--experimental.context_parallel_rotate_method`` defaulted to ``allgather`` too, ``torchtitan/config_manager.py`` at
eaea6f6a2fa9); its models pass grouped K/V to SDPA with ``enable_gqa`` (``models/common/attention.py``, 2026)."""
AUTOMODEL = replace(TORCHTITAN, name="automodel", gradient_bytes=2, fused_rms_norm=True, master_bytes=2)
"""NVIDIA NeMo AutoModel's FSDP2 training (``nemo_automodel``, 2026): FSDP2 with PyTorch's context-parallel ring on its
all-gather rotation, as torchtitan (``components/distributed/cp_utils.py`` passes ``allgather``, and under context
parallelism restricts SDPA to the flash and memory-efficient kernels: FlashAttention-2 on Hopper); its default FSDP2
mixed-precision policy reduces in bf16 (``components/distributed/config.py``: param and reduce dtype bf16);
transformers' SDPA attention, grouped keys and values passed as they are (no mask: ``enable_gqa``); its RMSNorm
(``Float32RMSNorm``, ``components/models/common/utils.py``) a ``torch.compile(fullgraph=True)`` function, one kernel
that writes no fp32 copies; the loss over fp32 logits (``MaskedCrossEntropy``'s default upcast). What compiling its
layers fuses besides (its gated MLP's activation and product) is not priced, as for torchtitan's compiled runs. Its
benchmark config loads the model in bf16 (``torch_dtype: bf16``) and steps it with Transformer Engine's ``FusedAdam`` at
its defaults, no master weights and fp32 moments (``master_weights=False``, ``exp_avg_dtype=torch.float32``):
``master_bytes`` 2, ``moment_bytes`` 4."""
AUTOMODEL_MOE = replace(AUTOMODEL, name="automodel-moe", gradient_bytes=4, master_bytes=2, moment_bytes=2,
                        attention_kernels=("cudnn", "fa2"), ep_dispatch="per-node", pipeline_keeps_outputs=True)
"""NeMo AutoModel's own MoE models (``nemo_automodel/components/moe``, 2025) on its benchmark configs' Transformer
Engine backends: attention by Transformer Engine (cuDNN on Hopper), its fused RMSNorm, DeepEP's dispatch (a token
sent once to each other node holding one of its experts); FSDP2 under its MoE parallelizer's mixed-precision policy,
which reduces in fp32 (``moe/parallelizer.py``, ``apply_fsdp``), and keeps every block's gathered weights under
pipelining (``reshard_after_forward=not pp_enabled``). It trains the bf16 model itself: its DeepSeek-V3's
``initialize_weights`` ends in ``self.to(torch.bfloat16)`` (``models/deepseek_v3/model.py`` at 89e3a9fdd), and its
benchmark configs' ``torch.optim.Adam`` keeps bf16 moments beside it, no master copy (``master_bytes``,
``moment_bytes`` 2). Its gradients are not all fp32 either: the experts, which FSDP leaves alone where ep equals
dp, keep bf16 ones, and FSDP2 casts each reduced gradient shard back to the parameters' bf16; only the unsharded
accumulation under pipelining is fp32. ``gradient_bytes`` is one dtype for all, so 4 here: the accumulation is
what the peak holds. Under pipelining it keeps the logits of every micro-batch of a schedule call
(``pipeline_keeps_outputs``: its recipes call ``schedule.step`` without ``return_outputs=False``)."""
TORCHTITAN_COMPILED = replace(TORCHTITAN, name="torchtitan-compiled", cross_entropy="compiled",
                              fp8_casts_per_linear=False)
"""torchtitan with ``compile.enable`` and ``loss`` among ``compile.components`` (0.3.0's default, ``["model", "loss"]``):
it compiles the loss too (``components/loss.py``, ``BaseLoss._maybe_compile``; since mid-2025), one fused kernel
on the logits (``stage_views.CROSS_ENTROPY_KERNELS``)."""
TORCHTITAN_2024 = replace(TORCHTITAN, name="torchtitan-2024", cp_kv_repeated=True, fp8_casts_per_linear=False)
"""torchtitan as its 2024 performance tables ran it: its Llama repeated K/V to every query head before SDPA
(``models/llama/model.py``: ``repeat_kv``, at 1ea476e9f and eaea6f6a2fa9), so context parallelism moved them so.
Its published FP8 rows ran compiled (the 2024 tables' "torch.compile + Float8", the 2025 async-TP runs, which need
it, and the H200 runs' ``--training.compile``): one cast per distinct input."""
PYTORCH_FSDP_TE = ImplementationProfile(name="fsdp-te", fp8_saves_inputs=True, weight_fp8_bytes=2.0,
                                        backward_prefetch="post", attention_kernels=("fa-triton",),
                                        cross_entropy="flash-attn", refused_together=(), model_limits=False)
"""PyTorch FSDP1 under MosaicML Composer (llm-foundry): ``BACKWARD_POST`` prefetch, Transformer Engine linears
under ``amp_fp8``, the Triton FlashAttention (``attn_impl: triton``), and flash-attn's fused cross-entropy
(``llmfoundry/models/mpt/modeling_mpt.py`` at 061f2c7ce64e: ``loss_fn`` defaults to ``fused_crossentropy``,
``flash_attn.losses.cross_entropy.CrossEntropyLoss``, which saves the bf16 logits and a log-sum-exp per token and
whose backward returns a new logits-sized gradient, ``inplace_backward`` off by default). A run under Composer's
``PURE`` FSDP mixed precision (``reduce_dtype`` the training dtype, bf16) reduces in bf16: ``gradient_bytes`` 2 there
(``benchmarks/published_rows.framework_profile``)."""
MEGATRON = ImplementationProfile(name="megatron", fp8_saves_inputs=True, weight_fp8_bytes=2.0, zero_stages=(0, 1),
                                 attention_kernels=("cudnn", "fa2"), cross_entropy="megatron", fused_rms_norm=True,
                                 fused_declared_norms=True, fused_gated_activation=True, cp_ring_slowdown=False, refused_together=(),
                                 model_limits=False,
                                 offload_copies_overlap=True, offload_buffered=False, fused_optimizer=True,
                                 contiguous_grad_buffer=True)
"""Megatron-Core / NeMo: Transformer Engine for FP8, attention (cuDNN on Hopper, FA2 before) and RMSNorm (fused);
its vocabulary-parallel cross-entropy (``megatron/core/tensor_parallel/cross_entropy.py``, fused or not: an fp32 copy
of the logits turned into the softmax in place and saved, the backward's gradient written over it)."""
NEMO_2024 = replace(MEGATRON, name="nemo-2024", gradient_bytes=2, attention_kernels=("fa2",))
"""Megatron-Core as NeMo's launcher ran it (NVIDIA/NeMo-Framework-Launcher, containers 24.03.01 and 24.07, whence the
name). Its recipes reduce gradients in bf16: the Llama 2 7B FP8 example at tag 24.03.01
(examples/training/llama/h100/llama2_7b_fp8.sh) passes ``+training.model.optim.grad_sync_dtype=bf16``, and at tag
24.07 every GPT and Llama H100 example script (examples/training/{gpt,llama}/h100/*.sh, bf16 and fp8) and the GPT-3
175B FP8 config (launcher_scripts/conf/training/gpt3/175b_fp8.yaml) do. Its attention is FlashAttention-2, not
cuDNN: the launcher's ``launcher_scripts/conf/config.yaml`` at both tags sets ``NVTE_FUSED_ATTN: 0`` for every job
("Disable cudnn FA until we've tested it more"; gone at 24.09), which leaves Transformer Engine (1.3-1.8 there) the
flash-attn package where it prefers cuDNN on Hopper (since 1.2), context-parallel rings included."""
MEGATRON_BRIDGE = replace(MEGATRON, name="megatron-bridge", gradient_bytes=2, fp8_params=True, fp8_all_gather=True)
"""Megatron-Core under Megatron-Bridge's performance scripts (containers 25.11 and 26.04.01): its
``scripts/performance/configs/llama*/`` set ``grad_reduce_in_fp32`` False (tags v0.2.0 and v0.4.1), so gradients
reduce in bf16; attention as Transformer Engine chooses it (``attention_backend`` auto: cuDNN on Hopper)."""
MEGATRON_EP_OVERLAP = replace(MEGATRON, name="megatron-ep-overlap", ep_overlap=True)
"""Megatron-Core with ``--overlap-moe-expert-parallel-comm``: the expert all-to-alls beside another micro-batch."""
MEGATRON_DEEPEP = replace(MEGATRON, name="megatron-deepep", ep_dispatch="per-node")
"""Megatron-Core's ``flex`` dispatcher (``--moe-token-dispatcher-type flex --moe-enable-deepep``): DeepEP, a token
sent once to each other node holding one of its experts."""
MEGATRON_DEEPEP_EP_OVERLAP = replace(MEGATRON_DEEPEP, name="megatron-deepep-ep-overlap", ep_overlap=True)
"""Both."""
MEGATRON_2021 = replace(MEGATRON, name="megatron-2021", attention_kernels=(), fused_rms_norm=False,
                        fused_declared_norms=False, fused_gated_activation=False, pp_scatter_gather=True, dp_overlap=False,
                        offload_copies_overlap=False, offload_buffered=True)  # no activation offload then
"""Megatron-LM as SC'21 and Korthikanti et al. (2022) ran it: unfused attention (its GPT models norm with LayerNorm),
pipeline sends scattered over the tensor-parallel ranks and gathered on arrival, gradients all-reduced after the
backward."""
DEEPSPEED_2021_GATHERING = ParameterGathering(live_params=1e9, prefetch_params=5e7, reduce_bucket_params=5e8)
"""DeepSpeed's stage-3 defaults of 2021 (``deepspeed/runtime/zero/constants.py``: ``stage3_max_live_parameters``
1e9, ``stage3_prefetch_bucket_size`` 5e7, ``reduce_bucket_size`` 5e8); SC'21 states no ZeRO configuration."""
DEEPSPEED = ImplementationProfile(name="deepspeed", zero3_comm_slowdown=DEEPSPEED_ZERO3_SLOWDOWN, attention_kernels=(),
                                  cross_entropy="megatron", zero3_by_parameter=DEEPSPEED_2021_GATHERING,
                                  refused_together=(), model_limits=False)
"""DeepSpeed ZeRO-3 as SC'21 measured it (Megatron-LM's model code: unfused attention), gathering parameter by
parameter within its default limits."""

PROFILES = {p.name: p for p in (TESSERA, TORCHTITAN, TORCHTITAN_COMPILED, TORCHTITAN_2024, AUTOMODEL, AUTOMODEL_MOE, PYTORCH_FSDP_TE, MEGATRON,
                                 MEGATRON_EP_OVERLAP, MEGATRON_DEEPEP, MEGATRON_DEEPEP_EP_OVERLAP, NEMO_2024,
                                 MEGATRON_BRIDGE, MEGATRON_2021, DEEPSPEED)}
"""Every profile by name."""


ADJUSTABLE: dict[str, tuple[object, ...]] = {
    "dp_overlap": (True, False), "gradient_bytes": (2, 4), "master_bytes": (2, 4), "moment_bytes": (2, 4),
    "fp8_params": (True, False), "fp8_all_gather": (True, False),
}
"""The behaviours a framework's own configuration sets for one run, and their values: a profile adjusted so is named
``name:field=value,...`` (``megatron:dp_overlap=false``; :func:`profile`). Megatron-LM's flags set them
(``--overlap-grad-reduce``, ``--grad-reduce-in-bf16``, the precision-aware optimizer's dtypes,
``--fp8-param-gather``: ``planner.frameworks.megatron_import``); the other fields are facts of the framework's code."""


def profile(name: str) -> ImplementationProfile:
    """The profile called ``name``, or one adjusted by its configuration (``megatron:dp_overlap=false,moment_bytes=2``:
    :data:`ADJUSTABLE`); an unknown name or field lists the known ones."""
    base, _, changes = name.partition(":")
    if base not in PROFILES:
        raise ConfigError(f"unknown implementation profile {base!r}; known: {', '.join(PROFILES)}")
    if not changes:
        return PROFILES[base]
    if base == TESSERA.name:
        raise ConfigError(f"{name!r}: Tessera's runtime does what its code does; adjust another framework's profile "
                          f"(e.g. 'megatron:{changes}')")
    values = dict(_adjustment(item, name) for item in changes.split(","))
    return replace(PROFILES[base], name=adjusted_name(base, values), **values)


def adjusted_name(base: str, values: dict[str, object]) -> str:
    """``base`` adjusted by ``values`` as :func:`profile` reads it, fields in :data:`ADJUSTABLE`'s order (``base`` alone
    when there are none)."""
    items = [f"{field}={str(values[field]).lower()}" for field in ADJUSTABLE if field in values]
    return f"{base}:{','.join(items)}" if items else base


def _adjustment(item: str, name: str) -> tuple[str, object]:
    field, _, text = item.partition("=")
    if field not in ADJUSTABLE:
        raise ConfigError(f"{name!r}: {field!r} is not a behaviour a configuration sets; adjustable: "
                          f"{', '.join(ADJUSTABLE)}")
    by_text = {str(value).lower(): value for value in ADJUSTABLE[field]}
    if text.lower() not in by_text:
        raise ConfigError(f"{name!r}: {field}={text!r} is not one of {', '.join(by_text)}; give one of them")
    return field, by_text[text.lower()]
