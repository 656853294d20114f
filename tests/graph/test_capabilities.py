"""Capability-aware planning (issue 18 item 5): capture records which axes the runtime can apply to a model and
why not, the search plans only within them, and every strategy a plan returns passes the runtime's own
pre-checks for that model. Meta-device capture, no processes: the runtime's checks build styles and fx graphs
only, as tests/distributed/test_runtime_rules.py does.
"""

import re
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.cost_models import Strategy, TrainingConfig
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.capture import capture_preset
from tessera.planner.model_source import resolve_model
from tessera.planner.plan import Plan
from tessera.planner.search import planned_layers, search
from tessera.planner.space import strategies
from tessera.runtime import pipeline
from tessera.runtime.apply import check_supported, recompute_fqns
from tessera.runtime.context_parallel import check_context_parallel
from tessera.runtime.data_parallel import check_batch_norm
from tessera.runtime.expert_parallel import check_expert_parallel
from tessera.runtime.tensor_parallel import check_tensor_parallel
from tessera.topology import load_cluster

SEQ = 64
GPT2 = "hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64"
LLAMA = ("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
         "intermediate_size=128,vocab_size=256")
MIXTRAL = ("hf:mixtral:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
           "intermediate_size=128,vocab_size=256,num_local_experts=4,num_experts_per_tok=2")
PHI3 = ("hf:phi3:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=256,pad_token_id=0")
NEOX = "hf:gpt_neox:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=256"
OPT = ("hf:opt:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,ffn_dim=128,vocab_size=256,"
       "word_embed_proj_dim=64")
QWEN2_MOE = ("hf:qwen2_moe:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
             "intermediate_size=128,moe_intermediate_size=64,shared_expert_intermediate_size=128,vocab_size=256,"
             "num_experts=4,num_experts_per_tok=2")
QWEN3_MOE = ("hf:qwen3_moe:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
             "intermediate_size=128,moe_intermediate_size=64,vocab_size=256,num_experts=4,num_experts_per_tok=2")
MOE_FAMILIES = [MIXTRAL, QWEN2_MOE, QWEN3_MOE]
LOCAL = (("model.layers.*.self_attn.q_proj", "local_colwise"),)
"""A user's tp_plan naming a style of Hugging Face's vocabulary the runtime does not apply: tp unavailable."""
CLUSTER = "dgx-h100:nodes=2"
TRAINING = TrainingConfig(global_batch=64, seq_len=SEQ, precision="bf16")


@cache
def graph(spec: str, tp_plan: tuple = ()):
    return capture_preset(spec, seq_len=SEQ, tp_plan=dict(tp_plan) or None)


@cache
def plan_of(spec: str, tp_plan: tuple = ()) -> Plan:
    return search(graph(spec, tp_plan), load_cluster(CLUSTER), TRAINING)


def runtime_accepts(spec: str, plan: Plan, tp_plan: tuple = ()) -> None:
    """The runtime's pre-checks of ``apply_plan`` for ``plan`` on the model ``spec`` builds (raise if refused)."""
    model, _ = resolve_model(spec)
    strategy = plan.strategy
    check_supported(plan)
    check_batch_norm(model, plan)
    if strategy.cp > 1:
        check_context_parallel(model, strategy, seq_len=plan.training.seq_len, compile_blocks=False)
    if strategy.ep > 1:
        check_expert_parallel(model, strategy, selective_recompute=bool(recompute_fqns(plan, "selective")))
    if strategy.tp > 1:  # pairs from the module tree, as auto_parallelize applies it
        check_tensor_parallel(model, plan.layers, tp=strategy.tp, sp=strategy.sp, tp_plan=dict(tp_plan) or None)
    if strategy.pp > 1:
        pipeline.trace_plan(model, plan)


def with_strategy(spec: str, plan: Plan, strategy, tp_plan: tuple = ()) -> Plan:
    return plan.model_copy(update={"strategy": strategy, "layers": planned_layers(graph(spec, tp_plan), strategy)})


