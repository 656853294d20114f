"""Per-device memory of one pipeline stage, by category, as Tessera's runtime holds it.

Model state per parameter (mixed precision keeps fp32 masters): fp32 parameters (4 B), fp32 gradients
(4 B) and two fp32 Adam moments (8 B). Tessera's runtime (``runtime.data_parallel``) holds them as follows:
ZeRO-0 is DDP (plus a bucket copy of the gradients) or FSDP2 ``replicate``; ZeRO-1/2 are FSDP2 with
``reshard_after_forward=False`` (fp32 masters and moments 1/dp, the gathered parameters kept whole from
forward to backward; ZeRO-1 accumulates the unsharded gradient over micro-batches, ZeRO-2 its shard);
ZeRO-3 gathers one block at a time (plus one prefetched), and the root layers for the forward and again for
the backward.
Mixed precision on a model no FSDP unit wraps runs by ``torch.autocast`` (:func:`autocasts`): every micro-batch
then holds a compute-dtype copy of each local weight from its forward until its backward is done.
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
"""

from __future__ import annotations

from dataclasses import replace

from tessera.cost_models.fp8 import saved_input_reduction_bytes
from tessera.cost_models.partition import StageTotals, as_op_level_memory, op_level_selective
from tessera.cost_models.profiles import TESSERA, ImplementationProfile
from tessera.cost_models.pipeline import in_flight_micro_batches
from tessera.cost_models.sparse import (
    largest_gathered_params, local_param_split, ring_and_dispatch_buffer_bytes, sharded_params,
)
from tessera.cost_models.types import Strategy, TrainingConfig

FP32 = 4
GiB = 2**30
FSDP_PREFETCH_BLOCKS = 2  # the block being computed plus the one prefetched
ADAMW_CPU_TEMPORARIES = 2  # ``_single_tensor_adamw``'s denominator: sqrt, then its division (``optimizer_temporary_bytes``)
LOSS_TEMPORARIES = 2  # cross-entropy backward: d(log-probs) and d(logits) (``loss_gradient_bytes``)
LOSS_PARALLEL_TEMPORARIES = 3  # loss_parallel forward: logits, x - max and exp beside the result
# A fact about the runtime, not a setting: ``runtime/parallel_model.py`` runs ``schedule.step(return_outputs=False)``,
# so the last stage does not keep every micro-batch's logits for a merged output (``pipeline_output_bytes``).
# True describes pipelining's default (``return_outputs=True``), for a runtime that asks for the outputs.
PIPELINE_KEEPS_OUTPUTS = False
REPLICATED_ACTIVATION_SHARE = 10 / 34  # Korthikanti et al. eq. 2: sbh(10 + 24/t) of sbh*34 without SP
# Allowance outside tensors: CUDA context, NCCL buffers and allocator fragmentation (~2 GiB on GPUs,
# a stated assumption); a CPU rank costs ~220 MB before any model (shared/PLATFORM-NOTES.md).
GPU_RESERVE_BYTES = 2 * GiB
CPU_RESERVE_BYTES = 256 * 2**20


def compute_dtype_bytes(training: TrainingConfig) -> int:
    """Bytes per element of the compute dtype."""
    return FP32 if training.precision == "fp32" else 2


