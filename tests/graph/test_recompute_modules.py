"""Recomputing named pieces of a block (Megatron-Core's ``--recompute-modules``): what capture measures of them
(``planner.recompute_regions``) and how a strategy that names them is priced (``cost_models.module_recompute``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.cost_models.estimate import estimate
from tessera.cost_models.profiles import MEGATRON
from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.planner.capture import capture, capture_preset
from tessera.planner.space import strategies
from tessera.topology.presets import load_cluster

SEQ, HEADS, NOPE, ROPE, VALUE, Q_RANK, KV_RANK, HIDDEN, FFN = 128, 8, 32, 16, 32, 64, 32, 256, 512
TINY_DEEPSEEK_V3 = (
    f"hf:deepseek_v3:num_hidden_layers=3,hidden_size={HIDDEN},intermediate_size={FFN},moe_intermediate_size=128,"
    f"num_attention_heads={HEADS},num_key_value_heads={HEADS},n_routed_experts=8,n_shared_experts=1,"
    f"num_experts_per_tok=2,first_k_dense_replace=1,q_lora_rank={Q_RANK},kv_lora_rank={KV_RANK},"
    f"qk_nope_head_dim={NOPE},qk_rope_head_dim={ROPE},v_head_dim={VALUE},n_group=1,topk_group=1,vocab_size=1000")


@pytest.fixture(scope="module")
def graph():
    return capture_preset(TINY_DEEPSEEK_V3, seq_len=SEQ, dtype=torch.bfloat16)


def test_latent_attention_up_projections_make_what_the_attention_core_reads(graph) -> None:
    query_and_key = 2 * HEADS * (NOPE + ROPE)  # elements a token, each made after the up-projections
    values = HEADS * VALUE
    for block in graph.blocks:
        assert block.mla_up_proj_flops == 2 * SEQ * (Q_RANK * HEADS * (NOPE + ROPE) + KV_RANK * HEADS * (NOPE + VALUE))
        # the queries and keys the core reads, and the key/value projection its values are a view of, saved whole
        assert block.mla_up_proj_saved_bytes == 2 * SEQ * (query_and_key + HEADS * (NOPE + VALUE))
        assert block.mla_up_proj_saved_bytes > 2 * SEQ * (query_and_key + values)
    llama = capture_preset("llama-tiny:layers=2", seq_len=32)
    assert all(block.mla_up_proj_saved_bytes == block.mla_up_proj_flops == 0 for block in llama.blocks)


def test_a_dense_mlp_and_shared_experts_free_what_they_make_less_their_outputs(graph) -> None:
    dense, moe = graph.blocks[0], graph.blocks[1]
    assert dense.experts == 0 and dense.mlp_flops == 2 * SEQ * 3 * HIDDEN * FFN
    # gate and up projections' outputs and their product, three of the inner width a token; the activation's output
    # is the fused-gate saving's (a fused kernel saves none); the MLP's input (made by the norm before it) and its
    # output (kept by the checkpoint) are not its to free
    assert dense.mlp_saved_bytes == 3 * SEQ * FFN * 2 and dense.fused_gate_saving_bytes == SEQ * FFN * 2
    assert dense.shared_experts_saved_bytes == dense.shared_experts_flops == 0
    shared = 128  # moe_intermediate_size x n_shared_experts
    assert moe.shared_experts_flops == 2 * SEQ * 3 * HIDDEN * shared
    assert moe.shared_experts_saved_bytes == 3 * SEQ * shared * 2


def test_the_routed_experts_activation_frees_the_product_the_second_projection_reads(graph) -> None:
    dense, moe = graph.blocks[0], graph.blocks[1]
    slots = moe.top_k * SEQ  # at the measured (balanced) load
    assert moe.moe_act_saved_bytes == slots * 128 * 2 and dense.moe_act_saved_bytes == 0
    # the activation's own output is the fused-gate saving's, the routed experts' with the shared expert's
    assert moe.fused_gate_saving_bytes == (slots + SEQ) * 128 * 2


def test_the_norms_in_front_of_attention_and_mlp_free_their_outputs_where_megatron_keeps_them_apart(graph) -> None:
    # each norm's output, of the hidden width a token, saved by the linears that read it
    assert all(b.input_norm_saved_bytes == b.mlp_norm_saved_bytes == SEQ * HIDDEN * 2 for b in graph.blocks)
    # Transformer Engine fuses a norm into the linear after it but in front of latent attention and of a MoE layer
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=16, seq_len=SEQ)
    plain = Strategy.parse("dp=8,zero=1,mbs=2,recompute=none")
    norms = plain.model_copy(update={"recompute_modules": ("layernorm",)})
    before, after = (estimate(graph.layers, cluster, training, s, profile=MEGATRON) for s in (plain, norms))
    freed = SEQ * HIDDEN * 2 * (len(graph.blocks) + sum(1 for b in graph.blocks if b.experts))
    assert before.memory_by_category_bytes["activations"] - after.memory_by_category_bytes["activations"] == (
        pytest.approx(plain.micro_batch * freed))
    llama = capture_preset("llama-tiny:layers=2", seq_len=32)
    assert llama.blocks[0].input_norm_saved_bytes > 0  # measured, but a dense Llama block keeps no norm apart
    dense = estimate(llama.layers, cluster, TrainingConfig(global_batch=8, seq_len=32), norms.model_copy(
        update={"micro_batch": 1}))
    assert any("recompute_modules layernorm: capture found no such piece" in note for note in dense.notes)


def test_under_fp8_a_freed_linear_input_is_freed_at_the_size_the_recipe_saves_it(graph) -> None:
    cluster = load_cluster("dgx-h100:nodes=1")
    fp8 = TrainingConfig(global_batch=16, seq_len=SEQ, precision="fp8", fp8_scaling="current")
    plain = Strategy.parse("dp=8,zero=1,mbs=2,recompute=none")
    act = plain.model_copy(update={"recompute_modules": ("moe_act",)})
    before, after = (estimate(graph.layers, cluster, fp8, s, profile=MEGATRON) for s in (plain, act))
    halved = sum(b.moe_act_saved_bytes for b in graph.blocks) / 2  # all of it the experts' second projection's input
    assert before.memory_by_category_bytes["activations"] - after.memory_by_category_bytes["activations"] == (
        pytest.approx(plain.micro_batch * halved))


def test_a_moe_piece_whose_experts_capture_replayed_is_unmeasured_and_said_so() -> None:
    """Tessera's own MoE block (its pieces under its own names): capture runs two of its experts and replays the
    rest, whose activations are then not made where the marks could see them."""
    moe = capture_preset("moe-tiny", seq_len=32)
    block = moe.blocks[0]
    assert block.experts and block.input_norm_saved_bytes > 0 and block.mlp_norm_saved_bytes > 0
    assert block.mlp_saved_bytes == block.mlp_flops == 0
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=8, seq_len=32)
    pieces = Strategy.parse("dp=8,zero=1,mbs=1,recompute=none,recompute_modules=layernorm/moe")
    notes = estimate(moe.layers, cluster, training, pieces, profile=MEGATRON).notes
    assert any(note.startswith("recompute_modules moe: capture found no such piece") for note in notes)


def test_naming_pieces_frees_their_activations_and_re_runs_their_matmuls(graph) -> None:
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=16, seq_len=SEQ)
    plain = Strategy.parse("dp=8,zero=1,mbs=2,recompute=none")
    pieces = plain.model_copy(update={"recompute_modules": ("mla_up_proj", "mlp")})
    before, after = (estimate(graph.layers, cluster, training, s, profile=MEGATRON) for s in (plain, pieces))
    dense = graph.blocks[0]
    freed = sum(b.mla_up_proj_saved_bytes for b in graph.blocks) + dense.mlp_saved_bytes
    assert before.memory_by_category_bytes["activations"] - after.memory_by_category_bytes["activations"] == (
        pytest.approx(plain.micro_batch * freed))
    rerun = sum(b.mla_up_proj_flops for b in graph.blocks) + dense.mlp_flops  # the MoE blocks' MLP is not "mlp"
    assert after.hardware_flops_per_step - before.hardware_flops_per_step == pytest.approx(training.global_batch * rerun)
    assert after.recompute_time_s > before.recompute_time_s == 0 and after.step_time_s > before.step_time_s


def test_hand_written_latent_attention_leaves_the_piece_unmeasured_and_the_residual_unmarked() -> None:
    """Without a fused attention core to stop at, what the up-projections' recomputation frees is not known: nothing is
    priced, and nothing computed from them (the block's output, the next block) counts as theirs."""

    class LatentAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kv_a_proj, self.kv_b_proj, self.q_proj = nn.Linear(64, 16), nn.Linear(16, 128), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            k, v = self.kv_b_proj(self.kv_a_proj(x)).chunk(2, dim=-1)
            return x + torch.softmax(self.q_proj(x) @ k.transpose(-1, -2), -1) @ v

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(100, 64), nn.Linear(64, 100)
            self.blocks = nn.ModuleList([LatentAttention(), LatentAttention()])

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks[1](self.blocks[0](self.emb(ids))))

    graph = capture(Tiny(), seq_len=16, name="hand-written")
    assert all(block.mla_up_proj_saved_bytes == block.mla_up_proj_flops == 0 for block in graph.blocks)