@pytest.mark.parametrize("spec", [GPT2, PHI3, NEOX, OPT, LLAMA])
def test_fused_projections_conv1d_and_declared_plans_keep_tensor_parallelism(spec):
    # GPT-2: Conv1D, packed q|k|v; Phi-3: declared gathered fused projections; GPT-NeoX: declared per-head fused
    # q/k/v; OPT: learned positions kept whole
    assert "tp" not in graph(spec).unavailable_axes


@pytest.mark.parametrize("spec", [MIXTRAL, QWEN2_MOE])
def test_moe_families_keep_tensor_parallelism_with_their_stacked_experts(spec):
    # router whole, experts split over tp (runtime.tp_experts), Qwen2-MoE's shared expert like a dense MLP
    assert not {"tp", "tp+zero"} & set(graph(spec).unavailable_axes)


def test_tessera_plan_never_splits_tensors_where_a_user_plan_has_a_style_the_runtime_lacks():
    plan = tessera.plan(MIXTRAL, CLUSTER, global_batch=64, seq_len=SEQ, tp_plan=dict(LOCAL))
    assert plan.strategy.tp == 1 and all(c.strategy.tp == 1 for c in plan.alternatives)
    assert "tp" in plan.unavailable_axes
    assert "no tp      tp_plan entry 'model.layers.*.self_attn.q_proj': style 'local_colwise'" in plan.summary()


def test_a_tessera_preset_keeps_every_axis():
    assert graph("llama-tiny").unavailable_axes == {}
    # every axis, but not sequence parallelism through its MoELayer (runtime.tensor_parallel refuses it)
    assert set(graph("moe-tiny").unavailable_axes) == {"sp"}
    assert "dispatch buffer" in graph("moe-tiny").unavailable_axes["sp"]


def test_sequence_parallelism_is_never_planned_through_a_moe_layer():
    from tessera.models import build_model  # noqa: PLC0415

    plan = tessera.plan("moe-tiny", "dgx-h100:nodes=2", global_batch=64, seq_len=512, strategy="tp=2")
    assert plan.strategy.tp == 2 and not plan.strategy.sp
    with pytest.raises(NotModelledError, match="sequence parallelism through the mixture-of-experts layer"):
        check_tensor_parallel(build_model("moe-tiny"), plan.layers, tp=2, sp=True)  # what planning sp would meet


def test_a_pin_on_an_unavailable_axis_is_refused_naming_axis_and_reason():
    with pytest.raises(ConfigError, match=r"tp=2 is unavailable for this model: .*'local_colwise'"):
        search(graph(MIXTRAL, LOCAL), load_cluster(CLUSTER), TRAINING, pins={"tp": 2})
    assert "ep" not in graph(MIXTRAL).unavailable_axes  # stacked experts split (runtime.hf_experts)
    assert {"ep+cp", "ep+zero-bubble+zero"} <= set(graph(MIXTRAL).unavailable_axes)


def test_moe_strategies_never_pair_ep_with_selective_recomputation_nor_sp_through_a_moe_layer():
    layers = list(graph("moe-tiny").layers)
    found = list(strategies(layers, load_cluster(CLUSTER), TRAINING, {}, unavailable=graph("moe-tiny").unavailable_axes))
    experts = [s for s in found if s.ep > 1]
    assert experts and any(s.tp > 1 for s in experts)
    assert not any(s.sp or s.recompute == "selective" for s in experts)
    assert not any(s.sp for s in found)  # a MoELayer routes a dispatch buffer: no sp anywhere
    hf = graph(MIXTRAL)  # stacked experts get their sequence gathered: ep x tp x sp runs (runtime.tp_experts)
    assert any(s.sp and s.ep > 1 for s in strategies(list(hf.layers), load_cluster(CLUSTER), TRAINING, {},
                                                     unavailable=hf.unavailable_axes))
    with pytest.raises(ConfigError, match="the runtime cannot run on this model: sequence parallelism"):
        search(graph("moe-tiny"), load_cluster(CLUSTER), TRAINING, pins={"ep": 2, "tp": 2, "sp": True})