def local_params(stage: StageTotals, strategy: Strategy) -> float:
    """Parameters of ``stage`` on one device: tp divides the sharded ones, tp * ep the routed experts."""
    if not stage.expert_params:
        return stage.sharded_params / strategy.tp + stage.replicated_params
    return sum(local_param_split(stage, strategy))


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
    if op_level_selective(stage, profile.selective_policy):
        stage = as_op_level_memory(stage)
    if on_cpu and stage.offloaded_bytes:  # a CPU rank's device memory is the host's: offloading frees nothing
        stage = replace(stage, saved_bytes=stage.saved_bytes + stage.offloaded_bytes, offload_buffer_bytes=0)
    block_gather_bytes = 1 if profile.gathers_fp8(training, strategy) else None
    copies = autocast_copy_bytes(stage, training, strategy, profile)
    marks = (backward_memory(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu,
                             block_gather_bytes=block_gather_bytes),
             step_end_memory(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu, profile=profile))
    if training.precision == "fp8":
        marks = tuple(with_fp8_state(mark, stage, training, strategy, micro_batches=micro_batches, profile=profile,
                                     in_backward=mark is marks[0], on_cpu=on_cpu) for mark in marks)
    if profile.gradient_bytes != FP32:  # gradients held in the framework's reduction dtype
        marks = tuple(dict(mark, gradients=mark["gradients"] * profile.gradient_bytes / FP32) for mark in marks)
    if copies:  # the compute-dtype weight copies live until the backward is done
        marks = (dict(marks[0], parameters=marks[0]["parameters"] + copies), marks[1])
    peak = max(marks, key=lambda mark: sum(mark.values()))
    return {**{name: max(0, int(value)) for name, value in peak.items()}, "reserve": reserve}


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
    larger counts."""
    updated = dict(mark, parameters=mark["parameters"] + profile.weight_fp8_bytes * block_params(stage, strategy))
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
    block_gather_bytes: float | None = None,
) -> dict:
    """Bytes by category when the backward of the stage's last in-flight micro-batch starts (ZeRO-3's gathered
    blocks at ``block_gather_bytes`` per parameter: the compute dtype's unless the framework gathers FP8)."""
    return {
        "parameters": parameter_bytes(stage, training, strategy, in_backward=True),
        "gradients": held_gradient_bytes(stage, strategy, micro_batches=micro_batches),
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": activation_bytes(stage, strategy, micro_batches=micro_batches) + loss_gradient_bytes(stage, strategy),
        "buffers": (_buffer_bytes(stage, training, strategy, on_cpu=on_cpu, block_gather_bytes=block_gather_bytes)
                    + pipeline_output_bytes(stage, strategy, micro_batches=micro_batches)),
    }


def step_end_memory(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool,
    profile: ImplementationProfile = TESSERA,
) -> dict:
    """Bytes by category after the backward: reduced gradients, merged pipeline outputs, and the largest of what
    comes and goes around them as ``profile`` runs: optimizer temporaries, FSDP2 ``replicate``'s reduction, or what
    autograd's own accumulation holds at the backward's end."""
    # ZeRO-0 keeps the full gradient; every FSDP2 stage (1-3) reduce-scatters it to the 1/dp shard it steps on.
    if strategy.zero == 0:
        gradients = (local_params(stage, strategy) + replicated_embedding_gradient_params(stage, strategy)) * FP32
    else:
        gradients = sharded_params(stage, strategy, from_zero=1) * FP32
    merged = merged_pipeline_output_bytes(stage, strategy, micro_batches=micro_batches)
    # The optimizer peaks in its step, FSDP2's replicate in its reduction, autograd's accumulation in the backward.
    transient = [optimizer_temporary_bytes(stage, strategy, on_cpu=on_cpu)]
    if profile.replicate_by_fsdp2:
        transient.append(replicate_reduction_bytes(stage, training, strategy, micro_batches=micro_batches))
    if profile.autocast_copies:
        copies = autocast_copy_bytes(stage, training, strategy, profile)
        transient.append(accumulation_bytes(stage, training, strategy, micro_batches=micro_batches, copies=copies))
    return {
        "parameters": parameter_bytes(stage, training, strategy, in_backward=False),
        "gradients": gradients,
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": 0.0,
        "buffers": ddp_bucket_bytes(stage, strategy) + merged + max(transient),
    }


def accumulation_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, copies: float
) -> float:
    """What the paths whose gradients autograd accumulates itself (DDP, a plain module, a pipeline stage without
    FSDP2) hold beyond the step's full gradient near the end of the last micro-batch's backward: autocast's weight
    copies (``copies``) not yet used, and the new gradient of the largest weight in fp32 as it is added to the
    accumulated one.

    Under autocast each weight's gradient comes in the compute dtype and is cast back by the backward of autocast's
    cast, which autograd runs after the block's matmuls: a block's compute-dtype weight gradients wait together,
    in place of its copies once each is used. Around the forward alone (the runtime's way) the copies of the
    blocks not yet reached are the rest; a pipeline schedule runs every backward inside autocast, whose cache
    keeps all copies to the step's last backward, so the block's gradients come on top. Measured on 2 ranks
    (``benchmarks/memory_truth.py --ranks 2 --models wide-short --strategies '' --pins PP2=dp=1,pp=2``): 14 MiB
    accumulated, 7 MiB of copies, a block's 6 MiB of bf16 gradients and a 4 MiB fp32 gradient at once."""
    if strategy.zero != 0 or uses_fsdp2_replicate(strategy):
        return 0.0
    kept = copies if strategy.pp > 1 else 0.0
    if micro_batches == 1:  # nothing accumulated: each gradient is the first, taken as it is
        return kept
    block_gradients = gathered_block_params(stage, strategy) * compute_dtype_bytes(training) if copies else 0.0
    waiting = kept + block_gradients if strategy.pp > 1 else copies
    return waiting + stage.largest_tensor_params / strategy.tp * FP32


