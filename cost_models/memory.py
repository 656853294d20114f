"""Per-device memory of one pipeline stage, by category, as Tessera's runtime holds it.

Model state per parameter (mixed precision keeps fp32 masters): fp32 parameters (4 B), fp32 gradients
(4 B) and two fp32 Adam moments (8 B); a framework that trains the bf16 model itself holds masters and moments
in bf16 (``ImplementationProfile.master_bytes``, ``moment_bytes``: :func:`with_optimizer_state_bytes`). Tessera's
runtime (``runtime.data_parallel``) holds them as follows: ZeRO-0 is DDP (plus a bucket copy of the gradients) or
FSDP2 ``replicate``; ZeRO-1/2 are FSDP2 with ``reshard_after_forward=False`` (fp32 masters and moments 1/dp, the
gathered parameters kept whole from forward to backward; ZeRO-1 accumulates the unsharded gradient over
micro-batches, ZeRO-2 its shard);
ZeRO-3 gathers one block at a time (plus one prefetched), and the root layers for the forward and again for
the backward.
Mixed precision on a model no FSDP unit wraps runs by ``torch.autocast`` (:func:`autocasts`): every micro-batch
then holds a compute-dtype copy of each local weight from its forward until its backward is done (except the
recomputed blocks', :func:`autocast_copied_params`), and activations as capture measured them under autocast
(:func:`as_run`).
Tensor parallelism divides blocks and vocabulary matrices.
Expert parallelism divides routed experts by ``ep``; the "data-parallel axis" of a kind of state is the ranks
holding the same weights: ``dp * cp`` for dense, ``(dp / ep) * cp`` for expert state (``cost_models.sparse``).
Context parallelism divides activations by ``cp`` (each rank keeps ``s / cp`` tokens).

A step has two high-water marks (:func:`stage_memory` reports the higher): the start of the backward of the
last in-flight micro-batch (all activations saved, the loss's temporaries, gradients of earlier micro-batches)
and the end of the backward (complete gradients, the pipeline's merged outputs, optimizer temporaries). Each
term's docstring says which torch behaviour it stands for; ``benchmarks/memory_truth.py`` checks them against
the CPU allocator on real gloo ranks.

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, Sec. 4): without sequence parallelism, the inputs of norms and the residual stream
(10 of the 34 ``sbh`` bytes per layer) are replicated on every tensor-parallel rank; with it everything
is divided by ``tp``, except the inputs PyTorch's sequence parallelism all-gathers and saves whole
(:func:`sp_gathered_input_bytes`).

The building blocks (local shares, runtime paths, the loss's tensors) are ``cost_models.memory_state``'s; the
buffers that come and go in the data-parallel machinery (buckets, optimizer temporaries, gradient accumulation and
reductions, ZeRO-3's gathers) ``cost_models.memory_transients``'.
"""

from __future__ import annotations

from dataclasses import replace

from tessera.cost_models.fp8 import saved_input_reduction_bytes
from tessera.cost_models.memory_state import (
    FP32, block_params, compute_dtype_bytes, held_gradient_bytes, kept_local_params, local_params, loss_gradient_bytes,
    replicated_embedding_gradient_params, uses_fsdp2_replicate,
)
from tessera.cost_models.memory_transients import (
    accumulation_bytes, ddp_bucket_bytes, gloo_staging_bytes, optimizer_temporary_bytes, parameter_gathered_bytes,
    replicate_reduction_bytes,
    zero3_gathered_bytes, zero12_reduce_scatter_bytes,
)
from tessera.cost_models.partition import StageTotals
from tessera.cost_models.pipeline import in_flight_micro_batches, micro_batches_per_call
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.cost_models.sparse import ring_and_dispatch_buffer_bytes, sharded_params
from tessera.cost_models.stage_views import (
    FUSED_CROSS_ENTROPY, as_selective_memory, with_fused_gates, with_fused_declared_norms, with_fused_norms, with_loss_kernel,
)
from tessera.cost_models.types import Strategy, TrainingConfig