def test_the_plan_json_round_trip_keeps_unavailable_axes_and_old_plans_load():
    plan = plan_of(GPT2)
    assert Plan.from_json(plan.to_json()).unavailable_axes == plan.unavailable_axes != {}
    old = plan.model_dump(mode="json")
    del old["unavailable_axes"]
    assert Plan.model_validate(old).unavailable_axes == {}


@pytest.mark.parametrize("spec", [LLAMA, GPT2, PHI3, NEOX, OPT, MIXTRAL, "llama-tiny", "moe-tiny"])
def test_every_returned_strategy_passes_the_runtime_prechecks(spec):
    plan = plan_of(spec)
    for candidate in (plan, *plan.alternatives, *plan.degree_alternatives):
        strategy = candidate.strategy
        runtime_accepts(spec, with_strategy(spec, plan, strategy) if candidate is not plan else plan)


SCALES = [(spec, nodes) for spec in MOE_FAMILIES for nodes in (2, 4, 8, 16)]
"""MoE families on 2-16 H100 nodes: Qwen2-MoE (router, shared expert and its gate) on 16 by default, the rest slow."""


@pytest.mark.parametrize(("spec", "nodes"), [pytest.param(spec, nodes, marks=() if (spec, nodes) == (QWEN2_MOE, 16)
                                                          else pytest.mark.slow) for spec, nodes in SCALES])
def test_moe_plans_at_scale_only_return_what_the_runtime_runs(spec, nodes):
    # tessera.plan's search on 2-16 H100 nodes, free and with tp pinned (tp, tp x ep, tp x pp candidates): the plan,
    # its runners-up and its per-degree alternatives all pass apply_plan's own pre-checks on the model
    training = TrainingConfig(global_batch=32 * nodes, seq_len=SEQ, precision="bf16")
    for pins in ({}, {"tp": 2}):
        plan = search(graph(spec), load_cluster(f"dgx-h100:nodes={nodes}"), training, pins=pins)
        assert plan.strategy.tp == pins.get("tp", plan.strategy.tp)
        for candidate in (plan, *plan.alternatives, *plan.degree_alternatives):
            runtime_accepts(spec, with_strategy(spec, plan, candidate.strategy))


@pytest.mark.parametrize(("spec", "tp_plan"), [(GPT2, ()), (MIXTRAL, ()), (MIXTRAL, LOCAL), (LLAMA, ())])
def test_an_unavailable_axis_is_one_the_runtime_refuses(spec, tp_plan):
    plan = plan_of(spec, tp_plan)
    for axis in graph(spec, tp_plan).unavailable_axes:
        degree = {"tp": dict(tp=2, dp=8, sp=False), "pp": dict(pp=2, dp=8), "ep": dict(ep=2),
                  "cp": dict(cp=2, dp=8, sp=False),
                  "ep+cp": dict(ep=2, cp=2, dp=8, sp=False),
                  "ep+zero-bubble+zero": dict(ep=2, pp=2, dp=8, zero=1, schedule="zero-bubble")}[axis]
        strategy = plan.strategy.model_copy(update=degree)
        with pytest.raises(NotModelledError):
            runtime_accepts(spec, with_strategy(spec, plan, strategy, tp_plan), tp_plan)


def test_the_report_and_the_terminal_table_say_which_axes_were_unavailable():
    from rich.console import Console

    from tessera.planner.explain import plan_markdown
    from tessera.report import print_plan

    plan = plan_of(MIXTRAL, LOCAL)
    assert "## Unavailable axes" in plan_markdown(plan) and "style 'local_colwise'" in plan_markdown(plan)
    console = Console(record=True, width=200)
    print_plan(plan, console)
    text = console.export_text()
    assert "no tp" in text and "local_colwise" in text
    assert "Unavailable axes" not in plan_markdown(plan_of("llama-tiny"))