def test_the_planner_fills_a_strategy_around_pinned_pieces(graph) -> None:
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=16, seq_len=SEQ)
    found = list(strategies(list(graph.layers), cluster, training, {"recompute_modules": ("mla_up_proj",), "dp": 8}))
    assert found and {s.recompute for s in found} <= {"none", "selective"}  # no block keeps a piece under full
    assert all(s.recompute_modules == ("mla_up_proj",) for s in found)


def test_a_piece_the_model_lacks_is_priced_as_nothing_and_said_so() -> None:
    llama = capture_preset("llama-tiny:layers=2", seq_len=32)
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=8, seq_len=32)
    plain = Strategy.parse("dp=8,zero=1,mbs=1,recompute=none")
    up = estimate(llama.layers, cluster, training, plain.model_copy(update={"recompute_modules": ("mla_up_proj",)}))
    assert up.peak_memory_bytes == estimate(llama.layers, cluster, training, plain).peak_memory_bytes
    assert any("recompute_modules mla_up_proj: capture found no such piece" in note for note in up.notes)


def test_a_whole_moe_piece_frees_its_mlp_and_exchanges_its_tokens_again(graph) -> None:
    cluster, training = load_cluster("dgx-h100:nodes=1"), TrainingConfig(global_batch=16, seq_len=SEQ)
    plain = Strategy.parse("dp=8,ep=4,zero=1,mbs=2,recompute=none")
    moe = plain.model_copy(update={"recompute_modules": ("moe_act", "moe")})  # moe holds moe_act: counted once
    before, after = (estimate(graph.layers, cluster, training, s, profile=MEGATRON) for s in (plain, moe))
    freed = sum(b.mlp_saved_bytes for b in graph.blocks if b.experts)
    assert before.memory_by_category_bytes["activations"] - after.memory_by_category_bytes["activations"] == (
        pytest.approx(plain.micro_batch * freed))
    exchanges = before.comm_time_by_kind_s["ep_alltoall"]
    assert after.comm_time_by_kind_s["ep_alltoall"] == pytest.approx(1.5 * exchanges)  # the forward's two again
    offloaded = Strategy.parse("dp=8,ep=4,zero=1,mbs=2,recompute=none,block_recompute=none/offload/offload")
    kept_nothing = estimate(graph.layers, cluster, training, offloaded.model_copy(
        update={"recompute_modules": ("moe",)}), profile=MEGATRON)
    assert kept_nothing.comm_time_by_kind_s["ep_alltoall"] == pytest.approx(
        estimate(graph.layers, cluster, training, offloaded, profile=MEGATRON).comm_time_by_kind_s["ep_alltoall"])