def replicate_reduction_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int
) -> float:
    """What FSDP2's ``replicate`` (one unit over the stage's module, ``runtime.data_parallel``) holds beyond the
    step's full fp32 gradient, at the higher of two moments after the activations are gone.

    - The unit's backward has ended, before its ``post_backward``: its gathered parameters and its new
      gradients, both in the compute dtype, beside the fp32 gradient accumulated over earlier micro-batches
      (:func:`held_gradient_bytes`) and, as ``post_backward`` adds each new gradient to it, an fp32 copy of one.
      In fp32 the accumulated gradient is the gathered parameters' own, which autograd adds each new one to as
      it comes: one new gradient at a time (measured on the same model in fp32: 14 MiB each of gathered
      parameters and accumulated gradients, and a 2 MiB new one).
    - The reduction (``foreach_reduce`` over a shard group of one rank): an fp32 input of the whole unit, and an
      fp32 output it copies that into and all-reduces, which stays as the gradient: one copy more.

    Measured on the 4-rank TP x DP of ``benchmarks/memory_truth.py --models wide-short``: 14 MiB of fp32
    gradients, 7 MiB each of gathered parameters and bf16 gradients and a 2 MiB copy at the first moment, two
    14 MiB buffers at the second."""
    if not uses_fsdp2_replicate(strategy):
        return 0.0
    gradients = local_params(stage, strategy) + replicated_embedding_gradient_params(stage, strategy)
    compute = compute_dtype_bytes(training)
    held = held_gradient_bytes(stage, strategy, micro_batches=micro_batches)
    added = stage.largest_tensor_params / strategy.tp * FP32 if held else 0.0
    # In fp32 the gathered parameters' own gradients are the accumulator: autograd adds each new one as it comes.
    new = gradients * compute if compute != FP32 or not held else 0.0
    unit_end = local_params(stage, strategy) * compute + new + held + added
    return max(gradients * FP32, unit_end - gradients * FP32)


def parameter_bytes(stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, in_backward: bool) -> float:
    """fp32 master parameters, plus, for the FSDP2 paths that keep them between forward and backward, the
    gathered copy.

    FSDP2 shards the parameters of ZeRO-1/2 too (``runtime.data_parallel``: ``fully_shard`` with
    ``reshard_after_forward=False``): the fp32 masters are 1/dp at rest, and the all-gathered parameters (a
    separate storage in the compute dtype, ``FSDPParam.alloc_all_gather_outputs``) stay alive from each unit's
    forward until its backward has run (``reshard_after_forward=False``), so at the backward's start all of
    them are. FSDP2's ``replicate`` (ZeRO-0 with tp/pp/cp/ep) is the same machinery over a shard group of one
    rank: masters whole, and the same unsharded copy. ZeRO-3's gathered blocks are transient (``_buffer_bytes``);
    a ZeRO-3 block that keeps its gathered weights (``Strategy.block_reshard`` False) holds that copy likewise.
    """
    masters = sharded_params(stage, strategy, from_zero=1 if strategy.zero in (1, 2) else 3) * FP32
    if in_backward and (strategy.zero in (1, 2) or uses_fsdp2_replicate(strategy)):
        return masters + local_params(stage, strategy) * compute_dtype_bytes(training)
    if in_backward and strategy.zero == 3:
        return masters + kept_local_params(stage, strategy) * compute_dtype_bytes(training)
    return masters