def test_what_an_unavailable_axis_would_gain_is_predicted_when_it_would_change_the_plan():
    from tessera.planner.search import unavailable_gains

    tiny = plan_of(MIXTRAL, LOCAL)
    assert unavailable_gains(graph(MIXTRAL, LOCAL), load_cluster(CLUSTER), TRAINING, pins={}, best=tiny.estimate) == tiny.unavailable_gains
    slow = tiny.estimate.model_copy(update={"step_time_s": tiny.estimate.step_time_s * 100})  # a plan tp could beat
    gains = unavailable_gains(graph(MIXTRAL, LOCAL), load_cluster(CLUSTER), TRAINING, pins={"dp": 8, "pp": 1}, best=slow)
    assert gains and all(g.verdict.split()[0] in graph(MIXTRAL, LOCAL).unavailable_axes and "would gain" in g.verdict
                         for g in gains)
    from rich.console import Console  # the terminal table says it too (it had only in JSON and the md report)

    from tessera.report import print_plan

    console = Console(record=True, width=300)
    print_plan(tiny.model_copy(update={"unavailable_gains": gains}), console)
    assert gains[0].verdict in console.export_text()


def test_a_model_holding_batch_norm_has_only_data_parallelism():
    # The runtime keeps BatchNorm exact under data parallelism only (runtime.data_parallel.check_batch_norm).
    import torch
    from torch import nn

    from tessera.planner.capabilities import FX_FRONT_END, unavailable_axes

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    reasons = unavailable_axes(model, {}, [], front_end=FX_FRONT_END)
    assert set(reasons) >= {"tp", "cp", "pp"}
    assert "BatchNorm 1" in reasons["pp"] and "BatchNorm 1" in reasons["accumulation"] and "cp" in reasons
    plain = unavailable_axes(nn.Sequential(), {}, [], front_end=FX_FRONT_END)
    assert set(plain) == {"cp"}  # no attention to run as ring attention, and no BatchNorm


def test_model_dependent_features_shape_the_search():
    # BatchNorm: one micro-batch per step and no recomputation; packed projections (GPT-2) run tp with FSDP2 too.
    from tessera.planner.space import model_features, model_refusal

    cluster = load_cluster(CLUSTER)
    refused = {"accumulation": "BatchNorm", "recompute": "BatchNorm", "tp": "BatchNorm"}
    found = list(strategies(list(graph("llama-tiny").layers), cluster, TRAINING, {}, unavailable=refused))
    assert found and all(s.tp == 1 and s.micro_batch * s.dp == TRAINING.global_batch and s.recompute == "none"
                         for s in found)
    packed = list(strategies(list(graph(GPT2).layers), cluster, TRAINING, {}, unavailable=graph(GPT2).unavailable_axes))
    assert any(s.tp > 1 and s.zero >= 1 and s.dp > 1 for s in packed)
    assert model_refusal(model_features(Strategy.parse("dp=8,tp=2,zero=1"), TRAINING), {"tp+zero": "x"}) == "tp+zero"


def test_a_module_applied_at_two_depths_makes_pipelining_unavailable_by_name():
    """One block object called before and after the others (weight sharing across depth): no stage can hold it, so
    capture says so and the planner never proposes pp, rather than the runtime refusing a plan it made."""
    import torch
    from torch import nn

    class SharedTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.shared = nn.Sequential(nn.Linear(16, 16), nn.GELU())
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16)) for _ in range(2))
            self.head = nn.Linear(16, 32)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.shared(self.embed(tokens))
            for block in self.blocks:
                hidden = block(hidden)
            return self.head(self.shared(hidden))

    plan = tessera.plan(SharedTwice(), "cpu:ranks=2", global_batch=8, seq_len=8)
    assert plan.unavailable_axes["pp"].startswith("shared.0 runs again after blocks.1")
    with pytest.raises(ConfigError, match="pp=2 is unavailable for this model: shared.0 runs again"):
        tessera.plan(SharedTwice(), "cpu:ranks=2", global_batch=8, seq_len=8, strategy="pp=2")


WIDTH = 32  # a module-level constant a user's attention reshapes to


