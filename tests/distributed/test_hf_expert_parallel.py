"""Expert and pipeline parallelism on mixture-of-experts blocks Tessera did not write: Hugging Face Mixtral,
Qwen2-MoE (shared expert and shared-expert gate, top-k weights not renormalised) and Qwen3-MoE (renormalised),
experts stacked in 3-D tensors, trained with experts split over ``ep`` ranks, with pipeline stages cut from a
torch.export trace (1F1B, and interleaved with 2 chunks per rank on a 4-block model: one block per chunk), or both,
match single-process training; the router logits and the load-balancing loss a rank sees are the single-process
model's on its rows; each rank holds only its experts; what the runtime cannot split is refused by name.

Every case trains from the same seed with AdamW on the same global batches with the default loss, against plain
single-process training on the whole global batch (cross-entropy on ``.logits``; ``test_outside_models``): per-step
losses and final parameters (tolerances and why: ``harness.py``). The routing is dropless in these models (no
capacity), so every rank's tokens meet exactly the experts they would meet in one process. The default cases run in
one spawn of 2 ranks (EP with DP, PP alone under both schedules); the 4-rank matrix (dp x ep, ep x pp, dp x pp) and
the rest of the 2-rank one are ``slow``.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.cost_models.types import Strategy
from tessera.errors import NotModelledError
from tessera.runtime.apply import apply_plan
from tessera.runtime.expert_parallel import check_expert_parallel
from tessera.runtime.hf_experts import ShardedExperts

from .harness import FP32_TOL, GLOBAL_BATCH, GPT, LR, PARAM_TOL, SEED, SEQ_LEN, assert_ranks_match, full_tensors, make_batches, run_named
from .test_outside_models import hf_loss, listed_plan, single_process, train

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]

STEPS, EXPERTS = 3, 4
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=SEQ_LEN, num_experts_per_tok=2, use_cache=False)


def hf_mixtral(layers: int = 2) -> nn.Module:
    """transformers' MixtralForCausalLM: 4 experts (SwiGLU 64), top-2, weights renormalised (~60K parameters)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    return MixtralForCausalLM(MixtralConfig(**{**SIZES, "num_hidden_layers": layers}, intermediate_size=64,
                                            num_local_experts=EXPERTS))


def hf_qwen2_moe(layers: int = 2) -> nn.Module:
    """transformers' Qwen2MoeForCausalLM: 4 experts (32) and a gated shared expert (64), top-2 not renormalised."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(SEED)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**SIZES, "num_hidden_layers": layers}, intermediate_size=64,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                              num_experts=EXPERTS, norm_topk_prob=False))


def hf_qwen3_moe(layers: int = 2) -> nn.Module:
    """transformers' Qwen3MoeForCausalLM: 4 experts (32), top-2 renormalised, q/k norms (head_dim 8)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**SIZES, "num_hidden_layers": layers}, intermediate_size=64,
                                              moe_intermediate_size=32, head_dim=8, num_experts=EXPERTS,
                                              norm_topk_prob=True))


def hf_mixtral_aux(layers: int = 2) -> nn.Module:
    """Mixtral returning its routers' logits and their load-balancing ``aux_loss`` (``output_router_logits``): the
    routers' outputs, recorded by transformers' hooks inside each block, reach the root (and the last stage)."""
    model = hf_mixtral(layers)
    model.config.output_router_logits = True
    return model


MODELS = {"mixtral": hf_mixtral, "qwen2-moe": hf_qwen2_moe, "qwen3-moe": hf_qwen3_moe, "mixtral-aux": hf_mixtral_aux}
AUX_COEF = 0.1  # large enough that a lost aux-loss gradient moves the routers by more than the tolerance


def aux_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """A user's loss: cross-entropy plus the model's load-balancing loss (of this micro-batch's tokens)."""
    return hf_loss(outputs, targets) + AUX_COEF * outputs.aux_loss


def planned_layers(model: nn.Module) -> list[str]:
    """The embedding, every block, the final norm and the head, by FQN."""
    return ["model.embed_tokens", *(f"model.layers.{i}" for i in range(model.config.num_hidden_layers)),
            "model.norm", "lm_head"]