GiB = 2**30
REPLICATED_ACTIVATION_SHARE = 10 / 34  # Korthikanti et al. eq. 2: sbh(10 + 24/t) of sbh*34 without SP
# Allowance outside tensors: CUDA context, NCCL buffers and allocator fragmentation (~2 GiB on GPUs,
# a stated assumption); a CPU rank costs ~220 MB before any model (shared/PLATFORM-NOTES.md).
GPU_RESERVE_BYTES = 2 * GiB
CPU_RESERVE_BYTES = 256 * 2**20


def stage_memory(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool,
    profile: ImplementationProfile = TESSERA,
) -> dict[str, int]:
    """Peak bytes on one device of ``stage`` by category: the higher of the step's two high-water marks.

    A step peaks either where the backward of its last in-flight micro-batch starts (:func:`backward_memory`:
    every saved activation alive, the loss gradient just materialised) or after the backward
    (:func:`step_end_memory`: activations freed, gradients complete, the pipeline's outputs merged, the
    optimizer stepping). Large activations put the peak at the first, large model state at the second.
    The stage's ``index`` matters only through ``in_flight_micro_batches`` (``estimate`` relies on it).
    """
    reserve = CPU_RESERVE_BYTES if on_cpu else GPU_RESERVE_BYTES
    marks = memory_marks(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu, profile=profile)
    peak = max(marks, key=lambda mark: sum(mark.values()))
    return {**{name: max(0, int(value)) for name, value in peak.items()}, "reserve": reserve}


