"""Model sources: presets and families, ``file.py:factory``, ``module:factory``, and ``hf:`` without transformers."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tessera.errors import ModelSpecError
from tessera.models import GPT, MoE
from tessera.planner.capture import capture_preset
from tessera.planner.model_source import absolute_spec, max_positions, resolve_model

FACTORY = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_model() -> nn.Module:
    return Tiny()


def not_a_model() -> int:
    return 3


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.stem(images)).flatten(1))


def make_cnn():
    return SmallCNN(), torch.zeros(4, 3, 16, 16)


def make_cnn_bad_inputs():
    return SmallCNN(), "images"
'''


@pytest.fixture()
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


def test_presets_and_families_resolve_on_meta() -> None:
    model, name = resolve_model("gpt3-175b:layers=2")
    assert isinstance(model, GPT) and name == "gpt3-175b:layers=2" and all(p.is_meta for p in model.parameters())
    moe, _ = resolve_model("moe:layers=1,hidden=32,heads=4,kv_heads=2,ffn=48,vocab=50,seq=16,experts=4,top_k=1")
    assert isinstance(moe, MoE) and max_positions(moe) == 16
    with pytest.raises(ModelSpecError, match="known presets"):
        resolve_model("llama9-1t")


def test_a_file_factory_is_built_on_meta_and_captured(factory_file: Path) -> None:
    model, name = resolve_model(f"{factory_file}:make_model")
    assert name.endswith("user_model.py:make_model") and all(p.is_meta for p in model.parameters())
    graph = capture_preset(f"{factory_file}:make_model", seq_len=16)
    assert [layer.fqn for layer in graph.layers] == ["emb", "blocks.0", "blocks.1", "head", "loss"]
    assert [(p.column, p.row, p.role) for p in graph.blocks[0].tp_pairs] == [(("0",), "2", "mlp")]
    with pytest.raises(ModelSpecError, match="not an nn.Module"):
        resolve_model(f"{factory_file}:not_a_model")
    with pytest.raises(ModelSpecError, match="no function 'missing'.*make_model"):
        resolve_model(f"{factory_file}:missing")
    with pytest.raises(ModelSpecError, match="does not exist"):
        resolve_model(f"{factory_file.parent / 'nope.py'}:make_model")


def test_a_factory_may_return_example_inputs_for_a_model_that_does_not_take_tokens(factory_file: Path) -> None:
    graph = capture_preset(f"{factory_file}:make_cnn", seq_len=1)
    assert [layer.fqn for layer in graph.layers][-2:] == ["head", "loss"]
    assert graph.unavailable_axes.keys() >= {"tp", "pp"}  # BatchNorm: data parallelism only, said by name
    with pytest.raises(ModelSpecError, match="example inputs of type str"):
        resolve_model(f"{factory_file}:make_cnn_bad_inputs")


def test_a_module_factory_resolves(factory_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(factory_file.parent))
    model, _ = resolve_model("user_model:make_model")
    assert type(model).__name__ == "Tiny"
    with pytest.raises(ModelSpecError, match="cannot import"):
        resolve_model("no_such_module_here:make_model")


def test_only_a_factory_files_path_is_made_absolute(factory_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(factory_file.parent)
    absolute = f"{factory_file}:make_model"
    assert absolute_spec(" user_model.py:make_model ") == absolute == absolute_spec(absolute)
    for spec in ("gpt3-175b:layers=2", "hf:llama:num_hidden_layers=2", "user_model:make_model", "Tiny"):
        assert absolute_spec(spec) == spec  # a preset, a config, an importable module, a model object's class name
    with pytest.raises(ModelSpecError, match=f"looked for {factory_file.parent / 'nope.py'} .*relative to"):
        resolve_model("nope.py:make_model")


def test_hf_spec_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ModelSpecError, match=r"pip install 'tessera\[hf\]'"):
        resolve_model("hf:llama:num_hidden_layers=2")


def test_capture_preset_checks_positions() -> None:
    with pytest.raises(ModelSpecError, match="gpt-tiny:seq=128"):
        capture_preset("gpt-tiny", seq_len=128)
    assert max_positions(torch.nn.Linear(2, 2)) is None
