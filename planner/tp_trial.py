"""Whether each distinct block still runs once tensor parallelism leaves a rank its share: a trial on meta tensors.

The tensor-parallel rules (``cost_models.tp_rules``) read a block's modules: which linears split by columns or rows,
which attention modules hold head counts to divide. A forward can still read the full width from somewhere else --
a module-level constant (``y.reshape(B, T, D)``), a config -- and then fails on the first step with a shape error.
So capture runs each distinct block once as one rank of ``tp=2`` would hold it: its column linears' outputs and row
linears' inputs halved, its attention head counts divided (``tp_rules.localise_attention``, what the runtime
does), on the arguments the block received in a meta (else fake) forward of the model. A failure makes tensor
parallelism unavailable for the model, with the error's first line. Blocks with routed experts are not tried, and
linears of styles that gather or split their own data run whole; a trial that cannot be set up says nothing.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tessera.cost_models.layer_stats import LayerStats
from tessera.cost_models.tp_rules import (
    block_splits, head_split_attentions, is_conv1d, localise_attention, moe_containers,
)
from tessera.planner.front_ends import meta_twin
from tessera.planner.measure import ExampleInputs, example_inputs_at

TRIAL_TP = 2
"""The degree tried when the model's config declares no head counts: the smallest split; a forward that reads a
full width fails at any degree above 1."""
CONFIG_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")
"""The config fields (Hugging Face) that count a model's query and key/value heads: the trial splits them evenly."""
SHRUNK_OUTPUTS = frozenset({"colwise", "packed_colwise"})
SHRUNK_INPUTS = frozenset({"rowwise"})


class _Recorded(Exception):
    """Raised by the last recording hook: the rest of the model's forward is not needed."""


def local_forward_problem(
    model: nn.Module, planned: Sequence[LayerStats], plan: Mapping[str, str], *, example_inputs: ExampleInputs | None,
    seq_len: int, skip: Mapping[str, Iterable[str]],
) -> str | None:
    """Why a distinct block of ``model`` fails its forward as one rank of ``tp=2`` holds it (one line), or None.
    ``plan``: the tensor-parallel plan (glob -> style); ``skip``: per block, the linears kept whole (routers)."""
    distinct = [fqn for fqn in _distinct_blocks(planned) if not moe_containers(model.get_submodule(fqn))]
    if not distinct:
        return None
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs a failed op before raising it
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the model's own deprecation notes: capture's forwards said them already
            try:
                twin = meta_twin(model)
            except Exception:  # noqa: BLE001 -- an attribute deepcopy refuses (a lock): no trial
                return None
            counts, tp = trial_degree(getattr(model, "config", None))
            for mode in (None, FakeTensorMode(allow_non_fake_inputs=True)):  # fake: a forward calling .item() on a mask
                try:
                    with mode or nullcontext():
                        problem = _trial(twin, _first_calls(twin, distinct, example_inputs, seq_len), plan, skip,
                                         tp=tp or TRIAL_TP)
                    if problem is not None and tp is None:  # a plan gathering whole heads (Falcon's) needs no split
                        return (f"{type(model).__name__}'s config declares {counts}: no tensor-parallel degree splits "
                                "them evenly (one key/value head); plan with tp=1")
                    return problem
                except _NoTrial:
                    continue
        return None
    finally:
        quiet.setLevel(level)


class _NoTrial(Exception):
    """The model's own forward did not run this way: no trial, no verdict."""


def trial_degree(config: object) -> tuple[str, int | None]:
    """The declared head counts (``"num_attention_heads=8, num_key_value_heads=3"``, or empty) and the smallest
    degree above 1 splitting them all (:data:`TRIAL_TP` with none declared); None when none does (a single key/value
    head: every degree fails for that alone, which is not what the trial looks for)."""
    counts = {name: value for name in CONFIG_HEAD_COUNTS
              if isinstance(value := getattr(config, name, None), int) and not isinstance(value, bool) and value > 0}
    if not counts:
        return "", TRIAL_TP
    common = math.gcd(*counts.values())
    text = ", ".join(f"{name}={value}" for name, value in counts.items())
    return text, next((d for d in range(2, common + 1) if common % d == 0), None)


