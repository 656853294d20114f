"""Buffers that come and go around a step's model state in the data-parallel machinery (``cost_models.memory``'s
transient terms): DDP's buckets, the optimizer step's temporaries, autograd's and FSDP2's gradient accumulation and
reductions, and what ZeRO-3 gathers. Each docstring says which torch behaviour it stands for and where it was measured.
"""

from __future__ import annotations

from tessera.cost_models.memory_state import (
    FP32, compute_dtype_bytes, gathered_block_params, held_gradient_bytes, largest_local_tensor_params, local_params,
    logits_gradient_bytes, loss_backward_released_bytes, replicated_embedding_gradient_params, root_params, uses_ddp,
    uses_fsdp2_replicate,
)
from tessera.cost_models.partition import StageTotals
from tessera.cost_models.profiles import ParameterGathering
from tessera.cost_models.sparse import sharded_params
from tessera.cost_models.types import Strategy, TrainingConfig

FSDP_PREFETCH_BLOCKS = 2  # the block being computed plus the one prefetched
ADAMW_CPU_TEMPORARIES = 2  # ``_single_tensor_adamw``'s denominator: sqrt, then its division


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
    return ADAMW_CPU_TEMPORARIES * largest_local_tensor_params(stage, strategy, shards=shards) * FP32


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
    return waiting + largest_local_tensor_params(stage, strategy) * FP32


def replicate_reduction_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, *, micro_batches: int
) -> float:
    """What FSDP2's ``replicate`` (one unit over the stage's module, ``runtime.data_parallel``) holds beyond the
    step's full fp32 gradient, at the higher of two moments after the activations are gone.

    - The unit's backward has ended, before its ``post_backward``: its gathered parameters and its new
      gradients, both in the compute dtype, beside the fp32 gradient accumulated over earlier micro-batches
      (``memory_state.held_gradient_bytes``) and, as ``post_backward`` adds each new gradient to it, an fp32 copy of
      one.
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
    added = largest_local_tensor_params(stage, strategy) * FP32 if held else 0.0
    # In fp32 the gathered parameters' own gradients are the accumulator: autograd adds each new one as it comes.
    new = gradients * compute if compute != FP32 or not held else 0.0
    unit_end = local_params(stage, strategy) * compute + new + held + added
    return max(gradients * FP32, unit_end - gradients * FP32)


def zero12_reduce_scatter_bytes(stage: StageTotals, strategy: Strategy, *, on_cpu: bool) -> float:
    """What ZeRO-1/2's reduce-scatter of its largest unit adds to the backward's start: FSDP2's ``post_backward``
    frees the unit's gathered parameters, which its unsharded gradient replaces, and copies that gradient into an
    fp32 reduce-scatter input of the unit's size (``foreach_reduce``), which it keeps until the next unit's
    ``post_backward`` (``reduce_scatter_states``), and gloo stages one more copy of (:func:`gloo_staging_bytes`).
    The loss's temporaries are released by then (``memory_state.loss_backward_released_bytes``)."""
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
      (``memory_state.loss_backward_released_bytes``).
    - The end of a middle block's backward, before its ``post_backward``: the root, the block and the next one
      (prefetched; ``block_gather_bytes`` per parameter, the compute dtype's by default; none where every block
      keeps its gathered weights, which ``memory.parameter_bytes`` holds), the block's new gradients in the compute
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
    root_regather = 2 * root + logits_gradient_bytes(stage, strategy) - released  # the logits' gradient is kept
    width = compute if block_gather_bytes is None else block_gather_bytes
    previous = block * FP32 * (1 + 1 / (strategy.dp * strategy.cp))  # the block after's reduce-scatter, in and out
    in_flight = FSDP_PREFETCH_BLOCKS if stage.kept_blocks < stage.blocks else 0  # not by count: the ILP is linear in it
    gradients = max(block * compute, gloo_staging_bytes(stage, strategy, on_cpu=on_cpu))
    block_backward = root + in_flight * block * width + previous + gradients - released
    return max(0.0, root_regather, block_backward)


def parameter_gathered_bytes(
    stage: StageTotals, training: TrainingConfig, strategy: Strategy, gathering: ParameterGathering,
) -> float:
    """ZeRO-3 gathering parameter by parameter (``profiles.zero3_by_parameter``, DeepSpeed's stage 3): what it adds
    once the loss's backward has run, in the compute dtype: the live parameters (up to ``live_params``, and at least
    the largest parameter, which is gathered whole), the prefetch bucket and the gradient reduce bucket. Nothing
    the size of a block is gathered or reduced at once, as FSDP does (:func:`zero3_gathered_bytes`)."""
    live = max(gathering.live_params, largest_local_tensor_params(stage, strategy)) + gathering.prefetch_params
    held = (live + gathering.reduce_bucket_params) * compute_dtype_bytes(training)
    return max(0.0, held - loss_backward_released_bytes(stage, strategy))
