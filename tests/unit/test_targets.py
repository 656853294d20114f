"""The default loss's targets (``runtime.targets``): integer class indices below the model's classes, or -100."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.runtime.losses import default_loss_fn
from tessera.runtime.targets import check_class_targets, check_logits_targets, output_classes


def test_class_indices_and_the_ignored_ones_pass():
    check_class_targets(torch.tensor([[0, 5, -100, 9]]), 10)
    check_class_targets(torch.full((2, 3), -100), 10)  # all ignored
    check_class_targets(torch.tensor([3, -100]), None)


@pytest.mark.parametrize(("targets", "classes", "message"), [
    (torch.tensor([[0, 10]]), 10, "target 10 is not below the model's 10 classes"),
    (torch.tensor([[0, -5]]), 10, "target -5 is negative"),
    (torch.tensor([[-1]]), None, "target -1 is negative"),
    (torch.tensor([[0.0, 1.0]]), 10, "targets are torch.float32"),
    (torch.tensor([[True]]), 10, "targets are torch.bool"),
    (torch.tensor([[3]], dtype=torch.int32), 10, "targets are torch.int32; .* as torch.long"),
    (torch.tensor([[-100, 12]]), 10, "target 12 is not below"),
])
def test_anything_else_is_refused_naming_the_value(targets, classes, message):
    with pytest.raises(ConfigError, match=message) as raised:
        check_class_targets(targets, classes)
    assert "\n" not in str(raised.value)


def test_the_default_loss_checks_the_shape_always_and_the_range_unless_told():
    logits = torch.zeros(2, 4, 8)
    with pytest.raises(ConfigError, match=r"targets of shape \(2, 3\) do not match the logits' leading shape \(2, 4\)"):
        default_loss_fn(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match="target 8 is not below the model's 8 classes"):
        default_loss_fn(logits, torch.full((2, 4), 8))
    check_logits_targets(logits, torch.full((2, 4), 8), check_range=False)  # train_step checked it: no host sync
    check_logits_targets(logits, torch.full((2, 4), 7))


def test_the_classes_a_model_declares():
    """A language model's output projection; a Hugging Face model without an output embedding (a classifier, whose
    config's vocab_size is not its labels) declares none."""
    class WithEmbeddingHead(nn.Module):
        def __init__(self, head: nn.Module | None) -> None:
            super().__init__()
            self.proj = head

        def get_output_embeddings(self) -> nn.Module | None:
            return self.proj

    class Classifier(WithEmbeddingHead):
        config = type("Config", (), {"vocab_size": 1000, "num_labels": 3})()

    class OwnModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 13)

    assert output_classes(WithEmbeddingHead(nn.Linear(4, 11))) == 11
    assert output_classes(Classifier(None)) is None
    assert output_classes(OwnModel()) == 13
    assert output_classes(nn.Linear(4, 4)) is None
