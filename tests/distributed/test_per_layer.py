"""Per-layer choices through ``apply_plan`` match single-process training: activation offload on some blocks
(``block_recompute=...offload...``) and a per-block FSDP2 reshard mix under ZeRO-3 (``block_reshard=...``),
alone and with tensor, pipeline and expert parallelism, on Tessera's models and on Hugging Face ones.

Each case trains from seed 0 with AdamW for 3 steps on the same global batches and is compared with plain
single-process training on the whole global batch: per-step losses (identical on every rank) and final
parameters (tolerances and why: ``harness.py``). Each case also checks that its choice really ran: every
offloaded block's saved tensors went through the offload hooks (``ParallelModel.offloads``), and a block that
keeps its weights gathered holds more than its shard after its forward, while a resharding block holds only its
shard. All cases of one world size run in one spawn.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.cost_models.types import Strategy
from tessera.errors import ConfigError
from tessera.planner.plan import Plan
from tessera.runtime.apply import apply_plan
from tessera.runtime.offload import apply_offload

from .harness import (
    FP32_TOL, GPT, LLAMA, MOE, PARAM_TOL, SEED, assert_ranks_match, full_tensors, make_batches, make_model, make_plan,
    parameter_bytes, reference, run_named,
)

pytestmark = pytest.mark.distributed

STEPS = 3
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
OFF2 = "block_recompute=offload/none/full/offload"  # 4 blocks: offload beside recomputation and none
KEEP2 = "block_reshard=false/true/false/true"  # 4 blocks: a ZeRO-2/ZeRO-3 mix
GPT6 = "gpt-tiny:layers=6"  # 6 blocks: interleaved chunks of 1/2/2/1 (the embedding's and head's chunks lighter)

# (model, strategy); accumulation = GLOBAL_BATCH / (dp * mbs). Models: Tessera's by spec, Hugging Face's by "hf-".
CASES = {
    2: [(GPT, f"dp=2,zero=3,mbs=2,{OFF2}"),  # offload alone (with FSDP), 2 micro-batches
        (GPT, f"dp=2,zero=3,mbs=4,{KEEP2}"),  # reshard mix alone
        (LLAMA, f"dp=1,tp=2,sp=true,mbs=4,{OFF2}"),  # offload of sequence-parallel DTensor activations
        (GPT, f"dp=1,pp=2,mbs=2,schedule=1f1b,{OFF2}"),  # offload inside pipeline stages
        (MOE, "dp=2,ep=2,zero=3,mbs=2,block_recompute=offload/none,block_reshard=false/true"),  # with EP
        ("hf-llama", "dp=2,zero=3,mbs=2,block_recompute=offload/none,block_reshard=false/true"),
        (GPT6, "dp=1,pp=2,mbs=1,schedule=interleaved:2,chunk_blocks=1/2/2/1,"  # uneven interleaved chunks
               "block_recompute=none/offload/offload/none/none/none")],
    4: [(LLAMA, f"dp=2,tp=2,zero=3,mbs=4,{OFF2},{KEEP2}"),  # both with TP (2-D FSDP x TP)
        (GPT, f"dp=2,pp=2,zero=3,mbs=2,schedule=1f1b,{OFF2},{KEEP2}"),  # both with PP (FSDP inside stages)
        (MOE, "dp=4,ep=2,zero=3,mbs=1,block_recompute=none/offload,block_reshard=true/false")],  # experts over edp=2
}
SLOW_CASES = {
    2: [(LLAMA, "dp=1,pp=2,mbs=2,schedule=zero-bubble,block_recompute=offload/offload/none/none"),  # split backward
        ("hf-llama", "dp=1,tp=2,mbs=4,block_recompute=offload/none"),  # Hugging Face's tp plan, DTensor activations
        ("hf-llama", "dp=1,pp=2,mbs=2,schedule=1f1b,block_recompute=none/offload"),  # torch.export pipeline split
        (LLAMA, "dp=1,cp=2,mbs=4,block_recompute=offload/none/offload/none")],  # ring attention's saved tensors
    4: [("hf-mixtral", "dp=4,ep=2,zero=3,mbs=2,block_recompute=offload/none,block_reshard=false/true"),
        (LLAMA, f"dp=2,tp=2,sp=true,zero=3,mbs=2,{OFF2},{KEEP2}"),
        (GPT, "dp=1,tp=2,pp=2,mbs=2,schedule=interleaved:2,block_recompute=offload/none/none/offload")],
}


# ------------------------------------------------------------------------------------------------ the models


def hf_models() -> dict:
    from .test_hf_expert_parallel import hf_mixtral  # noqa: PLC0415 (needs transformers)
    from .test_outside_models import hf_llama  # noqa: PLC0415

    return {"hf-llama": hf_llama, "hf-mixtral": hf_mixtral}


def build(name: str, rank: int) -> nn.Module:
    """The model, each rank from its own seed (rank 0's weights must win: ``apply_plan`` broadcasts them)."""
    if not name.startswith("hf-"):
        return make_model(name, SEED + rank)
    model = hf_models()[name]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)
    return model


