"""How much of each kind of state one device holds, and which runtime path holds it (``cost_models.memory``'s
building blocks): local parameter shares under tensor, expert and ZeRO-3 splits; whether data parallelism runs as
DDP or FSDP2's ``replicate``; gradients held across micro-batches; the loss's tensors.
"""

from __future__ import annotations

from tessera.cost_models.partition import StageTotals
from tessera.cost_models.pipeline import in_flight_micro_batches, micro_batches_per_call
from tessera.cost_models.sparse import largest_gathered_params, local_param_split, sharded_params
from tessera.cost_models.types import Strategy, TrainingConfig

FP32 = 4
LOSS_TEMPORARIES = 2  # cross-entropy backward: d(log-probs) and d(logits) (``loss_gradient_bytes``)
LOSS_PARALLEL_TEMPORARIES = 3  # loss_parallel forward: logits, x - max and exp beside the result


def compute_dtype_bytes(training: TrainingConfig) -> int:
    """Bytes per element of the compute dtype."""
    return FP32 if training.precision == "fp32" else 2


def local_params(stage: StageTotals, strategy: Strategy) -> float:
    """Parameters of ``stage`` on one device: tp divides the sharded ones, tp * ep the routed experts."""
    if not stage.expert_params:
        return stage.sharded_params / strategy.tp + stage.replicated_params
    return sum(local_param_split(stage, strategy))


def kept_local_params(stage: StageTotals, strategy: Strategy) -> float:
    """Gathered parameters on one device of the ZeRO-3 blocks that keep them from forward to backward: tp
    divides the dense part, etp * ep the routed experts (as ``local_params``)."""
    dense = stage.kept_params - stage.kept_expert_params
    return dense / strategy.tp + stage.kept_expert_params / (strategy.expert_tp * strategy.ep)


def block_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters inside the stage's blocks (all but the root's embedding, final norm and head)."""
    return local_params(stage, strategy) - (stage.root_sharded_params / strategy.tp + stage.root_replicated_params)


def root_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters of the root's FSDP2 unit (those outside the blocks: embedding, final norm, head)."""
    return stage.root_sharded_params / strategy.tp + stage.root_replicated_params


def gathered_block_params(stage: StageTotals, strategy: Strategy) -> float:
    """Local parameters of the largest block as FSDP2 gathers it (experts stay ep-sharded)."""
    if stage.largest_block_params >= stage.largest_layer_params:
        return largest_gathered_params(stage, strategy)  # the largest layer is a block
    return stage.largest_block_params / strategy.tp


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
    1/dp shard where ZeRO-2/3 reduce-scatter after every micro-batch. A step in ``pipeline_passes`` schedule calls
    whose peak comes before any backward of its pass holds only the earlier passes' reduced gradients.
    """
    in_flight = in_flight_micro_batches(strategy, stage=stage.index, micro_batches=micro_batches)
    if micro_batches <= in_flight:
        return 0.0
    if micro_batches_per_call(strategy, micro_batches) <= in_flight:
        return sharded_params(stage, strategy, from_zero=2) * FP32
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
    (the logits are otherwise freed). Sizes are 1/tp (vocabulary shards) and 1/cp (tokens). The other kernels
    (``StageTotals.loss_kernel``) hold one gradient of the logits' size: flash-attn's fused kernel writes it beside
    the saved logits; Megatron's turns its saved fp32 softmax into the gradient in place, which autograd then casts
    to the logits' dtype.
    """
    if stage.loss_kernel != "torch":
        return logits_gradient_bytes(stage, strategy)
    temporaries = LOSS_TEMPORARIES if strategy.tp == 1 else LOSS_PARALLEL_TEMPORARIES
    return temporaries * stage.loss_saved_bytes * strategy.micro_batch / (strategy.tp * strategy.cp)


def loss_output_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """One loss-sized tensor of a micro-batch on one device (1/tp vocabulary, 1/cp tokens): the saved
    log-probabilities, their gradient or the logits' gradient."""
    return stage.loss_saved_bytes * strategy.micro_batch / (strategy.tp * strategy.cp)


def logits_gradient_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """The logits' gradient the loss's backward hands to the head, on one device: loss-sized under torch's
    cross-entropy (as measured on small-gpt in fp32, :func:`loss_backward_released_bytes`), the logits' own size under
    the other kernels (:func:`loss_gradient_bytes`)."""
    if stage.loss_kernel == "torch":
        return loss_output_bytes(stage, strategy)
    return stage.logits_bytes * strategy.micro_batch / (strategy.tp * strategy.cp)


def loss_backward_released_bytes(stage: StageTotals, strategy: Strategy) -> float:
    """What the loss's backward has freed, against the backward's start, once it has run: the temporaries
    counted there (:func:`loss_gradient_bytes`) and the saved log-probabilities (autograd frees a node's saved
    tensors after running it). Measured on small-gpt (ZeRO-3, fp32): 16 MiB of temporaries and 8 MiB of
    log-probabilities are freed before the root's all-gather, the 8 MiB gradient of the logits kept."""
    return loss_gradient_bytes(stage, strategy) + loss_output_bytes(stage, strategy)


def largest_local_tensor_params(stage: StageTotals, strategy: Strategy, *, shards: int = 1) -> float:
    """Elements of the stage's largest parameter on one device: tp divides it, and ``shards`` where FSDP2 keeps its
    dim-0 shard."""
    return stage.largest_tensor_params / (strategy.tp * shards)