def kept_local_params(stage: StageTotals, strategy: Strategy) -> float:
    """Gathered parameters on one device of the ZeRO-3 blocks that keep them from forward to backward: tp
    divides the dense part, etp * ep the routed experts (as ``local_params``)."""
    dense = stage.kept_params - stage.kept_expert_params
    return dense / strategy.tp + stage.kept_expert_params / (strategy.expert_tp * strategy.ep)


def autocasts(training: TrainingConfig, strategy: Strategy, profile: ImplementationProfile) -> bool:
    """Whether mixed precision runs by ``torch.autocast`` (``ImplementationProfile.autocast_copies``): bf16/fp16/fp8
    on a model no FSDP unit wraps, ZeRO-0 without FSDP2's ``replicate`` (``runtime.parallel_model._autocast``)."""
    return (profile.autocast_copies and training.precision in ("bf16", "fp16", "fp8") and strategy.zero == 0
            and not uses_fsdp2_replicate(strategy))


def autocast_copy_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, profile: ImplementationProfile
) -> float:
    """Bytes of the compute-dtype weight copies autocast makes (0 where it does not run). Its cache keeps them until
    the context exits: the runtime wraps the forward alone, so each goes once its layer's backward has used it,
    except under a pipeline schedule, which runs every backward inside the context too
    (``runtime.parallel_model``): there they last to the step's last backward (:func:`accumulation_bytes`)."""
    if not autocasts(training, strategy, profile):
        return 0.0
    return autocast_copied_params(stage, training, strategy) * compute_dtype_bytes(training)


def autocast_copied_params(stage: StageTotals, training: TrainingConfig, strategy: Strategy) -> float:
    """Local parameters autocast keeps a compute-dtype copy of: all of them, except under fp8 the blocks' (their
    FP8 linears cast the weight straight to FP8 on each use, ``runtime.float8``; the norms inside them are few)."""
    local = local_params(stage, strategy)
    return local - block_params(stage, strategy) if training.precision == "fp8" else local


def block_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters inside the stage's blocks (all but the root's embedding, final norm and head)."""
    return local_params(stage, strategy) - (stage.root_sharded_params / strategy.tp + stage.root_replicated_params)


def uses_ddp(strategy: Strategy) -> bool:
    """Whether the runtime's data-parallel axis is ``DistributedDataParallel`` (``runtime.data_parallel``)."""
    plain = strategy.tp == strategy.pp == strategy.cp == strategy.ep == 1
    return strategy.zero == 0 and plain and strategy.dp > 1


def uses_fsdp2_replicate(strategy: Strategy) -> bool:
    """Whether it is FSDP2's ``replicate`` (ZeRO-0 over ``dp * cp`` ranks with tp, pp, cp or ep)."""
    return strategy.zero == 0 and strategy.dp * strategy.cp > 1 and not uses_ddp(strategy)


def held_gradient_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """Gradients alive when the last in-flight micro-batch's backward starts: those of earlier micro-batches.

    The optimizer's ``zero_grad(set_to_none=True)`` frees them every step, so a step whose peak comes before
    any backward (one micro-batch, or a pipeline stage whose in-flight count only peaks once) holds none.
    Accumulated over micro-batches they are full-size where the reduction waits for the last micro-batch —
    DDP's ``no_sync``, FSDP2 ZeRO-0/1 with gradient sync off (it accumulates the unsharded gradient in fp32),
    and every stage under ``torch.distributed.pipelining`` (it syncs on the last micro-batch only) — and the
    1/dp shard where ZeRO-2/3 reduce-scatter after every micro-batch.
    """
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    if micro_batches <= in_flight:
        return 0.0
    if strategy.zero <= 1 or strategy.pp > 1:
        return (local_params(stage, strategy) + replicated_embedding_gradient_params(stage, strategy)) * FP32
    return sharded_params(stage, strategy, from_zero=2) * FP32