def base_plan(name: str, model: nn.Module, strategy: str) -> Plan:
    if not name.startswith("hf-"):
        return make_plan(name, model, strategy)
    from .test_hf_expert_parallel import ep_plan  # noqa: PLC0415 (the embedding, 2 blocks, norm and head)

    return ep_plan(name.removeprefix("hf-"), model, strategy)


def per_layer_plan(name: str, model: nn.Module, strategy: str) -> Plan:
    """The hand-built plan with each block's activation policy from ``block_recompute`` and its pipeline chunk from
    ``chunk_blocks`` (the planner's job)."""
    plan = base_plan(name, model, strategy)
    sizes = plan.strategy.chunk_blocks
    chunk_of = [c for c, n in enumerate(sizes) for _ in range(n)]
    index = {fqn: i for i, fqn in enumerate(plan.block_fqns)}

    def planned(i: int) -> dict:
        return {"recompute": plan.strategy.recompute_of_block(i), **({"chunk": chunk_of[i]} if sizes else {})}

    layers = tuple(layer.model_copy(update=planned(index[layer.fqn])) if layer.fqn in index else layer
                   for layer in plan.layers)
    return plan.model_copy(update={"layers": layers})


def batches(name: str) -> list:
    return make_batches(GPT if name.startswith("hf-") else name, STEPS)  # the Hugging Face configs use vocab 256


@functools.cache
def expected(name: str) -> dict:
    if not name.startswith("hf-"):
        losses, _, params = reference(name, STEPS)
        return {"losses": losses, "params": params}
    from .test_outside_models import hf_loss, single_process  # noqa: PLC0415

    return single_process(build(name, 0), batches(name), hf_loss)


# ------------------------------------------------------------------------------------------------ one case


def local_blocks(parallel, fqns) -> dict:
    """This rank's blocks among ``fqns`` (in the modules it runs: pipeline chunks hold the model's own blocks)."""
    return {fqn: block for module in parallel.modules for fqn, block in module.named_modules() if fqn in fqns}


def track_block_bytes(blocks: dict) -> dict[str, int]:
    """Bytes of the parameters each block holds right after its forward (after FSDP2's own hook)."""
    held: dict[str, int] = {}
    for fqn, block in blocks.items():
        block.register_forward_hook(lambda m, a, o, fqn=fqn: held.__setitem__(fqn, parameter_bytes(m.parameters())))
    return held


def train_case(name: str, strategy: str) -> dict:
    model = build(name, dist.get_rank())
    plan = per_layer_plan(name, model, strategy)
    torch.manual_seed(SEED)
    parallel = apply_plan(model, plan)
    blocks = local_blocks(parallel, set(plan.block_fqns))
    held = track_block_bytes(blocks)
    losses = [parallel.train_step(batch) for batch in batches(name)]
    at_rest = {fqn: parameter_bytes(block.parameters()) for fqn, block in blocks.items()}  # resharded after the step
    return {"losses": losses, "params": full_tensors(parallel.named_parameters()), "held": held, "at_rest": at_rest,
            "offloads": {fqn: vars(stats) for fqn, stats in parallel.offloads.items()}}


def run_world(cases: list[tuple[str, str]]) -> dict:
    results, seconds = run_named(((case, functools.partial(train_case, *case)) for case in cases))
    return {**results, "seconds": seconds}


@functools.cache
def world_results(world: int, slow: bool = False) -> list[dict]:
    from tessera.runtime.launch import spawn  # noqa: PLC0415

    return spawn(run_world, nprocs=world, args=((SLOW_CASES if slow else CASES)[world],), timeout_s=900)


# ------------------------------------------------------------------------------------------------ the checks


def check_case(world: int, name: str, strategy: str, *, slow: bool = False) -> None:
    if name.startswith("hf-") and not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    per_rank = [results[(name, strategy)] for results in world_results(world, slow)]
    assert_ranks_match(per_rank, expected(name))
    parsed = Strategy.parse(strategy)
    check_offloads(per_rank, parsed)
    if parsed.block_reshard:
        check_reshards(per_rank, parsed)
    if parsed.chunk_blocks:
        check_chunk_blocks(per_rank, parsed)


def check_chunk_blocks(per_rank: list[dict], strategy: Strategy) -> None:
    """Each pipeline rank ran the blocks of its chunks as ``chunk_blocks`` sizes them (chunk ``c`` on rank ``c % pp``;
    with pp ranks only: ``dp == 1``)."""
    chunk_of = [c for c, n in enumerate(strategy.chunk_blocks) for _ in range(n)]
    for rank, result in enumerate(per_rank):
        ran = sorted(map(_block_index, result["held"]))
        assert ran == [i for i, c in enumerate(chunk_of) if c % strategy.pp == rank], (rank, ran)