def memory_marks(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool,
    profile: ImplementationProfile = TESSERA,
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`stage_memory`'s two high-water marks by category (the backward's start, the step's end), reserve
    aside."""
    stage = norms_as_run(as_run(stage, training, strategy, profile), profile, on_cpu=on_cpu)
    stage = as_selective_memory(stage, profile.selective_policy, tp=strategy.tp,
                                sp=strategy.sp and not strategy.sp_regather)
    if on_cpu and stage.offloaded_bytes:  # a CPU rank's device memory is the host's: offloading frees nothing
        stage = replace(stage, saved_bytes=stage.saved_bytes + stage.offloaded_bytes, offload_buffer_bytes=0)
    elif not profile.offload_buffered:  # reloads land where the kept blocks' backward freed memory
        stage = replace(stage, offload_buffer_bytes=0)
    block_gather_bytes = 1 if profile.gathers_fp8(training, strategy) else None
    copies = autocast_copy_bytes(stage, training, strategy, profile)
    marks = (backward_memory(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu,
                             block_gather_bytes=block_gather_bytes, profile=profile),
             step_end_memory(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu, profile=profile,
                             autocast_copies=copies))
    if training.precision == "fp8":
        marks = tuple(with_fp8_state(mark, stage, training, strategy, micro_batches=micro_batches, profile=profile,
                                     in_backward=mark is marks[0], on_cpu=on_cpu) for mark in marks)
    if profile.gradient_bytes != FP32:  # gradients held in the framework's reduction dtype
        marks = tuple(dict(mark, gradients=mark["gradients"] * profile.gradient_bytes / FP32) for mark in marks)
    if (profile.master_bytes, profile.moment_bytes) != (FP32, FP32):
        marks = tuple(with_optimizer_state_bytes(mark, stage, strategy, profile) for mark in marks)
    if copies:  # the compute-dtype weight copies live until the backward is done
        marks = (dict(marks[0], parameters=marks[0]["parameters"] + copies), marks[1])
    return marks


def with_optimizer_state_bytes(mark: dict, stage: StageTotals, strategy: Strategy,
                               profile: ImplementationProfile) -> dict:
    """A high-water mark with the optimizer's state in ``profile``'s dtypes: the parameters it steps on
    (``master_bytes``) and Adam's two moments (``moment_bytes``), where the marks count fp32 for both."""
    return dict(mark, parameters=mark["parameters"] - master_params(stage, strategy) * (FP32 - profile.master_bytes),
                optimizer=mark["optimizer"] * profile.moment_bytes / FP32)


def with_fp8_state(
    mark: dict, stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int,
    profile: ImplementationProfile, in_backward: bool, on_cpu: bool = False,
) -> dict:
    """A high-water mark under FP8 as ``profile`` holds it: FP8 weight copies of the blocks' linears kept across
    micro-batches (Transformer Engine: the weight and its transpose), the linears' inputs saved in FP8 instead
    of bf16 (ZeRO-3's blocks gathered in FP8 are :func:`backward_memory`'s; those kept gathered to their backward
    hold FP8 too without tensor parallelism, as measured on Tessera's runtime: ``benchmarks/memory_truth.py
    --models wide-short --pins``; torchtitan's 405B rows at tp 8 fit bf16 copies instead). The casts' temporaries
    live inside a block's backward, gloo's staged copy of a reduce-scatter's input inside the reduce-scatter: the
    larger counts. A framework whose weights are FP8 tensors keeps no copies beside them (``profiles.fp8_params``)."""
    copies = 0.0 if profile.fp8_params else profile.weight_fp8_bytes
    updated = dict(mark, parameters=mark["parameters"] + copies * block_params(stage, strategy))
    if not in_backward:
        return updated
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    saved_less = saved_input_reduction_bytes(stage, training, saves_fp8_inputs=profile.fp8_saves_inputs)
    updated["activations"] -= saved_less * strategy.micro_batch * in_flight * tp_activation_share(strategy) / strategy.cp
    gathers_fp8 = profile.gathers_fp8(training, strategy)
    shards = strategy.dp * strategy.cp if gathers_fp8 else 1  # FSDP2's shard group (runtime.mesh.data_mesh)
    cast = profile.fp8_cast_bytes_per_element * fp8_cast_elements(stage, training, strategy, weight_shards=shards)
    updated["buffers"] += max(0.0, cast - gloo_staging_bytes(stage, strategy, on_cpu=on_cpu))
    if gathers_fp8 and strategy.tp == 1:  # blocks kept gathered hold their FP8 weights, 1 byte each
        updated["parameters"] -= kept_local_params(stage, strategy) * (compute_dtype_bytes(training) - 1)
    return updated


def fp8_cast_elements(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, weight_shards: int = 1,
) -> float:
    """Elements of the largest tensor one FP8 cast reads on a device: a micro-batch's widest matmul activation (its
    tokens, split by cp, times the widest matrix dimension split by tp, or times the hidden size, which a column
    linear's input and a row linear's output gradient keep whole on every tp rank) or the largest weight (by tp, and
    by ``weight_shards`` where weights are cast as ZeRO-3 shards before an FP8 all-gather)."""
    tokens = strategy.micro_batch * training.seq_len / strategy.cp
    width = max(stage.widest_matrix_dim / strategy.tp, stage.hidden_size)
    return max(tokens * width, stage.largest_matrix_params / (strategy.tp * weight_shards))


def backward_memory(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool = False,
    block_gather_bytes: float | None = None, profile: ImplementationProfile = TESSERA,
) -> dict:
    """Bytes by category when the backward of the stage's last in-flight micro-batch starts (ZeRO-3's gathered
    blocks at ``block_gather_bytes`` per parameter: the compute dtype's unless the framework gathers FP8; or its
    parameters one by one, within ``profile.zero3_by_parameter``'s limits; the cp exchange's buffers as
    ``profile`` moves K/V)."""
    buffered = whole_grad_buffer(strategy, profile)  # allocated whole for the run, not per step
    return {
        "parameters": parameter_bytes(stage, training, strategy, in_backward=True,
                                      compute_weights_kept=profile.contiguous_grad_buffer),
        "gradients": (full_gradient_bytes(stage, strategy, dtensor=False) if buffered
                      else held_gradient_bytes(stage, strategy, micro_batches=micro_batches)),
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": activation_bytes(stage, strategy, micro_batches=micro_batches)
        + _loss_and_recomputation_bytes(stage, strategy, on_cpu=on_cpu),
        "buffers": (_buffer_bytes(stage, training, strategy, on_cpu=on_cpu, block_gather_bytes=block_gather_bytes,
                                  profile=profile)
                    + pipeline_output_bytes(stage, strategy, micro_batches=micro_batches,
                                            keeps_outputs=profile.pipeline_keeps_outputs)),
    }


def step_end_memory(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool,
    profile: ImplementationProfile = TESSERA, autocast_copies: float = 0.0,
) -> dict:
    """Bytes by category after the backward: reduced gradients, merged pipeline outputs, and the largest of what
    comes and goes around them as ``profile`` runs: optimizer temporaries, FSDP2 ``replicate``'s reduction, or what
    autograd's own accumulation holds at the backward's end (beside ``autocast_copies``,
    :func:`autocast_copy_bytes`)."""
    # ZeRO-0 keeps the full gradient; every FSDP2 stage (1-3) reduce-scatters it to the 1/dp shard it steps on; a
    # contiguous buffer (Megatron-Core's) stays whole below ZeRO-3, reduced in place.
    if strategy.zero == 0 or whole_grad_buffer(strategy, profile):
        gradients = full_gradient_bytes(stage, strategy, dtensor=not profile.contiguous_grad_buffer)
    else:
        gradients = sharded_params(stage, strategy, from_zero=1) * FP32
    merged = merged_pipeline_output_bytes(stage, strategy, micro_batches=micro_batches,
                                          keeps_outputs=profile.pipeline_keeps_outputs)
    # The optimizer peaks in its step, FSDP2's replicate in its reduction, autograd's accumulation in the backward.
    fused = profile.fused_optimizer and not on_cpu
    transient = [0.0 if fused else optimizer_temporary_bytes(stage, strategy, on_cpu=on_cpu) * profile.moment_bytes / FP32]
    if profile.replicate_by_fsdp2:
        transient.append(replicate_reduction_bytes(stage, training, strategy, micro_batches=micro_batches))
    if profile.autocast_copies:
        transient.append(accumulation_bytes(stage, training, strategy, micro_batches=micro_batches,
                                            copies=autocast_copies))
    return {
        "parameters": parameter_bytes(stage, training, strategy, in_backward=False,
                                      compute_weights_kept=profile.contiguous_grad_buffer),
        "gradients": gradients,
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": 0.0,
        "buffers": (fp32_gradient_copy_bytes(stage, strategy, profile) if profile.contiguous_grad_buffer
                    else ddp_bucket_bytes(stage, strategy)) + merged + max(transient),
    }


def fp32_gradient_copy_bytes(stage: StageTotals, strategy: Strategy, profile: ImplementationProfile) -> float:
    """The fp32 copy of the 16-bit main gradients Megatron-Core's optimizer steps on, its shard's under the distributed
    optimizer (``main_grad.float()``, ``optimizer.py`` and ``distrib_optimizer.py`` at core_v0.14.0; the 4 of its
    table's fp16 row, 20 and 4 + 16/d bytes a parameter). The precision-aware optimizer reads the 16-bit gradients
    without it, which is priced with it."""
    if not whole_grad_buffer(strategy, profile) or profile.gradient_bytes == FP32:
        return 0.0
    return sharded_params(stage, strategy, from_zero=1) * FP32


def whole_grad_buffer(strategy: Strategy, profile: ImplementationProfile) -> bool:
    """Whether the gradients sit in the framework's contiguous buffer over every local parameter, reduced in place
    (``profiles.contiguous_grad_buffer``): under DDP and the distributed optimizer (ZeRO-0/1); Megatron-FSDP's
    ZeRO-2 and 3 shard them."""
    return profile.contiguous_grad_buffer and strategy.zero <= 1


def full_gradient_bytes(stage: StageTotals, strategy: Strategy, *, dtensor: bool = True) -> float:
    """fp32 gradients of every local parameter (the reduction's dtype scales them: ``profiles.gradient_bytes``), with
    the whole-vocabulary gradient DTensor gives a tensor-parallel embedding where the model runs on DTensor."""
    extra = replicated_embedding_gradient_params(stage, strategy) if dtensor else 0.0
    return (local_params(stage, strategy) + extra) * FP32


def parameter_bytes(stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, in_backward: bool,
                    compute_weights_kept: bool = False) -> float:
    """fp32 master parameters, plus, for the FSDP2 paths that keep them between forward and backward, the
    gathered copy.

    FSDP2 shards the parameters of ZeRO-1/2 too (``runtime.data_parallel``: ``fully_shard`` with
    ``reshard_after_forward=False``): the fp32 masters are 1/dp at rest, and the all-gathered parameters (a
    separate storage in the compute dtype, ``FSDPParam.alloc_all_gather_outputs``) stay alive from each unit's
    forward until its backward has run (``reshard_after_forward=False``), so at the backward's start all of
    them are. FSDP2's ``replicate`` (ZeRO-0 with tp/pp/cp/ep) is the same machinery over a shard group of one
    rank: masters whole, and the same unsharded copy. ZeRO-3's gathered blocks are transient (``_buffer_bytes``);
    a ZeRO-3 block that keeps its gathered weights (``Strategy.block_reshard`` False) holds that copy likewise.
    ``compute_weights_kept``: a framework keeps the compute-dtype weights beside the masters below ZeRO-3, between
    steps too (``profiles.contiguous_grad_buffer``).
    """
    masters = master_params(stage, strategy) * FP32
    kept = compute_weights_kept and strategy.zero < 3
    if kept and compute_dtype_bytes(training) == FP32:  # fp32 weights are their own masters: no second copy
        return local_params(stage, strategy) * FP32
    if kept or (in_backward and (strategy.zero in (1, 2) or uses_fsdp2_replicate(strategy))):
        return masters + local_params(stage, strategy) * compute_dtype_bytes(training)
    if in_backward and strategy.zero == 3:
        return masters + kept_local_params(stage, strategy) * compute_dtype_bytes(training)
    return masters


def master_params(stage: StageTotals, strategy: Strategy) -> float:
    """Elements of the parameters the optimizer steps on, on one device: FSDP2's 1/dp shard under ZeRO-1 to 3."""
    return sharded_params(stage, strategy, from_zero=1 if strategy.zero in (1, 2) else 3)


def autocasts(training: TrainingConfig, strategy: Strategy, profile: ImplementationProfile) -> bool:
    """Whether mixed precision runs by ``torch.autocast`` (``ImplementationProfile.autocast_copies``): bf16/fp16/fp8
    on a model no FSDP unit wraps, ZeRO-0 without FSDP2's ``replicate`` (``runtime.parallel_model._autocast``)."""
    return (profile.autocast_copies and training.precision in ("bf16", "fp16", "fp8") and strategy.zero == 0
            and not uses_fsdp2_replicate(strategy))


def as_run(stage: StageTotals, training: TrainingConfig, strategy: Strategy, profile: ImplementationProfile) -> StageTotals:
    """``stage`` with its activations as the runtime holds them: where it autocasts (:func:`autocasts`), as capture
    measured them under autocast (an fp32 residual stream and stage boundary, a bf16 cast per linear), and its loss as
    the framework computes it (:func:`loss_as_run`)."""
    if stage.autocast is not None and autocasts(training, strategy, profile):
        stage = replace(stage.autocast, index=stage.index)  # the index may have been set on the outer totals only
    return loss_as_run(stage, strategy, profile)


def loss_as_run(stage: StageTotals, strategy: Strategy, profile: ImplementationProfile) -> StageTotals:
    """``stage`` with its loss run by the framework's cross-entropy kernel (``profiles.cross_entropy``); flash-attn's
    fused one only without tensor parallelism, where such a framework runs torch's ``loss_parallel``."""
    kernel = profile.cross_entropy
    return with_loss_kernel(stage, "torch" if kernel in FUSED_CROSS_ENTROPY and strategy.tp > 1 else kernel)


def norms_as_run(stage: StageTotals, profile: ImplementationProfile, *, on_cpu: bool) -> StageTotals:
    """``stage`` with its ``torch.rms_norm`` calls, declared RMSNorm layers and gated MLPs as the framework runs them:
    fused kernels on a GPU where the framework calls them (``profiles.fused_rms_norm``,
    ``profiles.fused_declared_norms``, ``profiles.fused_gated_activation``); CPU ranks run the composites that
    capture measured."""
    if on_cpu:
        return stage
    hit = _AS_RUN.get((id(stage), id(profile)))
    if hit is not None and hit[0] is stage and hit[1] is profile:
        return hit[2]
    as_run = stage
    if profile.fused_rms_norm:
        as_run = with_fused_norms(as_run, profile.selective_policy)
    if profile.fused_declared_norms:
        as_run = with_fused_declared_norms(as_run, profile.selective_policy)
    if profile.fused_gated_activation:
        as_run = with_fused_gates(as_run, profile.selective_policy)
    if len(_AS_RUN) >= 65536:
        _AS_RUN.clear()
    _AS_RUN[(id(stage), id(profile))] = (stage, profile, as_run)
    return as_run


_AS_RUN: dict[tuple[int, int], tuple[StageTotals, ImplementationProfile, StageTotals]] = {}
"""``norms_as_run``'s answers by the identity of the stage and the profile (a search prices the same memoised stage
totals under thousands of strategies); a hit is trusted only while the same objects are held."""


def autocast_copy_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, profile: ImplementationProfile
) -> float:
    """Bytes of the compute-dtype weight copies autocast makes (0 where it does not run). Its cache keeps them until
    the context exits: the runtime wraps the forward alone, so each goes once its layer's backward has used it,
    except under a pipeline schedule, which runs every backward inside the context too
    (``runtime.parallel_model``): there they last to the step's last backward
    (``memory_transients.accumulation_bytes``)."""
    if not autocasts(training, strategy, profile):
        return 0.0
    return autocast_copied_params(stage, training, strategy) * compute_dtype_bytes(training)


