"""DDP (zero=0) and FSDP2 (zero=3) through ``apply_plan`` match single-process training step for step.

Every case trains the same tiny GPT from seed 0 with AdamW for 3 steps on the same global batches and is
compared with a plain single-process loop on the whole global batch: per-step losses, first-step gradients
and final parameters.
All cases for one world size run in ONE spawn (process start-up dominates the cost on 2 cores).
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tessera
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tessera.cost_models.types import Estimate, Strategy, TrainingConfig
from tessera.errors import NotModelledError, RuntimeSetupError
from tessera.models import build_model, model_config
from tessera.planner.plan import Plan, PlannedLayer
from tessera.runtime.apply import apply_plan
from tessera.runtime.launch import spawn
from tessera.runtime.mesh import build_mesh
from tessera.runtime.recompute import apply_recompute

pytestmark = pytest.mark.distributed

MODEL = "gpt-tiny"  # 2 blocks (blocks.0, blocks.1), hidden 64, vocab 256: ~120K parameters
SEED, STEPS, GLOBAL_BATCH, SEQ_LEN, LR = 0, 3, 8, 32, 1e-3
VOCAB = model_config(MODEL).vocab

# fp32 losses and gradients: gloo sums gradients in a different order than one process does (and FSDP2
# pre-divides by dp), so they differ by a few ulps (~1e-7 relative; gradients are ~1e-2, so ~1e-9 absolute).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-8)
# fp32 parameters after 3 AdamW steps: AdamW divides each gradient by sqrt(v) + eps (1e-8), which turns a
# ~1e-7 relative gradient difference on small-gradient elements into a visible part of an lr=1e-3 step. The
# attention key bias is the extreme case: its exact gradient is zero (softmax ignores a shift shared by all
# keys), so the computed one is ~1e-11 of rounding noise and its update lr * noise / eps depends on the
# summation order. Even one process accumulating micro-batches moves parameters by ~2e-6 (gpt-tiny; ~2e-5 on
# a stand-in model). atol 1e-4 is 10% of one lr step; a real bug (wrong scale, missed reduction) moves ~lr.
PARAM_TOL = dict(rtol=1e-5, atol=1e-4)
# bf16 has an 8-bit mantissa (relative step 2^-8 ~ 4e-3); the loss of a 3-step run stays within ~1%.
BF16_LOSS_TOL = dict(rtol=2e-2, atol=0.0)

# (world size, strategy, precision). Accumulation = GLOBAL_BATCH / (dp * mbs).
CASES = [
    (2, "dp=2,zero=0,mbs=4", "fp32"),
    (2, "dp=2,zero=0,mbs=2,recompute=full", "fp32"),  # accumulation 2
    (2, "dp=2,zero=3,mbs=4", "fp32"),
    (2, "dp=2,zero=3,mbs=1,recompute=full", "fp32"),  # accumulation 4
    (2, "dp=2,zero=3,mbs=4", "bf16"),
    (4, "dp=4,zero=0,mbs=1", "fp32"),  # accumulation 2
    (4, "dp=4,zero=3,mbs=2,recompute=full", "fp32"),
    (4, "dp=4,zero=3,mbs=1", "fp32"),  # accumulation 2
    (4, "dp=4,zero=0,mbs=2", "bf16"),
]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(MODEL, device="cpu")


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]  # (B, T) inputs, next-token targets


def make_plan(model: nn.Module, strategy: str, precision: str = "fp32") -> Plan:
    """A hand-built Plan (no planner): items of a ModuleList are blocks, other top-level children layers."""
    parsed = Strategy.parse(strategy)
    layers = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            layers += [PlannedLayer(fqn=f"{name}.{index}", kind="block", recompute=parsed.recompute)
                       for index in range(len(child))]
        else:
            layers.append(PlannedLayer(fqn=name, kind="other", recompute="none"))
    return Plan(
        model_name=MODEL, param_count=sum(p.numel() for p in model.parameters()), cluster="test",
        device_name="cpu", training=TrainingConfig(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision=precision),
        strategy=parsed, estimate=dummy_estimate(), layers=tuple(layers),
    )


def dummy_estimate() -> Estimate:
    memory = {"parameters": 1, "gradients": 1, "optimizer": 2, "activations": 1}
    return Estimate(
        step_time_s=1.0, compute_time_s=1.0, recompute_time_s=0.0, optimizer_time_s=0.0, exposed_comm_time_s=0.0,
        comm_time_by_kind_s={}, memory_by_category_bytes=memory, peak_memory_bytes=sum(memory.values()),
        memory_budget_bytes=1 << 30, tokens_per_s=1.0, model_flops_per_step=1.0, mfu=0.1,
    )


def full_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded copies keyed by the user's FQNs (a collective under FSDP2: call on every rank)."""
    full = {}
    for name, tensor in named.items():
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full[name.removeprefix("module.")] = tensor.detach().clone()  # DDP adds "module."
    return full


