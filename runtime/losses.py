"""The loss ``train_step`` applies to each micro-batch's output (``runtime.apply`` builds it for a plan): the
default cross-entropy on the output's logits, found by duck typing, and its vocabulary-parallel and pipelined forms."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from tessera.errors import ConfigError
from tessera.planner.plan import Plan
from tessera.runtime import pipeline as pp_
from tessera.runtime.mesh import TP
from tessera.runtime.parallel_model import LossFn
from tessera.runtime.targets import check_class_targets, check_logits_targets
from tessera.runtime.tensor_parallel import VocabParallelLoss


IGNORE_INDEX = -100
"""The target PyTorch's and Hugging Face's cross-entropy ignore."""


class TokenWeights:
    """What makes the default loss the mean over the counted targets of the whole global batch, as one process
    computes it, rather than a mean of each rank's and micro-batch's means (they differ where ``-100`` targets are
    spread unevenly: padding, masked prompts). ``train_step`` sets it from the global batch each step; each
    micro-batch's loss is then its targets' summed loss times ``scale`` = micro-batches x data ranks / counted
    targets, which the division by the micro-batches (``train_step``'s, or the pipeline schedule's) and the
    gradient average over the data ranks turn back into the global mean."""

    def __init__(self) -> None:
        self.scale = 1.0

    def set_step(self, targets: torch.Tensor, *, micro_batches: int, ranks: int) -> None:
        counted = int((targets != IGNORE_INDEX).sum())
        self.scale = micro_batches * ranks / max(counted, 1)


def default_loss_fn(outputs: Any, targets: torch.Tensor, *, check_range: bool = True,
                    weights: TokenWeights | None = None) -> torch.Tensor:
    """Mean cross-entropy, in fp32, of the logits in the model's ``outputs`` against integer ``targets``.

    The logits are found by :func:`logits_of` (a tensor, ``.logits``, ``["logits"]`` or a tuple's first
    element) and have shape ``(..., V)``: ``(B, T, V)`` for a language model against next-token targets
    ``(B, T)``, ``(B, V)`` for a classifier against ``(B,)``. Targets equal to ``-100`` are ignored (PyTorch's
    and Hugging Face's ``ignore_index``); any other target, or targets not of the logits' leading shape, raise a
    ``ConfigError`` (``runtime.targets``; ``check_range=False`` leaves the range to ``train_step``, which checks
    the global batch against the classes the model declares). For any other output or loss, pass ``loss_fn=`` to
    ``apply_plan``. With ``weights`` (``train_step``'s), the targets' summed loss times ``weights.scale``.
    """
    logits = logits_of(outputs)
    check_logits_targets(logits, targets, check_range=check_range)
    if weights is None:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())  # (N, V) vs (N,)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum") * weights.scale


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's output, by duck typing (no framework is imported): the output itself if it is a
    tensor; its ``"logits"`` entry if it is a mapping (a ``dict``, a Hugging Face ``ModelOutput``); its
    ``logits`` attribute if it has one (a dataclass, a ``NamedTuple``); else the first element of a tuple or
    list (Hugging Face's ``return_dict=False`` convention). Raises ``ConfigError`` naming the output's type
    when none of these holds a tensor."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        found = outputs.get("logits")
    elif hasattr(outputs, "logits"):
        found = outputs.logits
    else:
        found = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else None
    if not isinstance(found, torch.Tensor):
        raise ConfigError(
            f"the default loss found no logits tensor in the model's output of type {_type_name(outputs)} (it "
            "reads a tensor, a .logits attribute, a 'logits' key or a tuple's first element); pass "
            "loss_fn=(outputs, targets) -> loss to apply_plan or auto_parallelize for this output"
        )
    return found


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def build_loss(
    loss_fn: LossFn | None, plan: Plan, mesh: DeviceMesh | None, *,
    pipeline_output: pp_.DictOutput | pp_.TreeOutput | None = None, classes: int | None = None,
    weights: TokenWeights | None = None,
) -> LossFn:
    """The loss ``train_step`` (and the pipeline's last stage) applies to each micro-batch's output.

    ``loss_fn`` (default :func:`default_loss_fn`) receives the model's output as the model returns it, except:
    under tensor parallelism the logits are vocabulary-sharded ``DTensor`` s (``VocabParallelLoss``): the
    default loss finds them (:func:`logits_of`) before they are sharded, so it accepts every output it accepts
    without tensor parallelism, while a custom ``loss_fn`` receives the output with its logits sharded in
    place, which needs a tensor output or one with a ``.logits`` attribute (``ConfigError`` otherwise); under
    pipeline parallelism a structured output leaves the last stage as a tuple of its tensors
    (``pipeline_output`` says what it held) and the loss receives it rebuilt: a plain ``dict`` where torch.fx
    traced a dict (``pipeline.return_dict_as_tuple``), the model's own output type (a Hugging Face
    ``ModelOutput``...) where the model was split from a ``torch.export`` trace (``pipeline.TreeOutput``).
    Where the model declares its ``classes`` (``runtime.targets.output_classes``), ``train_step`` checks the
    targets' range on the global batch and the default loss only their shape. ``weights``: the default loss's
    :class:`TokenWeights` (``train_step`` sets them each step).
    """
    default = functools.partial(default_loss_fn, check_range=classes is None, weights=weights)
    if plan.strategy.tp == 1:
        loss = loss_fn or default
    elif loss_fn is None:
        loss = LogitsLoss(VocabParallelLoss(default, mesh[TP]))
    else:
        loss = ShardableOutputLoss(VocabParallelLoss(loss_fn, mesh[TP]))
    return loss if pipeline_output is None else pp_.StructuredOutputLoss(loss, pipeline_output)


class LogitsLoss:
    """``loss_fn(logits_of(outputs), targets)``: the logits taken out of the output before ``loss_fn`` runs."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits_of(outputs), targets)


class ShardableOutputLoss:
    """``loss_fn(outputs, targets)`` after checking that tensor parallelism can shard the output's logits."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if not (isinstance(outputs, torch.Tensor) or hasattr(outputs, "logits")):
            raise ConfigError(
                f"under tensor parallelism a custom loss_fn receives the output with its logits sharded on the "
                f"vocabulary, found in a tensor output or a .logits attribute, not in {_type_name(outputs)}; "
                "return one of those from the model, or drop loss_fn= (the default loss also reads 'logits' "
                "keys and tuples)"
            )
        return self.loss_fn(outputs, targets)


def target_check(loss_fn: LossFn | None, classes: int | None) -> Callable[[torch.Tensor], None] | None:
    """What ``train_step`` checks the global batch's targets with: the default loss's (against the ``classes`` the
    model declares, ``runtime.targets.output_classes``); nothing under a custom ``loss_fn``."""
    return None if loss_fn is not None else functools.partial(check_class_targets, classes=classes)
