"""Shared pieces of the distributed tests: hand-built plans, the single-process reference, per-rank training.

Every case trains a tiny model from the same seed with AdamW on the same global batches and is compared
with plain single-process training on the whole global batch: per-step losses, first-step gradients and
final parameters (gathered from every rank's shards).
"""

from __future__ import annotations

import functools
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.cost_models.types import Estimate, Strategy, TrainingConfig
from tessera.models import build_model, model_config
from tessera.planner.plan import Plan, PlannedLayer
from tessera.runtime.apply import apply_plan
from tessera.topology.hardware import LOCAL_CPU

SEED, LR, STEPS = 0, 1e-3, 5
GLOBAL_BATCH, SEQ_LEN = 8, 16
GPT = "gpt-tiny:layers=4"  # 4 blocks so pp=2 can interleave 2 chunks per rank; hidden 64, vocab 256: 237K params
LLAMA = "llama-tiny:layers=4"  # grouped-query attention (4 heads, 2 key/value heads), SwiGLU, RoPE: 230K params

# fp32 losses and gradients: the distributed run sums the same numbers in a different order (gloo
# all-reduce/reduce-scatter of gradients; tensor-parallel partial sums of row linears and of the vocabulary
# in loss_parallel), so results differ by a few float32 ulps (~1e-7 relative). rtol 1e-5 leaves 100x margin
# and is still far below any real bug (a missed reduction or a wrong scale is >= 1e-2 relative).
# Gradients: the largest are ~1e-2; an element that is a sum with heavy cancellation (a bias gradient sums
# the output gradient over all B*T tokens) keeps the absolute rounding error of its terms, so its relative
# error can exceed 1e-5 (seen: 4e-8 absolute on a 1e-3 row-parallel bias gradient under tp=2). atol 1e-7 is
# 1e-5 of the largest gradient.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
# Parameters after several AdamW steps: AdamW divides each gradient by sqrt(v) + eps (1e-8), which turns a
# ~1e-7 relative gradient difference on elements whose gradient is ~0 (the attention key bias's exact
# gradient is zero: softmax ignores a shift shared by all keys) into a visible part of an lr=1e-3 step.
# atol 1e-4 is 10% of one lr step; a real bug (wrong scale, missed reduction) moves parameters by ~lr.
PARAM_TOL = dict(rtol=1e-5, atol=1e-4)
# bf16 has an 8-bit mantissa (relative step 2^-8 ~ 4e-3); the loss of a few steps stays within ~1%.
BF16_LOSS_TOL = dict(rtol=2e-2, atol=0.0)

NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def make_model(spec: str, seed: int = SEED, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return build_model(spec, device=device)


def make_batches(spec: str, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    vocab = model_config(spec).vocab
    tokens = torch.randint(vocab, (steps, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]  # (B, T) inputs, next-token targets


def layer_kind(module: nn.Module, *, last: bool) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, NORM_TYPES):
        return "norm"
    return "head" if last and isinstance(module, nn.Linear) else "other"


def make_plan(spec: str, model: nn.Module, strategy: str, precision: str = "fp32") -> Plan:
    """A hand-built Plan (no planner): ModuleList items are blocks, other top-level children layers.

    Pipeline chunks: blocks split evenly over ``pp * V`` chunks; embeddings join the first chunk, the final
    norm and head the last.
    """
    parsed = Strategy.parse(strategy)
    children = list(model.named_children())
    blocks = [f"{name}.{i}" for name, child in children if isinstance(child, nn.ModuleList) for i in range(len(child))]
    chunks = parsed.pp * parsed.virtual_stages
    layers, seen_blocks = [], False
    for position, (name, child) in enumerate(children):
        if isinstance(child, nn.ModuleList):
            seen_blocks = True
            layers += [PlannedLayer(fqn=fqn, kind="block", recompute=parsed.recompute,
                                    chunk=index * chunks // len(blocks)) for index, fqn in enumerate(blocks)]
        else:
            kind = layer_kind(child, last=position == len(children) - 1)
            layers.append(PlannedLayer(fqn=name, kind=kind, recompute="none", chunk=chunks - 1 if seen_blocks else 0))
    layers.append(PlannedLayer(fqn="loss", kind="loss", recompute="none", chunk=chunks - 1))
    return Plan(
        model_name=spec, param_count=sum(p.numel() for p in model.parameters()), cluster="test",
        device_name=LOCAL_CPU, training=TrainingConfig(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision=precision),
        strategy=parsed, estimate=dummy_estimate(), layers=tuple(layers),
    )


def dummy_estimate() -> Estimate:
    memory = {"parameters": 1, "gradients": 1, "optimizer": 2, "activations": 1}
    return Estimate(
        step_time_s=1.0, compute_time_s=1.0, recompute_time_s=0.0, optimizer_time_s=0.0, exposed_comm_time_s=0.0,
        comm_time_by_kind_s={}, memory_by_category_bytes=memory, peak_memory_bytes=sum(memory.values()),
        memory_budget_bytes=1 << 30, tokens_per_s=1.0, model_flops_per_step=1.0, mfu=0.1,
    )


def full_tensors(named) -> dict[str, torch.Tensor]:
    """Unsharded copies keyed by the user's FQNs (a collective for DTensors: call on every rank)."""
    full = {}
    for name, tensor in named:
        if tensor is None:
            continue
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full[name.removeprefix("module.")] = tensor.detach().clone()  # DDP adds "module."
    return full


def record_first_gradients(named_params, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Fill the returned dict with the full gradients that the first ``optimizer.step()`` sees."""
    grads: dict[str, torch.Tensor] = {}
    params = list(named_params)

    def hook(*_) -> None:
        if not grads:
            grads.update(full_tensors((name, p.grad) for name, p in params))

    optimizer.register_step_pre_hook(hook)
    return grads


@functools.cache
def reference(spec: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain single-process training on the whole global batch: the ground truth."""
    model = make_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = record_first_gradients(model.named_parameters(), optimizer)
    losses = []
    for inputs, targets in make_batches(spec, steps):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads, full_tensors(model.named_parameters())


def parameter_bytes(params) -> int:
    """Bytes of ``params`` as this rank holds them (the local shard of a DTensor)."""
    total = 0
    for param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


def track_parameter_bytes(modules) -> dict[int, int]:
    """Peak bytes of the parameters registered on each module right after its forward (FSDP2 registers
    the unsharded parameters between forward and backward unless it reshards after forward: ZeRO-3)."""
    peak: dict[int, int] = {}
    for index, module in enumerate(modules):
        def hook(module, args, output, index=index):
            peak[index] = max(peak.get(index, 0), parameter_bytes(module.parameters()))
        module.register_forward_hook(hook)
    return peak


def train_case(spec: str, strategy: str, precision: str = "fp32", meta: bool = False, steps: int = STEPS) -> dict:
    """Runs on every rank. Seeds differ per rank on purpose (rank 0's weights must win), except on meta
    (a meta model is initialised on every rank from the same seed, exactly as the unsharded one)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = make_model(spec, SEED, device="meta") if meta else make_model(spec, SEED + rank)
    plan = make_plan(spec, model, strategy, precision)
    torch.manual_seed(SEED)
    parallel = apply_plan(model, plan)
    peak = track_parameter_bytes(parallel.modules)
    grads = record_first_gradients(list(parallel.named_parameters()), parallel.optimizer)
    losses = [parallel.train_step(batch) for batch in make_batches(spec, steps)]
    return {"losses": losses, "grads": grads, "params": full_tensors(parallel.named_parameters()),
            "param_bytes": sum(peak.values())}


def run_named(runs) -> tuple[dict, dict]:
    """Runs on every rank: each ``(key, function)`` of ``runs``; returns the results and wall seconds by key.

    A run that raises ends the whole spawn (re-raised with its key named): a rank that fails while its
    pipeline peers wait in a send/recv would otherwise leave them blocked until the timeout."""
    results, seconds = {}, {}
    for key, run in runs:
        started = time.perf_counter()
        try:
            results[key] = run()
        except Exception as error:
            raise RuntimeError(f"case {key} failed") from error
        seconds[key] = time.perf_counter() - started
    return results, seconds


def run_world(cases: list[tuple], extras: tuple = ()) -> dict:
    """Runs on every rank: every case, then each ``extras`` function (called with no arguments).

    A case that raises ends the whole spawn (re-raised with the case named): a rank that fails while its
    pipeline peers wait in a send/recv would otherwise leave them blocked until the timeout. Extras raise
    only before or after every collective, alike on every rank, so their errors are recorded instead.
    """
    results, seconds = run_named((case, functools.partial(train_case, *case)) for case in cases)
    for extra in extras:
        started = time.perf_counter()
        try:
            results[extra.__name__] = extra()
        except Exception:
            results[extra.__name__] = {"error": traceback.format_exc()}
        seconds[extra.__name__] = time.perf_counter() - started
    results["seconds"] = seconds
    return results


def merged(per_rank: list[dict], key) -> dict:
    """One case's results over all ranks: losses per rank, gradients and parameters merged over pipeline ranks."""
    if "spawn_error" in per_rank[0]:
        raise AssertionError(per_rank[0]["spawn_error"])
    errors = [r[key]["error"] for r in per_rank if isinstance(r[key], dict) and "error" in r[key]]
    if errors:
        raise AssertionError(f"case {key} failed on a rank:\n{errors[0]}")
    grads, params = {}, {}
    for results in per_rank:
        grads.update(results[key]["grads"])
        params.update(results[key]["params"])
    return {"losses": [r[key]["losses"] for r in per_rank], "grads": grads, "params": params,
            "param_bytes": [r[key]["param_bytes"] for r in per_rank]}


def assert_ranks_match(per_rank: list[dict], expected: dict) -> None:
    """Every rank returned the same losses, equal to ``expected``'s, and the ranks' gathered parameters (pipeline
    stages hold different layers) equal ``expected``'s final parameters (fp32)."""
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), "ranks disagree on the loss"
    torch.testing.assert_close(per_rank[0]["losses"], expected["losses"], **FP32_TOL)
    params = {}
    for result in per_rank:
        params.update(result["params"])
    torch.testing.assert_close(params, expected["params"], **PARAM_TOL)


def assert_matches_reference(result: dict, spec: str, precision: str = "fp32", steps: int = STEPS) -> None:
    """Every rank returned the same losses; they, the first gradients and final parameters match one process."""
    ref_losses, ref_grads, ref_params = reference(spec, steps)
    losses = result["losses"]
    assert all(rank_losses == losses[0] for rank_losses in losses), f"ranks disagree on the loss: {losses}"
    if precision == "bf16":
        torch.testing.assert_close(losses[0], ref_losses, **BF16_LOSS_TOL)
        assert losses[0] != ref_losses  # bf16 really ran: it rounds differently from fp32
        return
    torch.testing.assert_close(losses[0], ref_losses, **FP32_TOL)
    assert result["params"].keys() == ref_params.keys()  # FQNs unchanged; every rank's shard gathered
    torch.testing.assert_close(result["grads"], ref_grads, **GRAD_TOL)
    torch.testing.assert_close(result["params"], ref_params, **PARAM_TOL)


# ------------------------------------------------------------------------------------------------ the spawns

# Every case of one world size runs in ONE spawn (process start-up dominates on 2 cores): (spec, strategy,
# precision, meta). Accumulation = GLOBAL_BATCH / (dp * mbs). The test files pick their cases from these lists.
DATA_PARALLEL_CASES = {
    2: [(GPT, "dp=2,zero=0,mbs=4", "fp32", False),
        (GPT, "dp=2,zero=0,mbs=2,recompute=full", "fp32", False),  # accumulation 2
        (GPT, "dp=2,zero=1,mbs=2", "fp32", False),  # ZeRO-1: one reduce-scatter per step
        (LLAMA, "dp=2,zero=2,mbs=2,recompute=selective", "fp32", False),
        (GPT, "dp=2,zero=3,mbs=1,recompute=full", "fp32", False),  # accumulation 4
        (GPT, "dp=2,zero=3,mbs=4", "bf16", False),
        (LLAMA, "dp=2,zero=3,mbs=2", "fp32", True)],  # built on meta: sharded materialisation
    4: [(GPT, "dp=4,zero=0,mbs=1", "fp32", False),  # accumulation 2
        (LLAMA, "dp=4,zero=1,mbs=1", "fp32", False),
        (GPT, "dp=4,zero=3,mbs=2,recompute=full", "fp32", False),
        (GPT, "dp=4,zero=0,mbs=2", "bf16", False)],
}
MODEL_PARALLEL_CASES = {
    2: [(GPT, "dp=1,tp=2,mbs=4", "fp32", False),
        (LLAMA, "dp=1,tp=2,sp=true,mbs=4,recompute=selective", "fp32", False),
        (GPT, "dp=1,tp=2,sp=true,mbs=4,recompute=full", "fp32", False),
        (GPT, "dp=1,pp=2,mbs=1,schedule=gpipe", "fp32", False),
        (LLAMA, "dp=1,pp=2,mbs=2,schedule=1f1b", "fp32", False),
        (GPT, "dp=1,pp=2,mbs=1,schedule=interleaved:2,recompute=full", "fp32", False),
        (LLAMA, "dp=1,pp=2,mbs=2,schedule=zero-bubble", "fp32", False)],
    4: [(LLAMA, "dp=2,tp=2,zero=0,mbs=4", "fp32", False),
        (GPT, "dp=2,tp=2,sp=true,zero=3,mbs=4", "fp32", False),
        (LLAMA, "dp=2,tp=2,zero=1,mbs=4,recompute=selective", "fp32", False),
        (GPT, "dp=2,pp=2,zero=0,mbs=2,schedule=1f1b", "fp32", False),
        (LLAMA, "dp=2,pp=2,zero=2,mbs=1,schedule=interleaved:2", "fp32", False),
        (LLAMA, "dp=1,tp=2,pp=2,sp=true,mbs=2,schedule=1f1b,recompute=full", "fp32", False),
        (GPT, "dp=1,tp=2,pp=2,mbs=2,schedule=interleaved:2,recompute=selective", "fp32", False),
        (GPT, "dp=1,pp=4,mbs=1,schedule=gpipe", "fp32", False),
        (GPT, "dp=1,pp=4,mbs=4,schedule=1f1b", "fp32", False),  # 2 micro-batches < 4 stages: runs as GPipe
        (LLAMA, "dp=2,tp=2,sp=true,zero=3,mbs=4", "fp32", True),
        (LLAMA, "dp=1,tp=2,pp=2,mbs=2,schedule=zero-bubble", "fp32", True)],
}


@functools.cache
def world_results(world: int) -> list[dict]:
    """Every case and extra check of one world size, run in one spawn; results in rank order."""
    from . import extras  # noqa: PLC0415 (extras import harness)
    from tessera.runtime.launch import WorkerError, spawn

    cases = DATA_PARALLEL_CASES[world] + MODEL_PARALLEL_CASES[world]
    try:
        return spawn(run_world, nprocs=world, args=(cases, extras.EXTRAS[world]), timeout_s=600,
                     crash_retries=1)  # training cases and extras in fresh folders: safe to rerun
    except WorkerError as error:  # cached too: every test of this world reports it without a new spawn
        return [{"spawn_error": str(error)}] * world


def extra_results(world: int, name: str) -> list:
    """Each rank's result of the extra check ``name`` (``extras.py``); a failure is raised with its traceback."""
    per_rank = world_results(world)
    if "spawn_error" in per_rank[0]:
        raise AssertionError(per_rank[0]["spawn_error"])
    for result in per_rank:
        if isinstance(result[name], dict) and "error" in result[name]:
            raise AssertionError(f"{name} failed:\n{result[name]['error']}")
    return [result[name] for result in per_rank]


# ------------------------------------------------------------------------- expert and context parallelism

# moe-tiny (2 blocks, 4 experts, top-2, no shared expert) at capacity factor 2 = experts / top_k: each expert
# has a slot for every token, so no assignment is ever dropped. Under data (and expert) parallelism each rank
# routes its own rows with a capacity computed from its own token count (what a real run does, as GShard);
# the single-process reference routes the whole batch at once. Without drops both compute exactly the same
# function of each token, so training must match. Drops themselves are checked where the two agree by
# definition: ``expert_layer_check`` compares the expert-parallel layer with the single-process layer called
# on the same local tokens, at capacity factor 1 (where tokens are dropped).
MOE = "moe-tiny:capacity=2"
MOE_DROPS = "moe-tiny"

# (spec, strategy, precision, meta); one spawn per world size for both test files (start-up dominates).
SPARSE_LONG_CASES = {
    2: [(MOE, "dp=2,ep=2,mbs=4", "fp32", False),  # EP alone: dense parts data-parallel, experts split
        (MOE, "dp=2,ep=2,zero=3,mbs=2,recompute=full", "fp32", False),  # + FSDP, accumulation 2, recompute
        (MOE, "dp=1,tp=2,mbs=4", "fp32", False),  # MoE under TP alone: experts split like the MLP
        (MOE, "dp=2,ep=2,zero=3,mbs=4", "bf16", True),  # bf16 all-to-alls, FSDP2 mixed precision; built on meta
        (LLAMA, "dp=1,cp=2,mbs=4,recompute=selective", "fp32", False),  # CP alone: RoPE at global positions, GQA
        (GPT, "dp=1,cp=2,mbs=2,recompute=full", "fp32", False),  # learned positions, accumulation 4
        (LLAMA, "dp=1,cp=2,mbs=4", "bf16", False),  # under autocast: the ring's flash blocks in bf16, as SDPA runs
        (LLAMA, "dp=1,cp=2,zero=3,mbs=2", "fp32", False)],  # ZeRO-3 with no dp: FSDP over the cp ranks alone
    4: [(MOE, "dp=4,ep=4,mbs=1", "fp32", False),  # one expert per rank, accumulation 2
        (MOE, "dp=4,ep=2,zero=1,mbs=2", "fp32", False),  # EP with DP: experts replicated over edp=2
        (MOE, "dp=2,ep=2,tp=2,mbs=4", "fp32", False),  # EP with TP on attention and experts
        (MOE, "dp=2,ep=2,cp=2,zero=1,mbs=4", "fp32", False),  # EP with CP: experts averaged over edp x cp
        # EP with PP: each ep group inside a pipeline stage (mesh edp, pp, ep, cp, tp); 2 micro-batches
        (MOE, "dp=2,ep=2,pp=2,mbs=2,schedule=1f1b", "fp32", False),
        (MOE, "dp=2,ep=2,pp=2,zero=1,mbs=1,schedule=1f1b", "fp32", False),  # + ZeRO-1, 4 micro-batches
        (MOE, "dp=2,ep=2,pp=2,mbs=2,schedule=zero-bubble", "fp32", False),  # all-to-alls in split backward
        (LLAMA, "dp=1,cp=4,mbs=4,recompute=full", "fp32", False),  # a ring of 4
        (GPT, "dp=2,cp=2,zero=3,mbs=2", "fp32", False),  # CP with DP (FSDP over dp x cp)
        (LLAMA, "dp=2,cp=2,zero=0,mbs=4", "fp32", False),  # CP with DP (replicate over dp x cp)
        (LLAMA, "dp=1,cp=2,tp=2,mbs=4", "fp32", False)],  # CP with TP
}


def expert_layer_check() -> dict:
    """Runs on every rank: the expert-parallel layer against the single-process ``MoELayer`` where tokens drop.

    Every rank routes different tokens; the reference runs the full layer on each rank's tokens in turn.
    Outputs, input gradients and router gradients must equal the reference on this rank's tokens; each local
    expert's weight gradient, times ``ep`` (the layer divides it by ``ep`` for the data-parallel average),
    must equal the sum over every rank's tokens. Also returns what makes the check meaningful: dropped
    assignments and the uneven all-to-all splits.
    """
    from tessera.models.moe import MoELayer, expert_capacity  # noqa: PLC0415
    from tessera.runtime.expert_parallel import ExpertParallelMoE  # noqa: PLC0415
    from tessera.runtime.mesh import EP, build_mesh  # noqa: PLC0415

    world, rank = dist.get_world_size(), dist.get_rank()
    config = model_config(MOE_DROPS)
    torch.manual_seed(SEED)
    layer = MoELayer(config)
    data = [_layer_data(config.hidden, r) for r in range(world)]
    reference, expert_sums = _reference_layer_runs(layer, data, rank)
    mesh = build_mesh(Strategy(dp=world, ep=world))
    # the same modules (the reference's results are copies): this rank's experts, run by all-to-all
    ep_layer = ExpertParallelMoE(layer, group=mesh.get_group(EP), ep=world, ep_rank=mesh.get_local_rank(EP))
    ours = _layer_run(ep_layer, *data[rank])
    x = data[rank][0].flatten(0, 1)
    chosen = F.softmax(layer.router(x).float(), dim=-1).topk(config.top_k, dim=-1).indices  # (N, k)
    loads = torch.bincount(chosen.flatten(), minlength=config.experts)  # (E,)
    capacity = expert_capacity(x.shape[0], experts=config.experts, top_k=config.top_k,
                               capacity_factor=config.capacity_factor)
    local_experts = {name: param.grad * world for name, param in ep_layer.experts.named_parameters()}
    return {"ours": ours, "reference": reference, "experts": local_experts,
            "expert_sums": {name: expert_sums[name] for name in local_experts},
            "dropped": int((loads - capacity).clamp(min=0).sum()),
            "splits": loads.clamp(max=capacity).view(world, -1).sum(1).tolist()}


def _layer_data(hidden: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, SEQ_LEN, hidden, generator=generator), torch.randn(2, SEQ_LEN, hidden, generator=generator)


def _layer_run(layer: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward and backward of ``(layer(inputs) * output_grad).sum()``: output, input and router gradients."""
    layer.zero_grad()
    inputs = inputs.clone().requires_grad_()
    output = layer(inputs)
    (output * output_grad).sum().backward()
    return {"output": output.detach(), "input_grad": inputs.grad, "router_grad": layer.router.weight.grad.clone()}


def _reference_layer_runs(layer: nn.Module, data: list, rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The single-process layer on each rank's tokens: this rank's run, and expert gradients summed over ranks."""
    sums: dict[str, torch.Tensor] = {}
    mine = {}
    for index, (inputs, output_grad) in enumerate(data):
        run = _layer_run(layer, inputs, output_grad)
        mine = run if index == rank else mine
        for name, param in layer.experts.named_parameters():
            sums[name] = sums.get(name, 0) + param.grad
    return mine, sums


AUTO_PINNED_SPARSE_LONG = ((MOE, "dp=2,ep=2,zero=1,mbs=4,recompute=none"),
                           (LLAMA, "dp=1,cp=2,zero=0,mbs=4,recompute=none"))


def auto_pinned_sparse_long() -> dict:
    """Runs on every rank: the public entry point (capture, cost model, plan, runtime) with pinned ep / cp."""
    import tessera  # noqa: PLC0415

    losses = {}
    for spec, strategy in AUTO_PINNED_SPARSE_LONG:
        torch.manual_seed(SEED)
        parallel = tessera.auto_parallelize(spec, f"cpu:ranks={dist.get_world_size()}", global_batch=GLOBAL_BATCH,
                                            seq_len=SEQ_LEN, strategy=strategy)
        losses[spec] = [parallel.train_step(batch) for batch in make_batches(spec)]
    return losses


SPARSE_LONG_EXTRAS = {2: (expert_layer_check, auto_pinned_sparse_long), 4: (expert_layer_check,)}


def _sparse_long_world(cases: list[tuple], extras: tuple) -> dict:
    return run_world(cases, extras=extras)


@functools.cache
def sparse_long_results(world: int) -> list[dict]:
    """Every expert- and context-parallel case of one world size and ``expert_layer_check``, in one spawn."""
    from tessera.runtime.launch import WorkerError, spawn  # noqa: PLC0415

    try:
        return spawn(_sparse_long_world, nprocs=world, args=(SPARSE_LONG_CASES[world], SPARSE_LONG_EXTRAS[world]),
                     timeout_s=600, crash_retries=1)
    except WorkerError as error:
        return [{"spawn_error": str(error)}] * world