class _Attention(nn.Module):
    def __init__(self, width_from_tensor: bool) -> None:
        super().__init__()
        self.width_from_tensor, self.num_heads, self.head_dim = width_from_tensor, 4, WIDTH // 4
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = (p(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o(y.reshape(batch, length, -1 if self.width_from_tensor else WIDTH))


class _Block(nn.Module):
    def __init__(self, width_from_tensor: bool) -> None:
        super().__init__()
        self.attn = _Attention(width_from_tensor)

    def forward(self, x):
        return x + self.attn(x)


class _Stack(nn.Module):
    def __init__(self, width_from_tensor: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList(_Block(width_from_tensor) for _ in range(2))
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_an_attention_reshaping_to_a_constant_full_width_is_not_planned_with_tensor_parallelism():
    # The rules split its q/k/v/o and divide num_heads; its forward's reshape to the module constant then failed the
    # first tensor-parallel step with a raw shape error. A trial of the block as one rank holds it finds it at capture.
    with torch.device("meta"):
        constant, from_tensor = _Stack(width_from_tensor=False), _Stack(width_from_tensor=True)
    said = tessera.plan(constant, "cpu:ranks=2", global_batch=4, seq_len=16).unavailable_axes.get("tp", "")
    assert said.startswith("blocks.0's forward fails on one rank's share of its heads and linears (tp=2: "
                           "RuntimeError: shape") and said.endswith("or plan with tp=1")
    assert "tp" not in tessera.plan(from_tensor, "cpu:ranks=2", global_batch=4, seq_len=16).unavailable_axes
    with pytest.raises(ConfigError, match="blocks.0's forward fails on one rank's share"):
        tessera.plan(constant, "cpu:ranks=2", global_batch=4, seq_len=16, strategy="tp=2")


def test_a_hugging_face_model_returning_every_layers_hidden_states_is_not_planned_with_pipelines():
    # The planner accepted pp=2, then the runtime refused: the recorded hidden states are computed inside the layers.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, use_cache=False, output_hidden_states=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    said = tessera.plan(model, "cpu:ranks=2", global_batch=4, seq_len=16).unavailable_axes.get("pp", "")
    assert said.startswith("LlamaForCausalLM returns every layer's hidden states (config.output_hidden_states=True)")
    assert said.endswith("set output_hidden_states=False for training, or plan with pp=1")


def test_torchtitans_qwen3_keeps_tensor_parallelism_and_its_moe_names_the_weights_it_cannot_split():
    # Its per-head q_norm comes before the block's own norms in module order: the block's width was read as one head's
    # (16), so tp was refused as "a reordered projection?". The MoE model's GroupedExperts hold 3-D weights in no
    # linear, and the refusal named its router's gate instead of them.
    pytest.importorskip("torchtitan.models.qwen3")
    from tests.distributed.test_torchtitan import _qwen3, qwen3_dense, qwen3_moe  # noqa: PLC0415

    dense = tessera.plan(qwen3_dense(0), "cpu:ranks=2", global_batch=4, seq_len=16)
    assert "tp" not in dense.unavailable_axes
    # Tied (its debugmodel, 0.6B to 4B): torchtitan's Embedding does its own lookup and stays whole, the head is
    # split, so the runtime refused the plan after planning had offered it.
    tied = tessera.plan(_qwen3(0, moe=False, tied=True), "cpu:ranks=2", global_batch=4, seq_len=16)
    assert tied.unavailable_axes.get("tp", "").startswith(
        "tied parameters tok_embeddings.weight and lm_head.weight would be split differently by tensor parallelism")
    said = tessera.plan(qwen3_moe(0), "cpu:ranks=2", global_batch=4, seq_len=16).unavailable_axes.get("tp", "")
    assert said.startswith("tensor parallelism does not know how to split parameter "
                           "layers.0.moe.routed_experts.inner_experts.w1_EFD (owned by GroupedExperts)")


def test_bart_plans_its_decoder_blocks_and_refuses_tensor_parallelism_naming_the_logits_bias():
    # Its decoder embeddings sit between the encoder's blocks and the decoder's: the chunk split dropped the decoder
    # blocks from the plan (and the estimate), so tp was refused at apply for a parameter "in no planned layer", and
    # pp crashed in the decoder. With them in, tp still cannot run: the root adds final_logits_bias to the logits.
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=16)
    with torch.device("meta"):
        model = transformers.BartForConditionalGeneration(config)
    plan = tessera.plan(model, "cpu:ranks=2", global_batch=4, seq_len=16, strategy="pp=2")
    assert {"model.decoder.layers.0", "model.decoder.layers.1"} <= {layer.fqn for layer in plan.layers}
    assert plan.unavailable_axes["tp"].startswith("final_logits_bias, of shape (1, 256), spans the vocabulary")


def test_an_embedding_is_split_over_the_vocabulary_only_where_it_looks_up_the_ids_it_is_given():
    # BART's learned positions take input_ids and look up positions made from their shape: split by rows, its
    # lookup mixed a plain tensor with the sharded weight.
    pytest.importorskip("transformers")
    from transformers.models.bart.modeling_bart import BartLearnedPositionalEmbedding, BartScaledWordEmbedding

    from tessera.cost_models.tp_embeddings import embedding_kept_whole

    assert embedding_kept_whole(BartLearnedPositionalEmbedding(16, 8), None)
    assert not embedding_kept_whole(BartScaledWordEmbedding(16, 8, padding_idx=0, embed_scale=2.0), None)
    assert not embedding_kept_whole(nn.Embedding(16, 8), None)
    assert embedding_kept_whole(nn.Embedding(16, 8), "replicated")


def test_the_tensor_parallel_trial_splits_the_heads_a_config_declares_evenly():
    # The trial tried tp=2 whatever the heads: 3 key/value heads failed it, and tensor parallelism was refused for
    # the model as "reads a full width from outside its modules", though tp=3 splits them; one key/value head (which
    # no degree splits) was refused for the same wrong reason when eager attention hid the heads from capture.
    llama = ("hf:llama:hidden_size=48,num_attention_heads=6,num_key_value_heads=3,intermediate_size=96,"
             "num_hidden_layers=2,vocab_size=96")
    plan = tessera.plan(llama, "cpu:ranks=3", global_batch=3, seq_len=16, strategy="tp=3")
    assert plan.strategy.tp == 3 and "tp" not in plan.unavailable_axes
    gemma2 = ("hf:gemma2:hidden_size=64,num_attention_heads=4,num_key_value_heads=1,head_dim=16,intermediate_size=128,"
              "num_hidden_layers=2,vocab_size=96,sliding_window=8")
    said = tessera.plan(gemma2, "cpu:ranks=2", global_batch=2, seq_len=16).unavailable_axes["tp"]
    assert "num_attention_heads=4, num_key_value_heads=1: no tensor-parallel degree splits them" in said


@pytest.mark.parametrize(("spec", "says"), [
    # StableLM's LayerNormPerHead: one norm per head, zipped with the heads the attention holds (silently wrong)
    ("hf:stablelm:qk_layernorm=True,bos_token_id=0,eos_token_id=0", r"q_layernorm\.norms holds one norm per head \(4\)"),
    # Cohere's q_norm: a (heads, head_dim) weight (was refused as normalising across the heads, which it does not)
    ("hf:cohere:use_qk_norm=True", r"q_norm holds a weight per head \(\[4, 8\]\)"),
])
def test_per_head_norm_weights_are_refused_for_tensor_parallelism_by_what_they_are(spec, says):
    small = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=96"
    said = tessera.plan(f"{spec},{small}", "cpu:ranks=2", global_batch=2, seq_len=16).unavailable_axes["tp"]
    assert re.search(says, said), said


def test_llama4_experts_called_with_routed_tokens_are_not_taken_for_mixtrals():
    # Llama4TextExperts hold 3-D gate_up_proj/down_proj like Mixtral's but are called with tokens already routed:
    # capture swapped in a forward taking the router's choices and planning crashed in torch.export
    spec = ("hf:llama4_text:hidden_size=32,intermediate_size=64,intermediate_size_mlp=64,num_hidden_layers=2,"
            "num_attention_heads=4,num_key_value_heads=2,head_dim=8,vocab_size=96,num_local_experts=4,"
            "num_experts_per_tok=1,attention_chunk_size=16")
    assert tessera.plan(spec, "cpu:ranks=2", global_batch=2, seq_len=16).strategy.world_size == 2
