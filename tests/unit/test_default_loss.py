"""The default loss reads the logits from the outputs people's models return (no processes).

A logits tensor, an object with ``.logits`` or a ``"logits"`` key (Hugging Face ``ModelOutput``, dicts), a tuple
whose first element is the logits; anything else is a one-line ``ConfigError`` naming the type and ``loss_fn=``.
Also the pieces that carry the output to the loss under pipeline and tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from tessera.errors import ConfigError
from tessera.runtime.losses import LogitsLoss, ShardableOutputLoss, default_loss_fn, logits_of
from tessera.runtime.pipeline import DictOutputLoss, return_dict_as_tuple

B, T, V = 2, 3, 5


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def targets() -> torch.Tensor:
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # the default loss before outputs


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class NamedOutput(NamedTuple):
    hidden: torch.Tensor
    logits: torch.Tensor


def test_a_logits_tensor_gives_the_same_loss_as_before(logits, targets):
    assert torch.equal(default_loss_fn(logits, targets), plain_cross_entropy(logits, targets))


def test_bf16_logits_are_reduced_in_fp32(logits, targets):
    loss = default_loss_fn(logits.bfloat16(), targets)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, plain_cross_entropy(logits.bfloat16(), targets))


@pytest.mark.parametrize("wrap", [
    pytest.param(lambda x: {"logits": x, "aux": torch.zeros(())}, id="dict"),
    pytest.param(lambda x: Output(x, torch.zeros(1)), id="dataclass"),
    pytest.param(lambda x: NamedOutput(torch.zeros(1), x), id="namedtuple-logits-field"),
    pytest.param(lambda x: (x, torch.zeros(1)), id="tuple"),
    pytest.param(lambda x: [x], id="list"),
])
def test_outputs_holding_logits(wrap, logits, targets):
    assert logits_of(wrap(logits)) is logits
    assert torch.equal(default_loss_fn(wrap(logits), targets), plain_cross_entropy(logits, targets))


def test_a_hugging_face_model_output(logits, targets):
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    output = modeling_outputs.CausalLMOutputWithPast(logits=logits)  # loss=None, no cache: only "logits" is set
    assert torch.equal(default_loss_fn(output, targets), plain_cross_entropy(logits, targets))
    as_tuple = output.to_tuple()  # what return_dict=False returns
    assert torch.equal(default_loss_fn(as_tuple, targets), plain_cross_entropy(logits, targets))


def test_classifier_logits_against_class_targets():
    logits, targets = torch.randn(4, V), torch.tensor([0, 4, 2, 1])  # (B, V), (B,)
    assert torch.equal(default_loss_fn(logits, targets), F.cross_entropy(logits, targets))


def test_ignored_targets_follow_the_hugging_face_convention(logits, targets):
    targets = targets.clone()
    targets[0, 0] = -100
    kept = targets.flatten() != -100
    expected = F.cross_entropy(logits.flatten(0, 1)[kept], targets.flatten()[kept])
    torch.testing.assert_close(default_loss_fn(logits, targets), expected)


@pytest.mark.parametrize(("outputs", "type_name"), [
    pytest.param(3, "int", id="int"),
    pytest.param({"last_hidden_state": torch.zeros(1)}, "dict", id="dict-without-logits"),
    pytest.param(("text", torch.zeros(1)), "tuple", id="tuple-of-other"),
    pytest.param((), "tuple", id="empty-tuple"),
    pytest.param(Output(logits=None), "Output", id="logits-none"),
])
def test_an_unsupported_output_is_one_line_naming_its_type_and_loss_fn(outputs, type_name, targets):
    with pytest.raises(ConfigError) as raised:
        default_loss_fn(outputs, targets)
    message = str(raised.value)
    assert "\n" not in message
    assert f"of type {type_name}" in message or f".{type_name} " in message
    assert "loss_fn=" in message


def test_logits_loss_hands_the_inner_loss_the_logits_tensor(logits, targets):
    seen = []
    loss = LogitsLoss(lambda outputs, _: seen.append(outputs) or outputs.sum())
    loss({"logits": logits}, targets)
    assert seen == [logits]


def test_a_custom_tensor_parallel_loss_refuses_an_output_it_cannot_shard(logits, targets):
    loss = ShardableOutputLoss(lambda outputs, _: torch.zeros(()))
    loss(Output(logits), targets)  # a .logits attribute: shardable in place
    with pytest.raises(ConfigError, match=r"not in dict; return one of those .* drop loss_fn="):
        loss({"logits": logits}, targets)


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, V)

    def forward(self, x: torch.Tensor) -> dict:
        logits = self.head(x)
        return {"hidden": x, "logits": logits, "cache": None}


def test_a_last_pipeline_chunk_returning_a_dict_returns_its_tensors_and_the_loss_gets_the_dict_back():
    module = fx.symbolic_trace(DictModel())
    x = torch.randn(B, T, 4)
    expected = module(x)
    output = return_dict_as_tuple(module)
    returned = module(x)
    assert isinstance(returned, tuple) and all(isinstance(v, torch.Tensor) for v in returned)  # what pipelining sends
    seen = []
    loss = DictOutputLoss(lambda outputs, _: seen.append(outputs) or torch.zeros(()), output)
    loss(returned, None)  # at run time the stage output is the tuple
    assert seen[0].keys() == expected.keys() and seen[0]["cache"] is None
    assert all(torch.equal(seen[0][key], expected[key]) for key in ("hidden", "logits"))


def test_one_tensor_dict_output_unpacked_by_shape_inference_is_rebuilt():
    class LogitsOnly(nn.Module):
        def forward(self, x):
            return {"logits": x * 2}

    module = fx.symbolic_trace(LogitsOnly())
    output = return_dict_as_tuple(module)
    (logits,) = module(torch.ones(2))
    loss = DictOutputLoss(lambda outputs, _: outputs["logits"].sum(), output)
    assert loss(logits, None) == loss((logits,), None) == 4  # shape inference passes a 1-tuple's tensor alone


def test_tensor_and_tuple_outputs_are_left_alone():
    class TupleModel(nn.Module):
        def forward(self, x):
            return x + 1, x

    for model in (nn.Linear(2, 2), TupleModel()):
        assert return_dict_as_tuple(fx.symbolic_trace(model)) is None
