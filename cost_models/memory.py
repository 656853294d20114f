"""Per-device memory of one pipeline stage, by category, as Tessera's runtime holds it.

Model state per parameter (mixed precision keeps fp32 masters): fp32 parameters (4 B), fp32 gradients
(4 B) and two fp32 Adam moments (8 B). ZeRO stage 1 shards the moments over the data-parallel axis,
stage 2 also the gradients, stage 3 (FSDP) also the parameters; FSDP then gathers one block at a time
(plus one prefetched) in the compute dtype. Tensor parallelism divides blocks and vocabulary matrices.
Expert parallelism divides routed experts by ``ep``; the "data-parallel axis" of a kind of state is the ranks
holding the same weights: ``dp * cp`` for dense, ``(dp / ep) * cp`` for expert state (``cost_models.sparse``).
Context parallelism divides activations by ``cp`` (each rank keeps ``s / cp`` tokens).

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, Sec. 4): without sequence parallelism, the inputs of norms and the residual stream
(10 of the 34 ``sbh`` bytes per layer) are replicated on every tensor-parallel rank; with it everything
is divided by ``tp``.
"""

from __future__ import annotations

from tessera.cost_models.partition import StageTotals
from tessera.cost_models.pipeline import in_flight_micro_batches
from tessera.cost_models.sparse import (
    largest_gathered_params, local_param_split, ring_and_dispatch_buffer_bytes, sharded_params,
)
from tessera.cost_models.types import Strategy, TrainingConfig

FP32 = 4
GiB = 2**30
FSDP_PREFETCH_BLOCKS = 2  # the block being computed plus the one prefetched
LOSS_TEMPORARIES = 2  # cross-entropy backward: d(log-probs) and d(logits) (``loss_gradient_bytes``)
LOSS_PARALLEL_TEMPORARIES = 3  # loss_parallel forward: logits, x - max and exp beside the result
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
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool
) -> dict[str, int]:
    """Peak bytes on one device of ``stage`` by category: the higher of the step's two high-water marks.

    A step peaks either where the backward of its last in-flight micro-batch starts (:func:`backward_memory`:
    every saved activation alive, the loss gradient just materialised) or after the backward
    (:func:`step_end_memory`: activations freed, gradients complete, the pipeline's outputs merged, the
    optimizer stepping). Large activations put the peak at the first, large model state at the second.
    """
    reserve = CPU_RESERVE_BYTES if on_cpu else GPU_RESERVE_BYTES
    marks = (backward_memory(stage, training, strategy, micro_batches=micro_batches),
             step_end_memory(stage, training, strategy, micro_batches=micro_batches, on_cpu=on_cpu))
    peak = max(marks, key=lambda mark: sum(mark.values()))
    return {**{name: int(value) for name, value in peak.items()}, "reserve": reserve}


def backward_memory(stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int) -> dict:
    """Bytes by category when the backward of the stage's last in-flight micro-batch starts."""
    return {
        "parameters": parameter_bytes(stage, training, strategy, in_backward=True),
        "gradients": held_gradient_bytes(stage, strategy, micro_batches=micro_batches),
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": activation_bytes(stage, strategy, micro_batches=micro_batches) + loss_gradient_bytes(stage, strategy),
        "buffers": _buffer_bytes(stage, training, strategy) + pipeline_output_bytes(stage, strategy, micro_batches=micro_batches),
    }


def step_end_memory(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int, on_cpu: bool
) -> dict:
    """Bytes by category after the backward: reduced gradients, merged pipeline outputs, optimizer temporaries."""
    # ZeRO-0 keeps the full gradient; every FSDP2 stage (1-3) reduce-scatters it to the 1/dp shard it steps on.
    if strategy.zero == 0:
        gradients = (local_params(stage, strategy) + replicated_embedding_gradient_params(stage, strategy)) * FP32
    else:
        gradients = sharded_params(stage, strategy, from_zero=1) * FP32
    merged = 2 * pipeline_output_bytes(stage, strategy, micro_batches=micro_batches)  # the chunks + their torch.cat
    return {
        "parameters": parameter_bytes(stage, training, strategy, in_backward=False),
        "gradients": gradients,
        "optimizer": sharded_params(stage, strategy, from_zero=1) * 2 * FP32,
        "activations": 0.0,
        "buffers": ddp_bucket_bytes(stage, strategy) + merged + optimizer_temporary_bytes(stage, strategy, on_cpu=on_cpu),
    }


def parameter_bytes(stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, in_backward: bool) -> float:
    """fp32 master parameters, plus, for ZeRO-1/2 between forward and backward, the gathered compute copy.

    FSDP2 shards the parameters of ZeRO-1/2 too (``runtime.data_parallel``: ``fully_shard`` with
    ``reshard_after_forward=False``): the fp32 masters are 1/dp at rest, and the all-gathered parameters (a
    separate storage in the compute dtype, ``FSDPParam.alloc_all_gather_outputs``) stay alive from each unit's
    forward until its backward has run (``reshard_after_forward=False``), so at the backward's start all of
    them are. ZeRO-3's gathered blocks are transient (``_buffer_bytes``).
    """
    masters = sharded_params(stage, strategy, from_zero=1 if strategy.zero in (1, 2) else 3) * FP32
    if in_backward and strategy.zero in (1, 2):
        return masters + local_params(stage, strategy) * compute_dtype_bytes(training)
    return masters


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
    """The last pipeline stage's outputs (logits) of every micro-batch of the step.

    ``torch.distributed.pipelining`` keeps each micro-batch's output in ``stage.output_chunks`` until the step
    ends and then concatenates them (``_PipelineSchedule._merge_outputs`` -> ``merge_chunks``: ``torch.cat``),
    even though Tessera's runtime only reads the losses; so the last stage holds ``micro_batches`` logits at
    the end of the step, twice during the merge. (The runtime could drop them: reported to its owners.)
    """
    if strategy.pp == 1:
        return 0.0
    return stage.logits_bytes * strategy.micro_batch * micro_batches / (strategy.tp * strategy.cp)


