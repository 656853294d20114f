"""Checks of the targets the default cross-entropy loss receives (``runtime.losses.default_loss_fn``).

One process's ``F.cross_entropy`` raises on a class index outside the logits, but under tensor parallelism the
vocabulary-parallel loss treats every index outside a rank's shard as someone else's and one outside all shards as
ignored: a tokenizer one larger than the model's vocabulary would train on silently dropped tokens, and a batch of
them alone reports a loss of 0. Under data or pipeline parallelism only the rank holding the bad rows would raise,
and the others would fail on a closed connection. So ``train_step`` checks the whole global batch first, on every
rank alike (every rank receives the same batch), against the classes the model declares (``output_classes``);
where it declares none, the loss checks each micro-batch against its logits (a host sync each: correctness first).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.errors import ConfigError

IGNORE_INDEX = -100
"""Targets equal to this are ignored (PyTorch's and Hugging Face's ``ignore_index``)."""


HEAD_NAMES = ("lm_head", "head", "output")
"""Where a model that is not a Hugging Face one keeps its output projection (Tessera's own models: ``head``;
torchtitan's Llama: ``output``)."""


def output_classes(model: nn.Module) -> int | None:
    """How many classes a language model's logits have, where it says: a Hugging Face model's output embedding
    (``get_output_embeddings()``; a model without one, a classifier, says nothing: its ``vocab_size`` is not its
    labels), else the rows of an output projection under ``HEAD_NAMES``; None otherwise (the loss then checks
    each micro-batch against its logits)."""
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        head = get_head()
        return head.out_features if isinstance(head, nn.Linear) else None
    heads = (getattr(model, name, None) for name in HEAD_NAMES)
    return next((head.out_features for head in heads if isinstance(head, nn.Linear)), None)


def check_class_targets(targets: torch.Tensor, classes: int | None) -> None:
    """Refuse targets the default loss cannot take: not integer class indices, or an index outside ``[0,
    classes)`` other than ``IGNORE_INDEX`` (``classes`` None: only negative ones)."""
    if targets.dtype != torch.long:  # F.cross_entropy's class indices (it refuses int32 on some ranks' paths only)
        raise ConfigError(f"targets are {targets.dtype}; the default cross-entropy loss takes class indices as "
                          "torch.long (targets.long()), -100 where a position is ignored; convert them, or pass "
                          "loss_fn= for other targets")
    if targets.numel() == 0:
        return
    lowest, highest = (int(value) for value in torch.aminmax(targets))  # one pass over the batch
    if lowest < 0:  # ignored positions (-100) hide the smallest class index: look again without them
        kept = targets[targets != IGNORE_INDEX]
        if kept.numel() == 0:
            return
        lowest, highest = (int(value) for value in torch.aminmax(kept))
    if lowest < 0:
        raise ConfigError(f"target {lowest} is negative; class indices run from 0 (-100 marks a position to "
                          "ignore); fix the labels")
    if classes is not None and highest >= classes:
        raise ConfigError(f"target {highest} is not below the model's {classes} classes (its logits' last "
                          "dimension); the labels come from a larger vocabulary than the model's: match the "
                          "tokenizer to the model")


def check_logits_targets(logits: torch.Tensor, targets: torch.Tensor, *, check_range: bool = True) -> None:
    """Refuse targets whose shape is not the logits' leading shape, or (``check_range``) that the logits cannot
    take (under tensor parallelism ``logits`` is the vocabulary-sharded ``DTensor``, whose shape is the whole
    vocabulary's). The shape costs nothing to check; the range reads the targets back to the host."""
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ConfigError(f"targets of shape {tuple(targets.shape)} do not match the logits' leading shape "
                          f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)}); pass one target per "
                          "position, e.g. the inputs shifted by one, or pass loss_fn=")
    if check_range:
        check_class_targets(targets, logits.shape[-1])