def _trial(twin: nn.Module, calls: Mapping[str, tuple[tuple, dict]], plan: Mapping[str, str],
           skip: Mapping[str, Iterable[str]], *, tp: int) -> str | None:
    for fqn, (args, kwargs) in calls.items():
        _run(copy.deepcopy(twin.get_submodule(fqn)), args, kwargs)  # whole, as the control: it must run this way
        block = copy.deepcopy(twin.get_submodule(fqn))
        splits = block_splits(block, fqn, plan=plan, skip=skip.get(fqn, ()))
        for split in splits:
            _shrink(block.get_submodule(split.name), split.style, tp)
        for name in head_split_attentions(block, splits):
            localise_attention(block.get_submodule(name), tp)
        try:
            with torch.no_grad():
                block(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 -- any failure is the verdict, named
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            return (f"{fqn}'s forward fails on one rank's share of its heads and linears (tp={tp}: "
                    f"{type(error).__name__}: {first}): it reads a full width from outside its modules (a "
                    "constant, a config); read the width from its tensors (reshape(B, T, -1)), or plan with tp=1")
    return None


def _run(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """The whole block's forward; ``_NoTrial`` if it fails (on meta: a guard reading a value unless traced)."""
    try:
        with torch.no_grad():
            block(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 -- not the split's doing: another mode, or no verdict
        raise _NoTrial from error


def _distinct_blocks(planned: Sequence[LayerStats]) -> list[str]:
    """The first block of each signature (class, parameter shapes, measured numbers), in order."""
    seen: dict[str, str] = {}
    for layer in planned:
        if layer.kind == "block":
            seen.setdefault(layer.signature, layer.fqn)
    return list(seen.values())


def _first_calls(model: nn.Module, fqns: Sequence[str], example_inputs: ExampleInputs | None,
                 seq_len: int) -> dict[str, tuple[tuple, dict]]:
    """Each block's arguments at its first call in a meta forward of ``model`` (stopped once all are in)."""
    calls: dict[str, tuple[tuple, dict]] = {}

    def record(fqn: str, args: tuple, kwargs: dict) -> None:
        calls.setdefault(fqn, (args, kwargs))
        if len(calls) == len(fqns):
            raise _Recorded

    handles = [model.get_submodule(fqn).register_forward_pre_hook(
        lambda _m, a, k, fqn=fqn: record(fqn, a, k), with_kwargs=True) for fqn in fqns]
    args, kwargs = example_inputs_at(example_inputs, seq_len)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except _Recorded:
        pass
    except Exception as error:  # noqa: BLE001 -- the whole model's forward: capture ran it another way
        raise _NoTrial from error
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _shrink(linear: nn.Module, style: str, tp: int) -> None:
    """``linear`` as a rank of ``tp`` holds it: outputs (column styles) or inputs (row) divided by ``tp``."""
    if style not in SHRUNK_OUTPUTS | SHRUNK_INPUTS:
        return
    conv1d = is_conv1d(linear)  # GPT-2's Conv1D keeps its weight as (in, out)
    weight = linear.weight
    out_dim, in_dim = (1, 0) if conv1d else (0, 1)
    shape = list(weight.shape)
    dim = out_dim if style in SHRUNK_OUTPUTS else in_dim
    shape[dim] //= tp
    linear.weight = nn.Parameter(torch.empty(shape, device="meta", dtype=weight.dtype), requires_grad=False)
    if style in SHRUNK_OUTPUTS and getattr(linear, "bias", None) is not None:
        linear.bias = nn.Parameter(torch.empty(shape[out_dim], device="meta", dtype=weight.dtype), requires_grad=False)
    for attribute, dim_of in (("out_features", out_dim), ("in_features", in_dim), ("nf", out_dim)):
        if isinstance(getattr(linear, attribute, None), int):
            setattr(linear, attribute, shape[dim_of])