def replicated_embedding_gradient_params(stage: StageTotals, strategy: Strategy) -> float:
    """Extra gradient elements of vocabulary-parallel embeddings under tensor parallelism.

    DTensor's embedding backward gives a row-sharded (``Shard(0)``, ``RowwiseParallel``) embedding weight a
    ``Replicate`` gradient: every tp rank holds the whole ``vocab x h`` gradient, ``1 - 1/tp`` more than its
    shard (checked on torch 2.13: ``weight.grad.placements == (Replicate(),)``). Counted where the unsharded
    gradient is what the step holds (ZeRO-0/1 accumulation; FSDP2's reduce-scatter of ZeRO-2/3 re-shards it).
    """
    if strategy.tp == 1 or strategy.zero > 1:
        return 0.0
    return stage.embedding_params * (1 - 1 / strategy.tp)


def loss_gradient_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """The loss's working tensors on its micro-batch, beyond the saved log-probabilities, all activations alive.

    Plain cross-entropy (``tp == 1``): the backward's first operations, ``nll_loss_backward`` (a dense gradient
    of the log-probabilities) and ``_log_softmax_backward_data`` (the logits' gradient), hold two
    log-probability-sized tensors: ``LOSS_TEMPORARIES``. Under tensor parallelism ``loss_parallel`` computes the
    vocabulary-sharded log-softmax from aten pieces (``x - max``, ``exp``, the sum's all-reduce, the result), and
    its forward keeps the logits and three shard-sized tensors alive at once: ``LOSS_PARALLEL_TEMPORARIES``
    (the logits are otherwise freed). Sizes are 1/tp (vocabulary shards) and 1/cp (tokens).
    """
    temporaries = LOSS_TEMPORARIES if strategy.tp == 1 else LOSS_PARALLEL_TEMPORARIES
    return temporaries * stage.loss_saved_bytes * strategy.micro_batch / (strategy.tp * strategy.cp)


def pipeline_output_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """A pipeline stage's forward outputs that ``torch.distributed.pipelining`` keeps during the backward phase.

    Each stage keeps the output of every in-flight micro-batch (``fwd_cache``: its backward starts from it):
    the boundary activation, or on the last stage the logits (which autograd alone would not keep: the loss
    saves its log-probabilities). While ``PIPELINE_KEEPS_OUTPUTS`` holds, the last stage also keeps every
    micro-batch's logits for the step's merged output (:func:`merged_pipeline_output_bytes`).
    """
    if strategy.pp == 1:
        return 0.0
    if stage.logits_bytes:
        kept = micro_batches if PIPELINE_KEEPS_OUTPUTS else 1
        return stage.logits_bytes * strategy.micro_batch * kept / (strategy.tp * strategy.cp)
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    return stage.boundary_bytes * strategy.micro_batch * in_flight / strategy.cp


def merged_pipeline_output_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """The last stage's outputs at the end of the step, while ``PIPELINE_KEEPS_OUTPUTS`` holds (it does not:
    the runtime passes ``return_outputs=False``). With pipelining's default ``return_outputs=True``:
    pipelining then keeps each micro-batch's output (``stage.output_chunks``) until the step ends and
    concatenates them (``_PipelineSchedule._merge_outputs`` -> ``merge_chunks``: ``torch.cat``), although the
    runtime reads only the losses: ``micro_batches`` logits, twice during the merge.
    """
    if strategy.pp == 1 or not stage.logits_bytes or not PIPELINE_KEEPS_OUTPUTS:
        return 0.0
    return 2 * stage.logits_bytes * strategy.micro_batch * micro_batches / (strategy.tp * strategy.cp)


def ddp_bucket_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """DDP's gradient buckets: a second copy of every local gradient, allocated once at construction.

    ``DistributedDataParallel`` (the runtime's ZeRO-0 path without tp/pp/cp/ep, ``runtime.data_parallel``)
    flattens all gradients into buckets (``bucket_cap_mb=25``, the first 1 MiB) for the all-reduce; together
    the buckets cover every parameter, in the gradients' dtype (fp32 masters: autocast keeps parameters
    fp32), and they persist (``gradient_as_bucket_view=False``, the default, copies into them).
    """
    return local_params(stage, strategy) * FP32 if uses_ddp(strategy) else 0.0


