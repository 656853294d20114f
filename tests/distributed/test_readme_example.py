"""The README's Hugging Face example (``examples/hf_tp_pp.py``) runs as printed: 4 gloo ranks, tp=2 x pp=2 through
``tessera.auto_parallelize`` with no adapter, and its losses equal plain single-process training of the same model
on the same batches (cross-entropy on ``outputs.logits``, AdamW at Tessera's default lr; harness tolerance)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tessera.runtime.launch import spawn

from .harness import FP32_TOL

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_tp_pp.py"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_tp_pp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_example() -> list[float]:
    return load_example().train()


USER_PLAN = {  # the user's own tensor-parallel plan, in the model's FQNs: q/k/v and gate/up by column, o/down by row
    **{f"model.layers.*.self_attn.{name}_proj": "colwise" for name in "qkv"}, "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def run_with_user_plan() -> list[float]:
    return load_example().train("tp=2", tp_plan=USER_PLAN)


def single_process_losses(example) -> list[float]:
    model = example.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(example.STEPS):
        tokens = torch.randint(example.VOCAB, (example.GLOBAL_BATCH, example.SEQ_LEN + 1), generator=generator)
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_readme_hugging_face_example_trains_like_one_process():
    per_rank = spawn(run_example, nprocs=4, timeout_s=600)
    expected = torch.tensor(single_process_losses(load_example()))
    for losses in per_rank:
        torch.testing.assert_close(torch.tensor(losses), expected, **FP32_TOL)


def test_a_users_tp_plan_is_what_plans_and_runs():
    per_rank = spawn(run_with_user_plan, nprocs=2, timeout_s=600)
    expected = torch.tensor(single_process_losses(load_example()))
    for losses in per_rank:
        torch.testing.assert_close(torch.tensor(losses), expected, **FP32_TOL)


def test_a_tp_plan_style_the_runtime_lacks_makes_tp_unavailable_by_name():
    import tessera
    from tessera.errors import ConfigError

    example = load_example()
    with pytest.raises(ConfigError, match="tp=2 is unavailable for this model: tp_plan entry .*'bogus'"):
        tessera.plan(example.tiny_llama(), "cpu:ranks=2", global_batch=8, seq_len=example.SEQ_LEN, strategy="tp=2",
                     tp_plan={**USER_PLAN, "model.layers.*.mlp.down_proj": "bogus"})