def autocast_copied_params(stage: StageTotals, training: TrainingConfig, strategy: Strategy) -> float:
    """Local parameters autocast keeps a compute-dtype copy of to the backward: all of them, except the blocks'
    under fp8 (their FP8 linears cast the weight straight to FP8 on each use, ``runtime.float8``; the norms inside
    them are few) and, outside a pipeline, those of blocks recomputed in part or whole: a checkpointed region
    saves none of its casts, so autocast's cache lets them go when the forward's context exits, and the
    recomputation casts one block again at a time (measured: small-gpt's DDP with full recomputation,
    ``benchmarks/memory_truth.py --pins``; the one block's copy that a recomputation holds is left out, small beside
    the rest). A pipeline schedule runs its backward inside the context as well, whose cache keeps every cast to
    the end."""
    blocks = block_params(stage, strategy)
    if training.precision == "fp8":
        return local_params(stage, strategy) - blocks
    all_blocks = stage.sharded_params + stage.replicated_params - stage.root_sharded_params - stage.root_replicated_params
    if strategy.pp > 1 or not all_blocks:
        return local_params(stage, strategy)
    return local_params(stage, strategy) - blocks * stage.recomputed_block_params / all_blocks


def pipeline_output_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int,
                          keeps_outputs: bool = False) -> float:
    """A pipeline stage's forward outputs that ``torch.distributed.pipelining`` keeps during the backward phase.

    Each stage keeps the output of every in-flight micro-batch (``fwd_cache``: its backward starts from it):
    the boundary activation, or on the last stage the logits (which autograd alone would not keep: the loss
    saves its log-probabilities). Where the framework ``keeps_outputs`` (``profiles.pipeline_keeps_outputs``), the
    last stage also keeps every micro-batch's logits of the schedule call for its merged output
    (:func:`merged_pipeline_output_bytes`).
    """
    if strategy.pp == 1:
        return 0.0
    if stage.logits_bytes:
        kept = micro_batches_per_call(strategy, micro_batches) if keeps_outputs else 1
        return stage.logits_bytes * strategy.micro_batch * kept / (strategy.tp * strategy.cp)
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    return stage.boundary_bytes * strategy.micro_batch * in_flight / strategy.cp


