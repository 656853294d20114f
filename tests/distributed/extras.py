"""Checks that run inside the shared spawns of ``harness.world_results`` besides the training cases.

Each function runs on every rank and returns a picklable result (or raises: the harness records it).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import tessera
from tessera.cost_models.types import Strategy
from tessera.errors import RuntimeSetupError
from tessera.runtime.apply import apply_plan
from tessera.runtime.mesh import build_mesh

from .harness import (
    GLOBAL_BATCH, GPT, LLAMA, SEED, SEQ_LEN, STEPS, make_batches, make_model, make_plan, parameter_bytes,
    track_parameter_bytes,
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
    """torch.compile per block under FSDP2 (ZeRO-3) with recomputation; each rank its own Inductor cache."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"tessera-inductor-rank{dist.get_rank()}-")
    model = make_model(COMPILE_MODEL)
    plan = make_plan(COMPILE_MODEL, model, f"dp={dist.get_world_size()},zero=3,mbs=4,recompute=full")
    parallel = apply_plan(model, plan, compile_blocks=True)
    return [parallel.train_step(batch) for batch in make_batches(COMPILE_MODEL, COMPILE_STEPS)]


EXTRAS = {
    2: (auto_free_choice, world_size_mismatch, plans_disagree, compiled_blocks),
    4: (auto_free_choice, auto_pinned, world_size_mismatch),
}
assert STEPS >= COMPILE_STEPS
