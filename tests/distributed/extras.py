"""Checks that run inside the shared spawns of ``harness.world_results`` besides the training cases.

Each function runs on every rank and returns a picklable result (or raises: the harness records it).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import tessera
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.errors import RuntimeSetupError
from tessera.planner.plan import Plan, PlannedLayer
from tessera.runtime.apply import apply_plan
from tessera.runtime.mesh import build_mesh

from .harness import (
    GLOBAL_BATCH, GPT, LLAMA, SEED, SEQ_LEN, STEPS, dummy_estimate, make_batches, make_model, make_plan,
    parameter_bytes, track_parameter_bytes,
)

PINNED = "dp=2,tp=2,zero=3,mbs=2,recompute=selective,sp=true"
COMPILE_MODEL, COMPILE_STEPS = "gpt-tiny", 2


def auto_free_choice() -> dict:
    """The public entry point with the strategy the planner chooses for GPT on this world (preset on meta)."""
    torch.manual_seed(SEED)
    parallel = tessera.auto_parallelize(GPT, f"cpu:ranks={dist.get_world_size()}", global_batch=GLOBAL_BATCH,
                                        seq_len=SEQ_LEN)
    losses = [parallel.train_step(batch) for batch in make_batches(GPT)]
    return {"losses": losses, "strategy": parallel.plan.strategy.to_string()}


def auto_pinned() -> dict:
    """auto_parallelize with a pinned 2-D strategy: losses, and parameter bytes against the plan's estimate."""
    torch.manual_seed(SEED)
    parallel = tessera.auto_parallelize(LLAMA, "cpu:ranks=4", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN,
                                        strategy=PINNED)
    peak = track_parameter_bytes(parallel.modules)
    losses = [parallel.train_step(batch) for batch in make_batches(LLAMA)]
    return {"losses": losses, "param_bytes": sum(peak.values()), "at_rest_bytes": parameter_bytes(
        p for _, p in parallel.named_parameters()), "estimate": parallel.plan.estimate.memory_by_category_bytes}


def world_size_mismatch() -> str:
    try:
        build_mesh(Strategy(dp=2 * dist.get_world_size()))
    except RuntimeSetupError as error:
        return str(error)
    return "no error"


def plans_disagree() -> str:
    """Rank 1 plans a different micro-batch: every rank must refuse, naming the disagreement."""
    model = make_model(GPT)
    world = dist.get_world_size()
    plan = make_plan(GPT, model, f"dp={world},mbs={2 if dist.get_rank() == 1 else 1}")
    try:
        apply_plan(model, plan)
    except RuntimeSetupError as error:
        return str(error)
    return "no error"


def compiled_blocks() -> list[float]:
    """torch.compile per block under FSDP2 (ZeRO-3) with recomputation; each rank its own Inductor cache, removed
    afterwards."""
    cache = tempfile.mkdtemp(prefix=f"tessera-inductor-rank{dist.get_rank()}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        model = make_model(COMPILE_MODEL)
        plan = make_plan(COMPILE_MODEL, model, f"dp={dist.get_world_size()},zero=3,mbs=4,recompute=full")
        parallel = apply_plan(model, plan, compile_blocks=True)
        return [parallel.train_step(batch) for batch in make_batches(COMPILE_MODEL, COMPILE_STEPS)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)


EXTRAS = {
    2: (auto_free_choice, world_size_mismatch, plans_disagree, compiled_blocks),
    4: (auto_free_choice, auto_pinned, world_size_mismatch),
}
assert STEPS >= COMPILE_STEPS


# ------------------------------------------------------------------------------- a Hugging Face Llama (optional)

HF_STEPS = 3


def hf_llama():
    """A tiny Hugging Face Llama (transformers' own modules and forward), built from seed 0 on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def hf_plan(model, strategy: str):
    """The plan capture would make, by hand: Hugging Face module names, ``other`` for the rotary module."""
    kinds = [("model.embed_tokens", "embedding"), *((f"model.layers.{i}", "block") for i in range(2)),
             ("model.norm", "norm"), ("model.rotary_emb", "other"), ("lm_head", "head")]
    layers = tuple(PlannedLayer(fqn=fqn, kind=kind, recompute="none") for fqn, kind in kinds)
    return Plan(model_name="hf-llama", param_count=sum(p.numel() for p in model.parameters()), cluster="test",
                device_name="cpu", training=TrainingConfig(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"),
                strategy=Strategy.parse(strategy), estimate=dummy_estimate(), layers=layers)


def hf_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(outputs.logits.float().flatten(0, 1), targets.flatten())


def hf_llama_tensor_parallel() -> list[float] | str:
    """transformers' Llama under tp=2 with sequence parallelism: pairs found from its module tree."""
    try:
        model = hf_llama()
    except ImportError:
        return "transformers is not installed"
    parallel = apply_plan(model, hf_plan(model, "dp=1,tp=2,sp=true,mbs=4"), loss_fn=hf_loss)
    return [parallel.train_step(batch) for batch in make_batches(LLAMA, HF_STEPS)]


EXTRAS[2] = (*EXTRAS[2], hf_llama_tensor_parallel)