def merged_pipeline_output_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int,
                                 keeps_outputs: bool = False) -> float:
    """The last stage's outputs at the end of a schedule call, where the framework ``keeps_outputs`` (Tessera's
    runtime does not: it passes ``return_outputs=False``). With pipelining's default ``return_outputs=True``,
    pipelining keeps each micro-batch's output (``stage.output_chunks``) until the call ends and concatenates
    them (``_PipelineSchedule._merge_outputs`` -> ``merge_chunks``: ``torch.cat``): the call's logits, twice during
    the merge.
    """
    if strategy.pp == 1 or not stage.logits_bytes or not keeps_outputs:
        return 0.0
    per_call = micro_batches_per_call(strategy, micro_batches)
    return 2 * stage.logits_bytes * strategy.micro_batch * per_call / (strategy.tp * strategy.cp)


def activation_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """Activations a stage's in-flight micro-batches hold (what one block's recomputation and offloaded blocks in
    transit add: :func:`_one_at_a_time_bytes`)."""
    per_micro_batch = stage.saved_bytes * strategy.micro_batch
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    held = per_micro_batch * in_flight * tp_activation_share(strategy) / strategy.cp
    return held + sp_gathered_input_bytes(stage, strategy) * in_flight / strategy.cp


def _loss_and_recomputation_bytes(stage: StageTotals, strategy: Strategy, *, on_cpu: bool) -> float:
    """The loss's working tensors and what one block's recomputation materialises (:func:`_one_at_a_time_bytes`).
    They are never alive together: the loss's go with the head's backward, before the first block is recomputed,
    so a CPU rank's allocator holds the larger (measured: small-gpt's DDP with full recomputation, within 0.1%
    once not summed, ``benchmarks/memory_truth.py --pins``). On a GPU the sum stays: torchtitan's published peaks
    are the caching allocator's reserved bytes, which keep the loss's large freed segments, and sit up to 11.5%
    above the sum already (``benchmarks/published.py``); no GPU measurement has told them apart yet."""
    loss, recomputed = loss_gradient_bytes(stage, strategy), _one_at_a_time_bytes(stage, strategy)
    return max(loss, recomputed) if on_cpu else loss + recomputed