# (model, strategy): accumulation = GLOBAL_BATCH / (dp * mbs).
CASES = {
    2: [("mixtral", "dp=2,ep=2,zero=0,mbs=4"),  # experts replicated (FSDP2 replicate over edp = 1)
        ("qwen2-moe", "dp=2,ep=2,zero=3,mbs=2")],  # ZeRO-3, 2 micro-batches per step
    4: [("mixtral", "dp=4,ep=2,zero=1,mbs=2"),  # each expert on 2 ranks (edp = 2), ZeRO-1 over them
        ("qwen2-moe", "dp=4,ep=2,zero=0,mbs=1"),  # replicated over edp = 2, accumulation 2
        ("qwen3-moe", "dp=4,ep=4,zero=3,mbs=2"),  # one expert per rank
        # EP with PP: an ep group inside each stage, its all-to-alls on the same micro-batch schedule
        ("mixtral", "dp=2,ep=2,pp=2,zero=0,mbs=2,schedule=1f1b"),
        ("qwen2-moe", "dp=2,ep=2,pp=2,zero=1,mbs=1,schedule=1f1b"),  # 4 micro-batches
        ("qwen2-moe", "dp=2,ep=2,pp=2,zero=1,mbs=1,schedule=interleaved:2"),  # all-to-alls in all 4 chunks
        ("mixtral", "dp=2,ep=2,pp=2,zero=3,mbs=2,schedule=interleaved:2"),
        ("mixtral-aux", "dp=2,ep=2,pp=2,zero=1,mbs=2,schedule=interleaved:2"),  # each rank's micro-batches' aux loss
        # DP x PP, the experts whole: DDP / FSDP2 inside each stage
        ("mixtral", "dp=2,pp=2,zero=0,mbs=2,schedule=interleaved:2"),
        ("qwen3-moe", "dp=2,pp=2,zero=3,mbs=1,schedule=interleaved:2")],
}
# PP alone (experts whole in their stage), split from a torch.export trace
PIPELINED = [("qwen2-moe", "pp=2,mbs=2,schedule=1f1b"),  # the shared expert and its gate in each stage
             # 4 chunks over 2 ranks, 4 micro-batches; every router's logits carried to the last stage's aux loss
             ("mixtral-aux", "pp=2,mbs=2,schedule=interleaved:2")]
CASES[2] += PIPELINED
SLOW_WORLD2 = [("qwen3-moe", "dp=2,ep=2,zero=1,mbs=4"),
               ("mixtral", "pp=2,mbs=2,schedule=interleaved:2"),  # the default loss
               ("qwen3-moe", "pp=2,mbs=1,schedule=interleaved:2"),  # 8 micro-batches
               ("mixtral", "pp=2,mbs=4,schedule=1f1b"),
               ("qwen2-moe", "pp=2,mbs=2,schedule=interleaved:2")]


def blocks_for(strategy: str) -> int:
    """Blocks of a case's model: one per pipeline chunk (4 under interleaved pp=2), 2 at least."""
    parsed = Strategy.parse(strategy)
    return max(2, parsed.pp * parsed.virtual_stages)


