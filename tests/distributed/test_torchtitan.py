"""torchtitan's Llama 3 trained by Tessera matches single-process training: the public entry point
(``tessera.auto_parallelize``: capture, plan with the strategy pinned, apply) under data parallelism and FSDP by
default, tensor parallelism (with and without sequence parallelism) under ``-m slow``.

The model is torchtitan's own ``debugmodel`` config (fused QKV, SwiGLU, RoPE, torchtitan's ``init_states``) cut to
2 blocks, with its plain SDPA attention (flex attention has no CPU backward); the same builder as
``benchmarks/torchtitan_overhead.py``, which times it against torchtitan's own parallelisation. Every rank starts
from a different seed (rank 0's weights must win); the reference trains the seed-0 model in one process on the
whole global batch with AdamW and plain cross-entropy written out here: per-step losses, identical on every rank,
and final parameters (tolerances and why: ``harness.py``). Each world size runs in one spawn.

Skipped with a reason when torchtitan's Llama 3 does not import (install: ``pip install --no-deps -r
requirements-torchtitan.txt``).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.cost_models.types import Strategy

from .harness import FP32_TOL, LR, PARAM_TOL, SEED, full_tensors, run_named

GLOBAL_BATCH, SEQ_LEN, STEPS, LAYERS, VOCAB = 8, 16, 3, 2, 2048
DEFAULT_CASES = {2: ["dp=2,zero=0,mbs=2,recompute=none",  # DDP, 2 micro-batches per step
                     "dp=2,zero=3,mbs=4,recompute=none"]}  # FSDP2 over the blocks, ZeRO-3
NO_OVERLAP = "tp_overlap=false,sp_regather=false"
SLOW_CASES = {2: [f"dp=1,tp=2,sp=false,zero=0,mbs=8,recompute=none,{NO_OVERLAP}",  # fused wqkv split per kv group
                  f"dp=1,tp=2,sp=true,zero=0,mbs=8,recompute=none,{NO_OVERLAP}"],
              4: [f"dp=2,tp=2,sp=true,zero=3,mbs=4,recompute=none,{NO_OVERLAP}"]}  # FSDP x TP


def torchtitan_missing() -> str | None:
    """Why torchtitan's Llama 3 cannot be used here, or None."""
    try:
        import torchtitan.models.llama3  # noqa: F401, PLC0415
    except ImportError as error:
        return (f"torchtitan's Llama 3 does not import ({error}); install it with "
                "pip install --no-deps -r requirements-torchtitan.txt")
    return None


MISSING = torchtitan_missing()
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]


@functools.cache
def benchmark():
    """``benchmarks/torchtitan_overhead.py`` (scripts, not a package), for its model builder."""
    path = Path(__file__).parents[2] / "benchmarks" / "torchtitan_overhead.py"
    spec = importlib.util.spec_from_file_location("torchtitan_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama3(seed: int) -> torch.nn.Module:
    """torchtitan's debugmodel (dim 256, 16 heads, vocabulary 2048) cut to 2 blocks: 2.8M parameters."""
    bench = benchmark()
    return bench.build_llama3(bench.llama3_config(seq_len=SEQ_LEN, layers=LAYERS), seed=seed)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]  # (B, T) inputs, next-token targets


def train_case(strategy: str) -> dict:
    """Runs on every rank: capture, plan (every field pinned), apply, train."""
    import tessera  # noqa: PLC0415

    model = llama3(SEED + dist.get_rank())
    parallel = tessera.auto_parallelize(model, f"cpu:ranks={dist.get_world_size()}", global_batch=GLOBAL_BATCH,
                                        seq_len=SEQ_LEN, strategy=strategy, precision="fp32")
    losses = [parallel.train_step(batch) for batch in batches()]
    return {"strategy": parallel.plan.strategy, "losses": losses,
            "params": full_tensors(parallel.named_parameters())}


def run_cases(strategies: list[str]) -> dict:
    """Runs on every rank: every case (a failure ends the spawn, named), with its wall time."""
    results, seconds = run_named((strategy, functools.partial(train_case, strategy)) for strategy in strategies)
    return {**results, "seconds": seconds}


@functools.cache
def spawned(world: int, slow: bool) -> list[dict]:
    from tessera.runtime.launch import spawn  # noqa: PLC0415

    cases = (SLOW_CASES if slow else DEFAULT_CASES)[world]
    return spawn(run_cases, nprocs=world, args=(cases,), timeout_s=600)


@functools.cache
def reference() -> dict:
    """Plain single-process training of the seed-0 model on the whole global batch."""
    model = llama3(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())  # (B*T, V) vs (B*T,)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_tensors(model.named_parameters())}


def check(world: int, strategy: str, *, slow: bool) -> None:
    per_rank = [results[strategy] for results in spawned(world, slow)]
    assert per_rank[0]["strategy"] == Strategy.parse(strategy)  # the plan is the pinned strategy
    assert all(result["losses"] == per_rank[0]["losses"] for result in per_rank), "ranks disagree on the loss"
    expected = reference()
    torch.testing.assert_close(per_rank[0]["losses"], expected["losses"], **FP32_TOL)
    assert per_rank[0]["params"].keys() == expected["params"].keys()  # FQNs unchanged; every shard gathered
    torch.testing.assert_close(per_rank[0]["params"], expected["params"], **PARAM_TOL)


@pytest.mark.parametrize("strategy", DEFAULT_CASES[2])
def test_data_parallel_and_fsdp_train_torchtitan_llama3_like_one_process(strategy):
    check(2, strategy, slow=False)


def test_the_spawn_stays_fast():
    seconds = spawned(2, False)[0]["seconds"]
    print({strategy: round(value, 1) for strategy, value in seconds.items()})
    assert sum(seconds.values()) < 90, seconds


@pytest.mark.slow
@pytest.mark.parametrize(("world", "strategy"), [(w, s) for w, cases in SLOW_CASES.items() for s in cases])
def test_tensor_parallelism_trains_torchtitan_llama3_like_one_process(world, strategy):
    check(world, strategy, slow=True)