def _one_at_a_time_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """What the backward materialises for one block at a time: its recomputed activations
    (``StageTotals.recompute_buffer_bytes``) and the device copies of offloaded blocks in transit. They come when
    the blocks' backward starts, after the loss's (:func:`_loss_and_recomputation_bytes`)."""
    buffers = (stage.recompute_buffer_bytes + stage.offload_buffer_bytes) * strategy.micro_batch
    return buffers * tp_activation_share(strategy) / strategy.cp


def sp_gathered_input_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """What PyTorch's sequence parallelism keeps beyond ``1/tp`` of a micro-batch's activations.

    Korthikanti et al.'s ``34 sbh / t`` assumes Megatron-LM's sequence parallelism, which saves the local
    ``s/t`` shard in front of each column-parallel pair and all-gathers it again in the backward. DTensor's
    ``SequenceParallel`` -> ``ColwiseParallel`` (``runtime.tensor_parallel``) all-gathers the input once and the
    linear saves the gathered tensor, so each pair's input (and the head's) is kept whole: ``1 - 1/t`` of it more.
    ``Strategy.sp_regather`` describes Megatron-LM's way (nothing more kept).
    """
    if strategy.tp == 1 or not strategy.sp or strategy.sp_regather:
        return 0.0
    return stage.sp_gathered_bytes * strategy.micro_batch * (1 - 1 / strategy.tp)