def ep_plan(name: str, model: nn.Module, strategy: str):
    """The hand-built plan over the model's layers; with pipelining, embedding in the first chunk, the blocks evenly
    over the chunks, the rest in the last."""
    plan = listed_plan(f"hf-{name}", model, strategy, planned_layers(model), global_batch=GLOBAL_BATCH)
    chunks = plan.strategy.pp * plan.strategy.virtual_stages
    if chunks == 1:
        return plan
    blocks = model.config.num_hidden_layers
    block_chunks = iter(block * chunks // blocks for block in range(blocks))
    layers = [layer.model_copy(update={"chunk": 0 if layer.kind == "embedding" else next(block_chunks)
                                       if layer.kind == "block" else chunks - 1}) for layer in plan.layers]
    return plan.model_copy(update={"layers": tuple(layers)})


def rank_model(name: str, layers: int = 2) -> nn.Module:
    """Runs on every rank: the model, its weights moved off rank 0 (rank 0's must win: apply_plan broadcasts them)."""
    model = MODELS[name](layers)
    if dist.get_rank():
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
    return model


def hf_ep_case(name: str, strategy: str) -> dict:
    model = rank_model(name, blocks_for(strategy))
    parallel = apply_plan(model, ep_plan(name, model, strategy), loss_fn=aux_loss if name.endswith("-aux") else None)
    local = {fqn: isinstance(m, ShardedExperts) for fqn, m in model.named_modules() if fqn.endswith("mlp.experts")}
    held = {fqn: m.local_experts.num_experts for fqn, m in model.named_modules() if hasattr(m, "local_experts")}
    return {**train(parallel, make_batches(GPT, STEPS)), "experts_modules": local, "held": held}


def router_check(name: str = "qwen2-moe", strategy: str = "dp=2,ep=2,zero=0,mbs=4") -> dict:
    """Runs on every rank: the expert-parallel model's output, router logits and load-balancing loss on this rank's
    rows, and the single-process model's on the same rows."""
    inputs = make_batches(GPT, 1)[0][0]
    rows = inputs.view(dist.get_world_size(), -1, SEQ_LEN)[dist.get_rank()]  # this rank's rows of the batch
    single = MODELS[name]()(rows, output_router_logits=True)
    model = MODELS[name]()
    parallel = apply_plan(model, ep_plan(name, model, strategy))
    ours = parallel.modules[0](rows, output_router_logits=True)
    return {field: (getattr(ours, field), getattr(single, field)) for field in ("logits", "router_logits", "aux_loss")}


def run_world(world: int, cases: list[tuple[str, str]]) -> dict:
    """Runs on every rank: every case (a failure ends the spawn, named), then the router check, with wall times."""
    runs = [((name, strategy), functools.partial(hf_ep_case, name, strategy)) for name, strategy in cases]
    runs += [(("router",), router_check)] if world == 2 else []
    results, seconds = run_named(runs)
    return {**results, "seconds": seconds}


def world_results(world: int, slow: bool = False) -> list[dict]:
    return _spawned(world, slow)  # one cache key per spawn, however it is called


@functools.cache
def _spawned(world: int, slow: bool) -> list[dict]:
    from tessera.runtime.launch import spawn  # noqa: PLC0415

    cases = SLOW_WORLD2 if slow else CASES[world]
    return spawn(run_world, nprocs=world, args=(world, cases), timeout_s=600)


@functools.cache
def reference(name: str, layers: int = 2) -> dict:
    return single_process(MODELS[name](layers), make_batches(GPT, STEPS), hf_loss)


@functools.cache
def aux_reference(name: str, layers: int, micro_batch: int) -> dict:
    """One process, ``aux_loss`` per micro-batch of ``micro_batch`` rows, gradients averaged over them: the Switch
    loss is a product of two batch means, so it is a micro-batch's, not the global batch's."""
    model = MODELS[name](layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in make_batches(GPT, STEPS):
        parts = list(zip(inputs.split(micro_batch), targets.split(micro_batch)))
        micro = [aux_loss(model(rows), rows_targets) for rows, rows_targets in parts]
        (sum(micro) / len(parts)).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack(micro).mean().item())
    return {"losses": losses, "params": full_tensors(model.named_parameters())}


def check_case(world: int, name: str, strategy: str, *, slow: bool = False) -> None:
    per_rank = [results[(name, strategy)] for results in world_results(world, slow)]
    parsed = Strategy.parse(strategy)
    expected = (aux_reference(name, blocks_for(strategy), parsed.micro_batch) if name.endswith("-aux")
                else reference(name, blocks_for(strategy)))
    assert_ranks_match(per_rank, expected)  # same FQNs, every stage's, gathered
    ep = parsed.ep
    for result in per_rank:
        split = result["experts_modules"]  # split on the whole model, before any pipeline cut; whole without ep
        assert len(split) == blocks_for(strategy) and set(split.values()) == {ep > 1}, split
        assert set(result["held"].values()) == ({EXPERTS // ep} if ep > 1 else set())  # E / ep experts per rank


@pytest.mark.parametrize(("name", "strategy"), CASES[2], ids=[f"{n}-{s}" for n, s in CASES[2]])
def test_hugging_face_moe_under_expert_or_pipeline_parallelism_trains_like_one_process(name, strategy):
    check_case(2, name, strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "strategy"), CASES[4], ids=[f"{n}-{s}" for n, s in CASES[4]])
def test_hugging_face_moe_on_4_ranks_trains_like_one_process(name, strategy):
    check_case(4, name, strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "strategy"), SLOW_WORLD2, ids=[f"{n}-{s}" for n, s in SLOW_WORLD2])
def test_the_rest_of_the_2_rank_matrix_trains_like_one_process(name, strategy):
    check_case(2, name, strategy, slow=True)


def test_router_logits_and_the_load_balancing_loss_are_the_rank_rows_single_process_ones():
    # The block's own router ran on this rank's rows; the model's hooks recorded its logits, as in one process.
    for results in world_results(2):
        for field, (ours, single) in results[("router",)].items():
            torch.testing.assert_close(ours, single, **FP32_TOL, msg=lambda message, field=field: f"{field}: {message}")


def test_the_load_balancing_term_changes_what_is_trained():
    # else the aux-loss cell could not fail on a lost aux-loss gradient: the routers move by 10x the tolerance
    with_aux, without = aux_reference("mixtral-aux", 4, 2), reference("mixtral", 4)
    router = "model.layers.0.mlp.gate.weight"
    assert (with_aux["params"][router] - without["params"][router]).abs().max() > 10 * PARAM_TOL["atol"]


def test_the_spawn_stays_fast():
    seconds = world_results(2)[0]["seconds"]
    print({" ".join(key): round(value, 1) for key, value in seconds.items()})
    assert sum(seconds.values()) < 60, seconds


# ----------------------------------------------------------------------------------- refusals (no processes)


class ListedExpertsBlock(nn.Module):
    """A block that keeps its experts in a ModuleList and runs them itself (transformers 4's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        return torch.stack([self.experts[int(e)](row) for e, row in zip(choice, x)])


class SharedNormExperts(nn.Module):
    """Stacked experts with a norm that all experts share: its gradient would be averaged over ep, not dp."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.weight = nn.Parameter(torch.zeros(EXPERTS, 8, 8))
        self.norm = nn.LayerNorm(8)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.norm(hidden_states)


def test_what_expert_parallelism_cannot_split_is_refused_by_name():
    strategy = Strategy.parse("dp=2,ep=2")
    with pytest.raises(NotModelledError, match=r"experts of the model \(ListedExpertsBlock\) cannot be split: they "
                                               r"are a ModuleList that the block runs itself"):
        check_expert_parallel(ListedExpertsBlock(), strategy)
    holder = nn.Module()
    holder.experts = SharedNormExperts()
    with pytest.raises(NotModelledError, match="its parameter norm.weight belongs to a submodule that all experts"):
        check_expert_parallel(holder, strategy)
    with pytest.raises(NotModelledError, match="4 experts of model.layers.0.mlp.experts cannot be split evenly over "
                                               "ep=3"):
        check_expert_parallel(hf_mixtral(), Strategy.parse("dp=3,ep=3"))
    for combination, pinned in [("context parallelism", "dp=2,ep=2,cp=2"),
                                ("schedule=zero-bubble", "dp=2,ep=2,pp=2,zero=3,schedule=zero-bubble")]:
        with pytest.raises(NotModelledError, match=f"stacked experts modules .* together with {combination} "):
            check_expert_parallel(hf_mixtral(), Strategy.parse(pinned))
    check_expert_parallel(hf_qwen2_moe(), strategy)  # accepted, and with pipelining (trained above, slow)
    check_expert_parallel(hf_mixtral(), Strategy.parse("dp=2,ep=2,tp=2"))  # ep x tp: test_hf_moe_tensor_parallel
    check_expert_parallel(hf_mixtral(), Strategy.parse("dp=2,ep=2,tp=2,sp=true"))  # ... and with sp (tokens gathered)
    check_expert_parallel(hf_qwen2_moe(), Strategy.parse("dp=2,ep=2,pp=2,zero=0,schedule=zero-bubble"))