def optimizer_temporary_bytes(stage: StageTotals, strategy: Strategy, *, on_cpu: bool) -> float:
    """AdamW's step temporaries. On GPUs PyTorch picks the ``foreach`` implementation, whose
    ``torch._foreach_sqrt(exp_avg_sqs)`` materialises one fp32 tensor per parameter at once (the size of the
    local optimizer shard); on CPU it picks the per-tensor loop (``_single_tensor_adamw``), whose denominator
    ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds two temporaries of one parameter at once: the largest
    local one's (measured: 8 MiB at the step's end on the 4-rank DDP of ``benchmarks/memory_truth.py --models
    wide-short``, whose largest weight holds 4 MiB)."""
    if not on_cpu:
        return sharded_params(stage, strategy, from_zero=1) * FP32
    shards = strategy.dp * strategy.cp if strategy.zero >= 1 else 1  # FSDP2 steps on each parameter's dim-0 shard
    return ADAMW_CPU_TEMPORARIES * stage.largest_tensor_params / (strategy.tp * shards) * FP32


def activation_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """Activations a stage holds at its peak: in-flight micro-batches, one block being recomputed, and the
    device copies of offloaded blocks in transit (``StageTotals.offload_buffer_bytes``)."""
    per_micro_batch = stage.saved_bytes * strategy.micro_batch
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    buffers = stage.recompute_buffer_bytes + stage.offload_buffer_bytes
    held = per_micro_batch * in_flight + buffers * strategy.micro_batch
    return (held * tp_activation_share(strategy) + sp_gathered_input_bytes(stage, strategy) * in_flight) / strategy.cp


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
) -> float:
    """Communication and gathering buffers alive at the backward's start, or at a unit's reduce-scatter soon after."""
    # Send and receive buffers of the stage boundary: one micro-batch's boundary activation (s / cp tokens).
    pipeline = 2 * stage.boundary_bytes * strategy.micro_batch / strategy.cp if strategy.pp > 1 else 0
    pipeline += ring_and_dispatch_buffer_bytes(stage, strategy)  # cp ring / ep all-to-all buffers (0 without them)
    if strategy.zero == 3:
        return pipeline + zero3_gathered_bytes(stage, training, strategy, on_cpu=on_cpu,
                                               block_gather_bytes=block_gather_bytes)
    return pipeline + ddp_bucket_bytes(stage, strategy) + zero12_reduce_scatter_bytes(stage, strategy, on_cpu=on_cpu)


def zero12_reduce_scatter_bytes(stage: StageTotals, strategy: Strategy, *, on_cpu: bool) -> float:
    """What ZeRO-1/2's reduce-scatter of its largest unit adds to the backward's start: FSDP2's ``post_backward``
    frees the unit's gathered parameters, which its unsharded gradient replaces, and copies that gradient into an
    fp32 reduce-scatter input of the unit's size (``foreach_reduce``), which it keeps until the next unit's
    ``post_backward`` (``reduce_scatter_states``), and gloo stages one more copy of (:func:`gloo_staging_bytes`).
    The loss's temporaries are released by then (:func:`loss_backward_released_bytes`)."""
    if strategy.zero not in (1, 2):
        return 0.0
    reduce_input = reduce_scatter_input_params(stage, strategy) * FP32
    staged = gloo_staging_bytes(stage, strategy, on_cpu=on_cpu)
    return max(0.0, reduce_input + staged - loss_backward_released_bytes(stage, strategy))


def reduce_scatter_input_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters of the largest unit whose gradient FSDP2 reduce-scatters while others are gathered: ZeRO-1/2's
    largest unit (a block, or the root: the parameters outside the blocks), ZeRO-3's largest block (its root is
    reduced last, nothing gathered beside it); none without FSDP2's sharding."""
    if strategy.zero == 3:
        return gathered_block_params(stage, strategy)
    if strategy.zero in (1, 2):
        return max(root_params(stage, strategy), gathered_block_params(stage, strategy))
    return 0.0


def gloo_staging_bytes(stage: StageTotals, strategy: Strategy, *, on_cpu: bool) -> float:
    """gloo's copy of a reduce-scatter's input, alive inside the reduce-scatter (CPU ranks: the CPU allocator's peak
    during ``reduce_scatter_tensor`` is the input's size again, ``benchmarks/gloo_staging.py``); NCCL reduces in
    place."""
    return reduce_scatter_input_params(stage, strategy) * FP32 if on_cpu else 0.0