def ddp_bucket_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """DDP's gradient buckets: a second copy of every local gradient, allocated once at construction.

    ``DistributedDataParallel`` (the runtime's ZeRO-0 path without tp/pp/cp/ep, ``runtime.data_parallel``)
    flattens all gradients into buckets (``bucket_cap_mb=25``, the first 1 MiB) for the all-reduce; together
    the buckets cover every parameter, in the gradients' dtype (fp32 masters: autocast keeps parameters
    fp32), and they persist (``gradient_as_bucket_view=False``, the default, copies into them).
    """
    plain = strategy.tp == strategy.pp == strategy.cp == strategy.ep == 1
    if strategy.zero != 0 or not plain or strategy.dp == 1:
        return 0.0
    return local_params(stage, strategy) * FP32


def optimizer_temporary_bytes(stage: StageTotals, strategy: Strategy, *, on_cpu: bool) -> float:
    """AdamW's step temporaries. On GPUs PyTorch picks the ``foreach`` implementation, whose
    ``torch._foreach_sqrt(exp_avg_sqs)`` materialises one fp32 tensor per parameter at once (the size of the
    local optimizer shard); on CPU it picks the per-tensor loop (``_single_tensor_adamw``), whose temporaries
    are one parameter's worth at a time: negligible against a stage."""
    return 0.0 if on_cpu else sharded_params(stage, strategy, from_zero=1) * FP32


def activation_bytes(stage: StageTotals, strategy: Strategy, *, micro_batches: int) -> float:
    """Activations a stage holds at its peak: in-flight micro-batches plus one block being recomputed."""
    per_micro_batch = stage.saved_bytes * strategy.micro_batch
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    held = per_micro_batch * in_flight + stage.recompute_buffer_bytes * strategy.micro_batch
    return (held * tp_activation_share(strategy) + sp_gathered_input_bytes(stage, strategy) * in_flight) / strategy.cp


def sp_gathered_input_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """What PyTorch's sequence parallelism keeps beyond ``1/tp`` of a micro-batch's activations.

    Korthikanti et al.'s ``34 sbh / t`` assumes Megatron-LM's sequence parallelism, which saves the local
    ``s/t`` shard in front of each column-parallel pair and all-gathers it again in the backward. DTensor's
    ``SequenceParallel`` -> ``ColwiseParallel`` (``runtime.tensor_parallel``) all-gathers the input once and the
    linear saves the gathered tensor, so each pair's input (and the head's) is kept whole: ``1 - 1/t`` of it more.
    """
    if strategy.tp == 1 or not strategy.sp:
        return 0.0
    return stage.sp_gathered_bytes * strategy.micro_batch * (1 - 1 / strategy.tp)


def tp_activation_share(strategy: Strategy) -> float:
    """Share of a layer's activations one tensor-parallel rank keeps."""
    if strategy.tp == 1 or strategy.sp:
        return 1 / strategy.tp
    return REPLICATED_ACTIVATION_SHARE + (1 - REPLICATED_ACTIVATION_SHARE) / strategy.tp


def _buffer_bytes(stage: StageTotals, training: TrainingConfig, strategy: Strategy) -> float:
    """Communication and gathering buffers alive at the backward's start."""
    # Send and receive buffers of the stage boundary: one micro-batch's boundary activation (s / cp tokens).
    pipeline = 2 * stage.boundary_bytes * strategy.micro_batch / strategy.cp if strategy.pp > 1 else 0
    pipeline += ring_and_dispatch_buffer_bytes(stage, strategy)  # cp ring / ep all-to-all buffers (0 without them)
    if strategy.zero == 3:
        return pipeline + zero3_gathered_bytes(stage, training, strategy)
    return pipeline + ddp_bucket_bytes(stage, strategy)


def zero3_gathered_bytes(stage: StageTotals, training: TrainingConfig, strategy: Strategy) -> float:
    """ZeRO-3 (FSDP2 ``fully_shard`` per block, then the root): the parameters gathered at the backward's start.

    The root unit (everything outside the blocks: embeddings, final norm, head) is gathered for the whole
    forward and backward: FSDP2 never reshards the root after forward (``FSDPState._lazy_init`` clears the
    root's ``post_forward_mesh_info``), since its backward needs it at once. Of the blocks,
    ``FSDP_PREFETCH_BLOCKS`` are gathered (the one computing and the one prefetched), and the one computing
    holds its unsharded fp32 gradient until it is reduce-scattered.
    """
    root = stage.root_sharded_params / strategy.tp + stage.root_replicated_params
    if stage.largest_block_params >= stage.largest_layer_params:
        block = largest_gathered_params(stage, strategy)  # the largest layer is a block (experts ep-sharded)
    else:
        block = stage.largest_block_params / strategy.tp
    return (root + FSDP_PREFETCH_BLOCKS * block) * compute_dtype_bytes(training) + block * FP32