def check_offloads(per_rank: list[dict], strategy: Strategy) -> None:
    """Every offloaded block (on the ranks running it) moved its saved tensors out and back; no other did."""
    wanted = {i for i in range(len(strategy.block_recompute)) if strategy.recompute_of_block(i) == "offload"}
    for result in per_rank:
        offloaded = {fqn for fqn in result["held"] if _block_index(fqn) in wanted}  # this rank's blocks
        assert set(result["offloads"]) == offloaded, (result["offloads"].keys(), offloaded)
        for fqn, stats in result["offloads"].items():
            assert stats["packed"] > 0 and stats["packed_bytes"] > 0, (fqn, stats)
            # and came back for the backward (not each one: a pipeline stage's shape-inference forward has no
            # backward, and autograd saves some tensors for branches no gradient flows through)
            assert stats["unpacked"] > 0, (fqn, stats)
        # Copies back are prefetched a block ahead: an offloaded block with another after it on this rank (in the
        # same forward: interleaved chunks are left out) has its tensors copied back when that one's backward starts.
        last = max(map(_block_index, result["offloads"]), default=0)
        for fqn, stats in result["offloads"].items():
            if strategy.virtual_stages == 1 and _block_index(fqn) < last:
                assert stats["prefetched"] > 0, (fqn, stats)


def check_reshards(per_rank: list[dict], strategy: Strategy) -> None:
    """After its forward a block that keeps its weights holds more than its shard at rest; one that reshards, its
    shard (its experts too: FSDP2 units inside the block follow it)."""
    for result in per_rank:
        for fqn, held in result["held"].items():
            rest = result["at_rest"][fqn]
            assert (held > rest) == (not strategy.reshards_block(_block_index(fqn))), (fqn, held, rest)


def _block_index(fqn: str) -> int:
    return int(fqn.rsplit(".", 1)[-1])


@pytest.mark.parametrize(("name", "strategy"), CASES[2], ids=[f"{n}-{s}" for n, s in CASES[2]])
def test_per_layer_choices_on_2_ranks_train_like_one_process(name, strategy):
    check_case(2, name, strategy)


@pytest.mark.parametrize(("name", "strategy"), CASES[4], ids=[f"{n}-{s}" for n, s in CASES[4]])
def test_per_layer_choices_on_4_ranks_train_like_one_process(name, strategy):
    check_case(4, name, strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name", "strategy"), [(w, *c) for w, cases in SLOW_CASES.items() for c in cases])
def test_more_per_layer_combinations_train_like_one_process(world, name, strategy):
    check_case(world, name, strategy, slow=True)


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("strategy", "message"), [
    ("dp=2,zero=3,block_reshard=false/true", "block_reshard has 2 entries but the plan has 4 blocks"),
    ("dp=1,block_recompute=offload/none/none", "block_recompute has 3 entries but the plan has 4 blocks"),
])
def test_per_block_settings_that_do_not_fit_the_blocks_are_refused(strategy, message):
    # Before any process group is needed (a plan for 2 ranks would otherwise fail on the missing group).
    model = make_model(GPT)
    with pytest.raises(ConfigError, match=message):
        apply_plan(model, make_plan(GPT, model, strategy))


def test_offload_trains_like_one_process_without_a_process_group():
    model = make_model(LLAMA)
    parallel = apply_plan(model, per_layer_plan(LLAMA, model, "dp=1,mbs=4,block_recompute=offload/selective/offload/none"))
    losses = [parallel.train_step(batch) for batch in make_batches(LLAMA, STEPS)]
    torch.testing.assert_close(losses, reference(LLAMA, STEPS)[0], **FP32_TOL)
    torch.testing.assert_close(full_tensors(parallel.named_parameters()), reference(LLAMA, STEPS)[2], **PARAM_TOL)
    assert sorted(parallel.offloads) == ["blocks.0", "blocks.2"]
    assert all(stats.packed and stats.unpacked == stats.packed for stats in parallel.offloads.values())


def test_offloaded_blocks_save_copies_and_others_the_tensors_themselves():
    # Autograd of an offloaded block holds a copy made by the hooks (on CPU a same-device copy), so what its backward
    # reads is not the forward's tensor; a block without offload saves the tensor itself. Parameters are not copied.
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.ReLU()))
    offloads = apply_offload(model, ["2"])
    outputs = {}
    for fqn in ("1", "2.1"):
        model.get_submodule(fqn).register_forward_hook(lambda m, a, out, fqn=fqn: outputs.__setitem__(fqn, out))
    model(torch.randn(4, 8)).sum().backward(retain_graph=True)
    kept, copied = outputs["1"], outputs["2.1"]
    assert kept.grad_fn._saved_result.data_ptr() == kept.data_ptr()  # not offloaded: the tensor itself
    assert copied.grad_fn._saved_result.data_ptr() != copied.data_ptr()  # offloaded: a copy
    torch.testing.assert_close(copied.grad_fn._saved_result, copied)
    stats = offloads["2"].stats
    assert stats.packed == 2 and stats.packed_bytes == 2 * 4 * 32 * 4  # the linear's input, the ReLU's output