def record_first_gradients(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Fill the returned dict with the full gradients that the first ``optimizer.step()`` sees."""
    grads: dict[str, torch.Tensor] = {}

    def hook(*_) -> None:
        if not grads:
            grads.update(full_tensors({name: p.grad for name, p in module.named_parameters()}))

    optimizer.register_step_pre_hook(hook)
    return grads


@functools.cache
def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain single-process training on the whole global batch: the ground truth."""
    model = make_model(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = record_first_gradients(model, optimizer)
    losses = []
    for inputs, targets in make_batches():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads, full_tensors(dict(model.named_parameters()))


def train_case(strategy: str, precision: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Runs on every rank. Seeds differ per rank on purpose: rank 0's weights must win (broadcast)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = make_model(SEED + rank)
    plan = make_plan(model, strategy, precision)
    parallel = apply_plan(model, plan)
    sharded = [isinstance(model.get_submodule(fqn), FSDPModule) for fqn in ("", *plan.block_fqns)]
    assert all(sharded) if plan.strategy.zero == 3 else not any(sharded), sharded
    grads = record_first_gradients(parallel.module, parallel.optimizer)
    losses = [parallel.train_step(batch) for batch in make_batches()]
    return losses, grads, full_tensors(dict(parallel.module.named_parameters()))


def train_auto() -> tuple[list[float], str]:
    """Runs on every rank: the public entry point, with the strategy the planner chooses."""
    torch.manual_seed(SEED)
    parallel = tessera.auto_parallelize(
        MODEL, f"cpu:ranks={dist.get_world_size()}", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN
    )
    return [parallel.train_step(batch) for batch in make_batches()], parallel.plan.strategy.to_string()


def run_world(cases: list[tuple[str, str]]) -> dict:
    """Runs on every rank: all cases of one world size, auto_parallelize, and a world-size mismatch check."""
    results = {case: train_case(*case) for case in cases}
    results["auto"] = train_auto()
    try:
        build_mesh(Strategy(dp=2 * dist.get_world_size()))
    except RuntimeSetupError as error:
        results["mismatch"] = str(error)
    if dist.get_rank() != 0:  # losses from every rank, parameters from rank 0 only (smaller pickles)
        results = {
            case: value if case == "auto" else (value[0], None, None)
            for case, value in results.items()
            if case != "mismatch"
        }
    return results


@functools.cache
def world_results(world: int) -> list[dict]:
    cases = [(strategy, precision) for size, strategy, precision in CASES if size == world]
    return spawn(run_world, nprocs=world, args=(cases,), timeout_s=120)


@pytest.mark.parametrize(("world", "strategy", "precision"), CASES, ids=[f"{s}-{p}" for _, s, p in CASES])
def test_matches_single_process_training(world, strategy, precision):
    ref_losses, ref_grads, ref_params = reference()
    per_rank = world_results(world)
    losses = [rank_results[(strategy, precision)][0] for rank_results in per_rank]
    assert all(rank_losses == losses[0] for rank_losses in losses), f"ranks disagree on the loss: {losses}"
    if precision == "bf16":
        torch.testing.assert_close(losses[0], ref_losses, **BF16_LOSS_TOL)
        assert losses[0] != ref_losses  # bf16 really ran: it rounds differently from fp32
        return
    _, grads, params = per_rank[0][(strategy, precision)]
    torch.testing.assert_close(losses[0], ref_losses, **FP32_TOL)
    assert params.keys() == ref_params.keys()  # FQNs unchanged by recompute hooks and FSDP2
    torch.testing.assert_close(grads, ref_grads, **GRAD_TOL)
    torch.testing.assert_close(params, ref_params, **PARAM_TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_parallelize_matches_single_process_training(world):
    # The planner's own choice for gpt-tiny on `world` CPU ranks, through the public API, from seed 0.
    ref_losses, _, _ = reference()
    per_rank = [rank_results["auto"] for rank_results in world_results(world)]
    strategies = {strategy for _, strategy in per_rank}
    assert len(strategies) == 1, f"ranks planned differently: {strategies}"
    assert f"dp={world}" in strategies.pop()
    for losses, _ in per_rank:
        torch.testing.assert_close(losses, ref_losses, **FP32_TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_world_size_mismatch_says_what_to_do(world):
    message = world_results(world)[0]["mismatch"]
    assert f"needs {2 * world} ranks but the process group has {world}" in message
    assert "relaunch" in message


def test_single_process_without_process_group_matches_reference():
    ref_losses, ref_grads, ref_params = reference()
    losses, grads, params = train_case("dp=1,zero=0,mbs=2,recompute=full", "fp32")  # accumulation 4
    torch.testing.assert_close(losses, ref_losses, **FP32_TOL)
    torch.testing.assert_close(grads, ref_grads, **GRAD_TOL)
    torch.testing.assert_close(params, ref_params, **PARAM_TOL)


@pytest.mark.parametrize(
    ("strategy", "precision", "missing"),
    [("dp=1,zero=1", "fp32", "ZeRO-1"), ("dp=1,zero=2", "fp32", "ZeRO-2"), ("dp=1,tp=2", "fp32", "tensor parallel"),
     ("dp=1,pp=2", "fp32", "pipeline"), ("dp=1", "fp16", "loss scaling")],
)
def test_unimplemented_parts_of_a_plan_are_refused_by_name(strategy, precision, missing):
    model = make_model(SEED)
    with pytest.raises(NotModelledError, match=missing):
        apply_plan(model, make_plan(model, strategy, precision))


def test_plan_for_more_ranks_without_process_group_is_a_setup_error():
    model = make_model(SEED)
    with pytest.raises(RuntimeSetupError, match="no process group"):
        apply_plan(model, make_plan(model, "dp=2"))


def test_recompute_reruns_only_the_chosen_blocks_and_keeps_fqns():
    model = make_model(SEED)
    names_before = [name for name, _ in model.named_parameters()]
    calls = {"blocks.0": 0, "blocks.1": 0}
    for fqn in calls:  # a pre-hook on the block's first layer: recomputation stops early after the last one
        count = functools.partial(lambda fqn, *_: calls.__setitem__(fqn, calls[fqn] + 1), fqn)
        model.get_submodule(f"{fqn}.attn_norm").register_forward_pre_hook(count)
    apply_recompute(model, ("blocks.0",))
    inputs, targets = make_batches()[0]
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    assert calls == {"blocks.0": 2, "blocks.1": 1}  # forward + recomputation in backward; blocks.1 untouched
    assert [name for name, _ in model.named_parameters()] == names_before
