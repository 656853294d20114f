"""Hugging Face models (optional extra ``tessera[hf]``): capture from ``hf:`` specs, on meta, with torch.export."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tessera.errors import ModelSpecError, NotModelledError  # noqa: E402
from tessera.cost_models.layer_sums import attention_head_widths, kv_bytes  # noqa: E402
from tessera.planner.capture import capture_preset  # noqa: E402
from tessera.planner.layer_graph import with_mtp_modules  # noqa: E402
from tessera.cost_models import Strategy  # noqa: E402
from tessera.cost_models.estimate import stage_split  # noqa: E402
from tessera.planner.model_source import resolve_model  # noqa: E402

H, F, HEADS, KV, V, T = 64, 128, 4, 2, 256, 32
DECODER = f"hidden_size={H},intermediate_size={F},num_hidden_layers=3,num_attention_heads={HEADS},vocab_size={V}"
SPECS = {
    "llama": f"hf:llama:{DECODER},num_key_value_heads={KV},max_position_embeddings=128",
    "gpt2": f"hf:gpt2:n_embd={H},n_inner={F},n_layer=3,n_head={HEADS},vocab_size={V},n_positions=128",
    "mixtral": f"hf:mixtral:{DECODER},num_key_value_heads={KV},num_local_experts=4,num_experts_per_tok=2,"
    "max_position_embeddings=128",
    "bert": f"hf:bert:{DECODER},max_position_embeddings=128",
}
# Linear FLOPs per token of one block: attention projections, then the MLP (2 FLOPs per multiply-add).
ATTENTION_LINEAR = {"llama": 2 * (2 * H * H + 2 * H * H // 2), "gpt2": 2 * 4 * H * H, "bert": 2 * 4 * H * H}
MLP_LINEAR = {"llama": 2 * 3 * H * F, "gpt2": 2 * 2 * H * F, "bert": 2 * 2 * H * F}


@pytest.fixture(scope="module", params=list(SPECS))
def captured(request):  # noqa: ANN001, ANN201
    name = request.param
    model, _ = resolve_model(SPECS[name])
    return name, model, capture_preset(SPECS[name], seq_len=T)


def test_hf_models_capture_with_export_on_meta(captured) -> None:  # noqa: ANN001
    name, model, graph = captured
    assert all(p.is_meta for p in model.parameters())  # random init on meta: nothing was allocated
    assert graph.front_end == "torch.export"
    (reason,) = graph.fallback_reasons  # Hugging Face forwards do not symbolically trace
    assert reason.startswith("torch.fx.symbolic_trace cannot trace")
    assert graph.param_count == sum(p.numel() for p in model.parameters())
    assert len(graph.blocks) == 3 and graph.layers[-1].fqn == "loss"
    assert graph.layers[-2].kind == "head" and graph.layers[-2].vocab_size == V
    assert graph.layers[0].kind == "embedding" and graph.layers[0].vocab_size == V


def test_hf_block_facts(captured) -> None:  # noqa: ANN001
    name, _, graph = captured
    block = graph.blocks[-1]
    kv = KV if name in ("llama", "mixtral") else HEADS  # declared by the config (and passed grouped to SDPA)
    assert (block.hidden_size, block.attention_heads, block.kv_heads) == (H, HEADS, kv)
    assert block.experts == (4 if name == "mixtral" else 0)
    roles = [p.role for p in block.tp_pairs]
    assert roles == (["attention", "expert"] if name == "mixtral" else ["attention", "mlp"])  # stacked experts: one pair
    if name == "mixtral":
        assert (block.tp_pairs[1].column, block.tp_pairs[1].row) == (("mlp.experts.gate_up_proj",), "mlp.experts.down_proj")
    assert block.saved_bytes_full_recompute <= block.saved_bytes_selective <= block.saved_bytes_no_recompute


def test_hf_block_flops_are_the_analytic_count(captured) -> None:  # noqa: ANN001
    name, _, graph = captured
    attention = 2 * 2 * T * T * H  # scores and weighted values
    block = graph.blocks[-1]
    if name == "mixtral":
        linear = 2 * (2 * H * H + 2 * H * H // 2) + 2 * H * 4  # projections and the router
        experts = 2 * T * 2 * 3 * H * F  # top-2 of 4 experts: each at its expected load of 2 T / 4 tokens
        assert block.forward_flops == T * linear + attention + experts
    else:
        assert block.forward_flops == T * (ATTENTION_LINEAR[name] + MLP_LINEAR[name]) + attention
    assert block.selective_recompute_flops == attention


def test_hf_rescales_to_other_sequence_lengths(captured) -> None:  # noqa: ANN001
    name, _, graph = captured
    if name in ("llama", "bert"):  # a causal (mask T x T) and a bidirectional model; the others cost the same
        scaled = capture_preset(SPECS[name], seq_len=graph.seq_len, fit_seq_scaling=True)
        assert scaled.layers == graph.layers
        assert scaled.at_seq_len(24) == capture_preset(SPECS[name], seq_len=24, fit_seq_scaling=True)


def test_hf_mixtral_expert_load_is_settable() -> None:
    spec = SPECS["mixtral"].replace("num_hidden_layers=3", "num_hidden_layers=1")
    base = capture_preset(spec, seq_len=T)
    busy = capture_preset(spec, seq_len=T, expert_capacity_factor=2.0)
    extra = busy.blocks[0].forward_flops - base.blocks[0].forward_flops
    assert extra == 2 * T * 2 * 3 * H * F  # twice the expected load: 2 T more token slots over all experts


def test_a_head_dim_that_a_default_config_lacks_sets_the_attention_width() -> None:
    """Qwen3's released configs set ``head_dim`` (128 at width 2048), which its default config has no attribute for:
    accepted, it widens the query and output projections to heads x head_dim."""
    spec = (f"hf:qwen3_moe:hidden_size={H},num_hidden_layers=1,num_attention_heads={HEADS},num_key_value_heads={KV},"
            f"num_local_experts=4,num_experts_per_tok=2,moe_intermediate_size={F},vocab_size={V}")
    narrow, wide = (capture_preset(spec + extra, seq_len=T).blocks[0] for extra in ("", f",head_dim={2 * H // HEADS}"))
    projections = 2 * (2 * H * H + 2 * H * H // HEADS * KV)  # q and o, then k and v: twice as wide
    assert wide.param_count - narrow.param_count == projections // 2 + 2 * H // HEADS  # and q/k norms of head_dim
    assert wide.forward_flops > narrow.forward_flops
    with pytest.raises(ModelSpecError, match="gpt2 configs have no head_dim, and its model does not read one"):
        resolve_model(SPECS["gpt2"] + ",head_dim=32")


def test_an_experts_narrow_side_is_its_matmuls_width() -> None:
    """A fine-grained expert (Qwen3's: inner width under the hidden size) reports that width, the narrow side of its
    stacked gate/up and down matrices; a dense layer reports none. The cost model prices the experts' matmuls there
    (``cost_models.compute``)."""
    spec = (f"hf:qwen3_moe:hidden_size={H},num_hidden_layers=1,num_attention_heads={HEADS},num_key_value_heads={KV},"
            f"num_local_experts=4,num_experts_per_tok=2,vocab_size={V},moe_intermediate_size=")
    graph = capture_preset(spec + f"{H // 4}", seq_len=T)
    assert graph.blocks[0].expert_width == H // 4
    assert capture_preset(spec + f"{2 * H}", seq_len=T).blocks[0].expert_width == H  # wider experts: the hidden size
    assert graph.layer("model.embed_tokens").expert_width == 0


def test_latent_attention_whose_values_are_narrower_than_its_keys_is_measured() -> None:
    """DeepSeek-V3's Multi-head Latent Attention: queries and keys 24 wide (16 + 8 rotary), values 16. The flash kernel
    capture routes SDPA to refuses that; the memory-efficient one measures it (``planner.kernels``), its core's forward
    FLOPs those of both products (FlopCounterMode's count: no causal halving)."""
    spec = (f"hf:deepseek_v3:hidden_size={H},intermediate_size={F},moe_intermediate_size={F // 4},num_hidden_layers=2,"
            f"num_attention_heads={HEADS},num_key_value_heads={HEADS},n_routed_experts=4,num_experts_per_tok=2,"
            "n_shared_experts=1,first_k_dense_replace=1,q_lora_rank=32,kv_lora_rank=16,qk_nope_head_dim=16,"
            f"qk_rope_head_dim=8,v_head_dim=16,n_group=1,topk_group=1,vocab_size={V}")
    dense, sparse = capture_preset(spec, seq_len=T).blocks
    assert dense.selective_recompute_flops == sparse.selective_recompute_flops == 2 * HEADS * T * T * (24 + 16)
    assert (dense.expert_width, sparse.expert_width) == (0, F // 4)
    # A context-parallel ring moves keys 24 wide and values 16 a head, not two heads of hidden / heads
    assert dense.kv_head_width == 24 + 16
    assert kv_bytes(dense) == dense.output_bytes / H * HEADS * (24 + 16)
    assert dense.query_head_width == 24  # a fused kernel's rate depends on both widths
    assert attention_head_widths([dense]) == ((1.0, (24, 16)),)


def test_multi_token_prediction_modules_run_one_more_block_and_the_head_again() -> None:
    """DeepSeek-V3's MTP module, as a framework that trains it runs it: a copy of the last block behind a 2h -> h
    projection of two normed inputs, after the blocks (so a pipeline's last chunk holds it); the final norm, the head
    and the loss run once more; the head's weights are shared; the same at another sequence length."""
    spec = (f"hf:deepseek_v3:hidden_size={H},intermediate_size={F},moe_intermediate_size={F // 4},num_hidden_layers=2,"
            f"num_attention_heads={HEADS},num_key_value_heads={HEADS},n_routed_experts=4,num_experts_per_tok=2,"
            "n_shared_experts=1,first_k_dense_replace=1,q_lora_rank=32,kv_lora_rank=16,qk_nope_head_dim=16,"
            f"qk_rope_head_dim=8,v_head_dim=16,n_group=1,topk_group=1,vocab_size={V}")
    graph = capture_preset(spec, seq_len=T, fit_seq_scaling=True)
    mtp = with_mtp_modules(graph, 1)
    assert [layer.fqn for layer in mtp.blocks] == ["model.layers.0", "model.layers.1", "mtp.0"]
    last, module = graph.blocks[-1], mtp.layer("mtp.0")
    assert module.param_count == last.param_count + 2 * H * H + 3 * H
    assert module.forward_flops == last.forward_flops + 2 * (2 * H) * H * T
    assert module.saved_bytes_no_recompute == last.saved_bytes_no_recompute + 4 * H * 2 * T
    for name in ("lm_head", "loss"):
        assert mtp.layer(name).forward_flops == 2 * graph.layer(name).forward_flops
        assert mtp.layer(name).saved_bytes_no_recompute == 2 * graph.layer(name).saved_bytes_no_recompute
        assert mtp.layer(name).param_count == graph.layer(name).param_count
    assert ("model.layers.1", "mtp.0") in mtp.edges and ("mtp.0", "model.norm") in mtp.edges
    longer, rebuilt = mtp.at_seq_len(2 * T), with_mtp_modules(graph.at_seq_len(2 * T), 1)
    assert [layer.forward_flops for layer in longer.layers] == [layer.forward_flops for layer in rebuilt.layers]
    assert with_mtp_modules(graph, 0) is graph
    # a pipeline's last stage runs the module without the embedding, so it holds a copy of the table
    embedding = graph.layer("model.embed_tokens").param_count
    first, last_stage = stage_split(mtp.layers, Strategy.parse("pp=2,dp=4")).stages
    plain_last = stage_split(graph.layers, Strategy.parse("pp=2,dp=4")).stages[1]
    assert last_stage.root_sharded_params == plain_last.root_sharded_params + embedding
    assert first.root_sharded_params == stage_split(graph.layers, Strategy.parse("pp=2,dp=4")).stages[0].root_sharded_params
    # evaluated as a framework that trains them; Tessera's runtime trains none and says so
    import tessera

    workload = {"global_batch": 8, "seq_len": T, "strategy": "dp=8,zero=1,mbs=1,recompute=none", "runs_on": "megatron"}
    plain = tessera.evaluate(spec, "dgx-h100:nodes=1", **workload).estimate
    with_module = tessera.evaluate(spec, "dgx-h100:nodes=1", **workload, mtp_layers=1).estimate
    assert with_module.step_time_s > plain.step_time_s and with_module.peak_memory_bytes > plain.peak_memory_bytes
    with pytest.raises(NotModelledError, match="trains no multi-token-prediction modules"):
        tessera.evaluate(spec, "dgx-h100:nodes=1", **{**workload, "runs_on": "tessera"}, mtp_layers=1)


def test_keys_and_values_are_measured_at_their_head_width() -> None:
    """Qwen3 declares heads wider than hidden / heads: its keys and values are counted at that width (what a
    context-parallel ring moves), grouped heads as declared; a Llama's head is hidden / heads wide, as before."""
    spec = (f"hf:qwen3:hidden_size={H},intermediate_size={F},num_hidden_layers=1,num_attention_heads={HEADS},"
            f"num_key_value_heads={KV},vocab_size={V},head_dim=")
    wide = capture_preset(spec + f"{2 * H // HEADS}", seq_len=T).blocks[0]
    assert (wide.kv_heads, wide.kv_head_width) == (KV, 4 * H // HEADS)
    assert kv_bytes(wide) == 2 * (2 * wide.output_bytes * KV / HEADS)  # twice the hidden / heads estimate
    assert kv_bytes(wide, repeated=True) == kv_bytes(wide) * HEADS / KV  # repeated to every query head
    llama = capture_preset(SPECS["llama"], seq_len=T).blocks[0]
    assert kv_bytes(llama) == 2 * llama.output_bytes * llama.kv_heads / llama.attention_heads


def test_hf_model_of_realistic_width_allocates_nothing() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    graph = capture_preset("hf:llama:num_hidden_layers=2", seq_len=512)  # 4096 wide: 0.67B parameters
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert graph.param_count > 0.6e9
    assert grown < 300 * 2**20  # fp32 weights alone would be 2.7 GB


def test_legacy_keys_of_a_published_config_json_are_converted_as_transformers_converts_them(caplog) -> None:
    """``rope_theta``, a top-level key of released config.json files (Llama 3's 500000), lives in
    ``rope_parameters`` in transformers 5, whose configs convert it: accepted (was refused as an unknown key); a
    generation setting transformers drops is accepted with a warning that it sets nothing; a key a config neither
    has nor converts is still refused, beside a key transformers accepts."""
    model, _ = resolve_model(f"{SPECS['llama']},rope_theta=500000,temperature=0.7")
    assert model.config.rope_parameters == {"rope_theta": 500000, "rope_type": "default"}
    assert "drop temperature" in caplog.text and "rope_theta" not in caplog.text
    with pytest.raises(ModelSpecError, match="gpt2 configs have no rope_theta"):  # learned positions: no RoPE
        resolve_model(SPECS["gpt2"] + ",rope_theta=500000")
    with pytest.raises(ModelSpecError, match="llama configs have no hiden_size"):
        resolve_model(f"{SPECS['llama']},rope_theta=500000,hiden_size=3")


def test_hf_spec_errors_name_the_problem() -> None:
    with pytest.raises(ModelSpecError, match="no hidden_sise"):
        resolve_model("hf:llama:hidden_sise=64")
    with pytest.raises(ModelSpecError, match="unknown Hugging Face model_type"):
        resolve_model("hf:no-such-model")
    with pytest.raises(ModelSpecError, match="did you mean 'llama'"):
        resolve_model("hf:lama")


def test_a_users_hf_model_with_its_default_cache_setting() -> None:
    """capture(model) on a model built by the user: use_cache=True in its config, passed as a module."""
    import torch
    import transformers

    from tessera.planner.capture import capture

    values = {key: int(value) for key, value in (item.split("=") for item in DECODER.split(","))}
    config = transformers.AutoConfig.for_model("llama", **values)
    assert config.use_cache
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    graph = capture(model, seq_len=T)  # the forward is called with use_cache=False: training keeps no cache
    direct = capture_preset("hf:llama:" + DECODER, seq_len=T)
    assert graph.front_end == "torch.export" and graph.layers == direct.layers


def test_building_an_hf_spec_prints_nothing_of_torchao(tmp_path):
    # transformers imports parts of torchao (installed by the test extras) while it builds a model; torchao and
    # torch then warn about CUDA libraries and pytree enums on stderr, which Tessera mutes (tessera.quiet). A fresh
    # interpreter, as the CLI: in this process torchao may already be imported, and would print nothing anyway.
    pytest.importorskip("torchao")
    build = ("from tessera.planner.model_source import hf_model; hf_model('hf:mixtral:hidden_size=64,"
             "intermediate_size=128,num_hidden_layers=1,num_attention_heads=4,num_key_value_heads=2,vocab_size=256,"
             "num_local_experts=4')")
    done = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "torchao" not in done.stderr and "_pytree" not in done.stderr, done.stderr


def test_hf_blocks_measure_the_activations_their_linears_read(captured) -> None:  # noqa: ANN001
    """q, k and v (or GPT-2's fused c_attn) read the block's normed input, the output projection the attention's
    output (H wide), the MLP's first linears the normed input, its last the F-wide activation: 3H + F per token,
    in bf16. Mixtral's router reads the normed input, its batched experts (``aten.bmm``) each token's copy for
    each of its two experts, then their F-wide activations: 3H + 2 (H + F)."""
    name, _, graph = captured
    expected = 2 * T * (5 * H + 2 * F if name == "mixtral" else 3 * H + F)
    assert {block.linear_input_bytes for block in graph.blocks} == {expected}


def test_grouped_keys_and_values_are_measured_grouped() -> None:
    """GPU training of unpacked rows passes no mask and grouped K/V to SDPA (``enable_gqa``); capture measures the same
    call (no packed-sequence mask), not copies repeated to every query head: halving the key/value heads takes the
    keys' and values' halved bytes off what a block saves."""
    def block_saved(kv_heads: int) -> int:
        spec = f"hf:llama:{DECODER},num_key_value_heads={kv_heads},max_position_embeddings=128"
        return next(layer for layer in capture_preset(spec, seq_len=T).layers if layer.kind == "block").saved_bytes_no_recompute

    head_dim, bf16 = H // HEADS, 2
    assert block_saved(HEADS) - block_saved(HEADS // 2) == 2 * (HEADS // 2) * head_dim * T * bf16  # keys and values


def test_captures_expert_stand_in_keeps_what_transformers_grouped_matmuls_keep() -> None:
    """Capture's expected-load experts (``planner.experts``) save what transformers' grouped-matmul path saves for the
    same routed tokens (the combine keeps its index alone: ``models.moe.sum_rows``)."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from tessera.planner.experts import expected_expert_load

    def saved(block: torch.nn.Module, x: torch.Tensor) -> int:
        weights, storages = {p.untyped_storage().data_ptr() for p in block.parameters()}, {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in weights:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            block(x)
        return sum(storages.values())

    config = Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F // 2,
                            norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    x = torch.randn(1, 64, H, dtype=torch.bfloat16, requires_grad=True)
    grouped = saved(block, x)
    with expected_expert_load(block, 1.0):  # 2 * 64 / 8 = 16 slots an expert: every routed token, as balanced
        stand_in = saved(block, x)
    routed_indices = 4 * 2 * 64 * 8  # a few int64 orderings of the 128 routed tokens, which the two keep differently
    assert abs(stand_in - grouped) <= routed_indices < 2 * 64 * H * 2  # not a routed copy of the activations


def _real_cpu_saved(model: object) -> dict[str, int]:
    """Per block, what a real bf16 forward on CPU of ``model``'s config saves (weights aside), with no mask passed."""
    import torch
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa").to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in real.parameters()}
    running, saved, seen = [None], {}, set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in params and key not in seen and running[0]:
            seen.add(key)
            saved[running[0]] = saved.get(running[0], 0) + tensor.untyped_storage().nbytes()
        return tensor

    for i, layer in enumerate(real.model.layers):
        layer.register_forward_pre_hook(lambda _m, _a, name=f"model.layers.{i}": running.__setitem__(0, name))
    real.model.norm.register_forward_pre_hook(lambda _m, _a: running.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        real(input_ids=torch.zeros(1, T, dtype=torch.long), use_cache=False)
    return saved


@pytest.mark.parametrize("spec", [
    SPECS["llama"],  # global attention: no mask on either side, grouped K/V
    f"hf:mistral:{DECODER},num_key_value_heads={KV},max_position_embeddings=128,sliding_window={T // 2}",  # a window
])
def test_a_captured_hf_block_saves_what_a_real_cpu_forward_saves(spec: str) -> None:
    """Capture on meta against a real bf16 forward on CPU: the same bytes a block, but for the 24-byte RNG state
    CUDA's flash kernel keeps (``planner.kernels``). A global layer gets no ``T x T`` mask and grouped keys and values
    on both sides; a sliding-window layer its window's mask and repeated keys and values on both (the window's mask is
    charged to the first block that uses it, on both sides)."""
    captured = {layer.fqn: layer.saved_bytes_no_recompute for layer in capture_preset(spec, seq_len=T).layers}
    saved = _real_cpu_saved(resolve_model(spec)[0])
    for name in ("model.layers.0", "model.layers.1", "model.layers.2"):
        assert captured[name] - saved[name] == 24
    import transformers.masking_utils as masking
    assert masking.find_packed_sequence_indices.__module__ == "transformers.masking_utils"  # put back


def test_an_encoder_decoder_with_a_shared_embedding_is_measured_per_call() -> None:
    """T5: one embedding module at three paths, called by the encoder and again by the decoder. Its backward ended
    when its weight's gradient was complete, after the encoder's, which was then counted to it as well (negative
    FLOPs elsewhere; planning failed)."""
    import torch
    import transformers
    from torch import nn

    from tessera.planner.capture import capture

    class CopyTask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False))

        def forward(self, ids: torch.Tensor) -> object:
            return self.t5(input_ids=ids, decoder_input_ids=torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], 1))

    layers = {layer.fqn: layer for layer in capture(CopyTask(), seq_len=16).layers}
    for side in ("encoder", "decoder"):
        embedding, block = layers[f"t5.{side}.embed_tokens"], layers[f"t5.{side}.block.0"]
        assert embedding.backward_flops == 0
        assert 2 * block.forward_flops <= block.backward_flops <= 2.2 * block.forward_flops
    assert layers["t5.lm_head"].backward_flops == 2 * layers["t5.lm_head"].forward_flops