def tp_activation_share(strategy: Strategy) -> float:
    """Share of a layer's activations one tensor-parallel rank keeps."""
    if strategy.tp == 1 or strategy.sp:
        return 1 / strategy.tp
    return REPLICATED_ACTIVATION_SHARE + (1 - REPLICATED_ACTIVATION_SHARE) / strategy.tp


def _buffer_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, on_cpu: bool, block_gather_bytes: float | None,
    profile: ImplementationProfile = TESSERA,
) -> float:
    """Communication and gathering buffers alive at the backward's start, or at a unit's reduce-scatter soon after."""
    # Send and receive buffers of the stage boundary: one micro-batch's boundary activation (s / cp tokens).
    pipeline = 2 * stage.boundary_bytes * strategy.micro_batch / strategy.cp if strategy.pp > 1 else 0
    pipeline += ring_and_dispatch_buffer_bytes(stage, strategy, profile)  # cp / ep exchange buffers (0 without them)
    if strategy.zero == 3 and profile.zero3_by_parameter is not None:
        return pipeline + parameter_gathered_bytes(stage, training, strategy, profile.zero3_by_parameter)
    if strategy.zero == 3:
        return pipeline + zero3_gathered_bytes(stage, training, strategy, on_cpu=on_cpu,
                                               block_gather_bytes=block_gather_bytes)
    if whole_grad_buffer(strategy, profile):  # reduced in place: no DDP buckets, no reduce-scatter input copy
        return pipeline
    return pipeline + ddp_bucket_bytes(stage, strategy) + zero12_reduce_scatter_bytes(stage, strategy, on_cpu=on_cpu)