def root_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters of the root's FSDP2 unit (those outside the blocks: embedding, final norm, head)."""
    return stage.root_sharded_params / strategy.tp + stage.root_replicated_params


def gathered_block_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters of the largest block as FSDP2 gathers it (experts stay ep-sharded)."""
    if stage.largest_block_params >= stage.largest_layer_params:
        return largest_gathered_params(stage, strategy)  # the largest layer is a block
    return stage.largest_block_params / strategy.tp


def zero3_gathered_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, on_cpu: bool = False,
    block_gather_bytes: float | None = None,
) -> float:
    """ZeRO-3 (FSDP2 ``fully_shard`` per block, then on the root, all with ``reshard_after_forward=True``): what
    the gathering adds to the backward's start (every activation and the loss's temporaries alive), at the
    highest of three moments.

    - The backward's start: nothing is gathered. Every unit was resharded after its forward, the root too:
      FSDP2 keeps the root gathered only when ``reshard_after_forward`` is left to its default
      (``FSDPState._lazy_init`` checks ``_auto_reshard_after_forward``), and the runtime passes ``True``.
    - The root's re-gather, as soon as the loss's backward has produced the logits' gradient (the root's
      pre-backward hook): the root's parameters twice, the flat all-gather output and the per-parameter
      storages it is copied into (``foreach_all_gather_copy_out``; gloo's all-gather stages a copy of the same
      size before that), while the loss has released all but the logits' gradient
      (:func:`loss_backward_released_bytes`).
    - The end of a middle block's backward, before its ``post_backward``: the root, the block and the next one
      (prefetched; ``block_gather_bytes`` per parameter, the compute dtype's by default; none where every block
      keeps its gathered weights, which :func:`parameter_bytes` holds), the block's new gradients in the compute
      dtype, and the reduce-scatter of the block after it, whose fp32 input and output shard FSDP2 keeps until
      this block's ``post_backward`` (``reduce_scatter_states``); the loss's tensors all released. On CPU ranks
      gloo's staged copy of that reduce-scatter's input is freed by whichever thread drops it last, at times only
      after this block's gather (:func:`gloo_staging_bytes`): it is counted in place of the gradients where larger.
      This moment covers the others of a block: its gather's copy-out, the prefetch's staged output, and its own
      reduce-scatter (the next block, an fp32 input, its shard and gloo's copy).
      Measured on weight-heavy GPTs of 4 and 2 blocks (``benchmarks/memory_truth.py --models wide-4,wide-short``)
      from the CPU allocator's timeline of one step.
    """
    compute = compute_dtype_bytes(training)
    root = root_params(stage, strategy) * compute
    block = gathered_block_params(stage, strategy)
    released = loss_backward_released_bytes(stage, strategy)
    root_regather = 2 * root + loss_output_bytes(stage, strategy) - released  # the logits' gradient is kept
    width = compute if block_gather_bytes is None else block_gather_bytes
    previous = block * FP32 * (1 + 1 / (strategy.dp * strategy.cp))  # the block after's reduce-scatter, in and out
    in_flight = FSDP_PREFETCH_BLOCKS if stage.kept_blocks < stage.blocks else 0  # not by count: the ILP is linear in it
    gradients = max(block * compute, gloo_staging_bytes(stage, strategy, on_cpu=on_cpu))
    block_backward = root + in_flight * block * width + previous + gradients - released
    return max(0.0, root_regather, block_backward)


def loss_output_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """One loss-sized tensor of a micro-batch on one device (1/tp vocabulary, 1/cp tokens): the saved
    log-probabilities, their gradient or the logits' gradient."""
    return stage.loss_saved_bytes * strategy.micro_batch / (strategy.tp * strategy.cp)


def loss_backward_released_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """What the loss's backward has freed, against the backward's start, once it has run: the temporaries
    counted there (:func:`loss_gradient_bytes`) and the saved log-probabilities (autograd frees a node's saved
    tensors after running it). Measured on small-gpt (ZeRO-3, fp32): 16 MiB of temporaries and 8 MiB of
    log-probabilities are freed before the root's all-gather, the 8 MiB gradient of the logits kept."""
    return loss_gradient_bytes(stage, strategy) + loss_output_bytes(stage, strategy)
