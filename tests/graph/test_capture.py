"""Capture on meta: measured statistics against analytic counts, graph structure, limits on time and memory."""

from __future__ import annotations

import resource
import time

import networkx as nx
import pytest
import torch
from torch import nn

from tessera.errors import CaptureError, ModelSpecError
from tessera.models import build_model
from tessera.planner import capture as capture_module
from tessera.planner.capture import capture, capture_preset, find_layers, measure_layers, trace_layers
from tessera.planner.layer_graph import LayerGraph

# A GPT whose sizes differ from each other, so a wrong factor in a formula cannot cancel out.
H, T, HEADS, V = 96, 48, 4, 128
GPT_SPEC = f"gpt:layers=3,hidden={H},heads={HEADS},vocab={V},seq={T}"


@pytest.fixture(scope="module")
def gpt_graph() -> LayerGraph:
    return capture(build_model(GPT_SPEC), seq_len=T)  # real CPU weights: capture must not use them


@pytest.fixture(scope="module")
def llama_graph() -> LayerGraph:
    return capture_preset("llama-tiny", seq_len=64)


def test_layers_in_model_order_with_kinds(gpt_graph: LayerGraph, llama_graph: LayerGraph) -> None:
    assert [(layer.fqn, layer.kind) for layer in gpt_graph.layers] == [
        ("tok_emb", "embedding"),
        ("pos_emb", "embedding"),
        ("blocks.0", "block"),
        ("blocks.1", "block"),
        ("blocks.2", "block"),
        ("ln_f", "norm"),
        ("head", "head"),
        ("loss", "loss"),
    ]
    assert [layer.kind for layer in llama_graph.layers] == ["embedding", "block", "block", "norm", "head", "loss"]
    assert (gpt_graph.model_name, gpt_graph.seq_len, gpt_graph.dtype) == (GPT_SPEC, T, "bf16")
    assert gpt_graph.front_end == "torch.fx.symbolic_trace" and gpt_graph.fallback_reasons == ()


@pytest.mark.parametrize("spec", [GPT_SPEC, f"{GPT_SPEC},tie=true", "llama-tiny", "llama-tiny:tie=true"])
def test_param_count_matches_the_model(spec: str) -> None:
    model = build_model(spec, device="meta")
    graph = capture(model, seq_len=16)
    assert graph.param_count == sum(p.numel() for p in model.parameters())  # a tied weight once
    if "tie=true" in spec:  # counted at its first owner, the embedding
        assert graph.layer("head").param_count == 0
        assert graph.layer("tok_emb").param_count == model.tok_emb.weight.numel()


def test_gpt_block_forward_flops_match_analytic_count(gpt_graph: LayerGraph) -> None:
    # q, k, v, o (4 h^2) and the 4h MLP (8 h^2): 2 FLOPs per multiply-add per token.
    linear = 2 * T * 12 * H * H
    # Q K^T and P V: each 2 * T^2 * h (full T x T: the causal mask does not halve the kernel's count).
    attention = 2 * 2 * T * T * H
    # Exact: FlopCounterMode counts only matmul-like ops (2 m n k), which is what the formula counts;
    # elementwise work (GELU, LayerNorm, bias adds, softmax) is counted as zero by both.
    for block in gpt_graph.blocks:
        assert block.forward_flops == pytest.approx(linear + attention, rel=1e-12)
    assert gpt_graph.layer("head").forward_flops == 2 * T * H * V


def test_backward_is_about_twice_forward(gpt_graph: LayerGraph) -> None:
    linear, attention = 2 * T * 12 * H * H, 2 * 2 * T * T * H
    block = gpt_graph.blocks[0]
    # Linear layers: grad wrt input and wrt weight, 2x forward each. Flash attention's backward recomputes
    # the scores, 2.5x its forward. At T/h = 0.5 the blocks are linear-dominated, so the ratio is near 2.
    assert block.backward_flops == pytest.approx(2 * linear + 2.5 * attention, rel=1e-12)
    assert 2.0 <= block.backward_flops / block.forward_flops <= 2.2
    assert gpt_graph.layer("head").backward_flops == 2 * gpt_graph.layer("head").forward_flops
    assert gpt_graph.forward_flops == sum(layer.forward_flops for layer in gpt_graph.layers)


def test_byte_counts_of_simple_layers(gpt_graph: LayerGraph) -> None:
    bf16 = 2
    head, ln_f, loss = gpt_graph.layer("head"), gpt_graph.layer("ln_f"), gpt_graph.layer("loss")
    # The head saves only its input; its (V, H) weight is a parameter, not an activation.
    assert head.saved_bytes_no_recompute == T * H * bf16
    assert head.saved_bytes_full_recompute == T * H * bf16
    assert head.output_bytes == T * V * bf16
    # LayerNorm saves its input and fp32 mean and rstd per token.
    assert ln_f.saved_bytes_no_recompute == T * H * bf16 + 2 * T * 4
    # Cross-entropy over fp32 logits saves the (T, V) fp32 log-softmax (the int64 targets were saved by tok_emb).
    assert loss.saved_bytes_no_recompute == T * V * 4 + 4
    assert gpt_graph.layer("tok_emb").saved_bytes_no_recompute == T * 8


def test_attention_is_measured_as_flash_linear_in_seq_len() -> None:
    """No (T, T) score matrix is saved, so a block's saved bytes double when T doubles."""
    short, long = (capture_preset("llama-tiny", seq_len=seq).blocks[0] for seq in (32, 64))
    # Up to the flash kernel's RNG seed and offset (24 bytes per block), which do not grow with T.
    assert abs(long.saved_bytes_no_recompute - 2 * short.saved_bytes_no_recompute) <= 24
    assert long.saved_bytes_full_recompute == 2 * short.saved_bytes_full_recompute


def test_fp32_capture_doubles_activation_bytes(gpt_graph: LayerGraph) -> None:
    fp32 = capture(build_model(GPT_SPEC, device="meta"), seq_len=T, dtype=torch.float32)
    assert fp32.dtype == "fp32"
    assert fp32.blocks[0].output_bytes == 2 * gpt_graph.blocks[0].output_bytes
    assert fp32.blocks[0].forward_flops == gpt_graph.blocks[0].forward_flops


def test_repeated_blocks_share_a_signature(gpt_graph: LayerGraph, llama_graph: LayerGraph) -> None:
    for graph in (gpt_graph, llama_graph):
        groups = graph.unique_signatures()
        block_names = [layer.fqn for layer in graph.blocks]
        assert block_names in groups.values()
        assert len(groups) == len(graph.layers) - len(block_names) + 1
    assert gpt_graph.blocks[0].signature != llama_graph.blocks[0].signature


def test_replayed_blocks_measure_like_every_block_run() -> None:
    """Blocks 2.. are replayed from block 0; the numbers must equal running all of them."""
    for spec in ("gpt-tiny:layers=5", "llama-tiny:layers=5"):
        model = build_model(spec, device="meta")
        order = trace_layers(model, find_layers(model)).order
        fast = measure_layers(model, order, seq_len=32, dtype=torch.bfloat16)
        full = measure_layers(model, order, seq_len=32, dtype=torch.bfloat16, reuse_repeated=False)
        assert fast == full


def test_edges_follow_the_data_flow(gpt_graph: LayerGraph, llama_graph: LayerGraph) -> None:
    assert set(gpt_graph.edges) == {
        ("tok_emb", "blocks.0"),
        ("pos_emb", "blocks.0"),  # through the position add in the root's forward
        ("blocks.0", "blocks.1"),
        ("blocks.1", "blocks.2"),
        ("blocks.2", "ln_f"),
        ("ln_f", "head"),
        ("head", "loss"),
    }
    # Llama's RoPE tables are buffers: they add no edge from tok_emb to every block.
    names = [layer.fqn for layer in llama_graph.layers]
    assert list(llama_graph.edges) == list(zip(names, names[1:]))


def test_networkx_view_and_json_round_trip(gpt_graph: LayerGraph) -> None:
    graph = gpt_graph.to_networkx()
    assert list(nx.topological_sort(graph))[-1] == "loss"
    assert graph.nodes["blocks.1"]["stats"] == gpt_graph.layer("blocks.1")
    assert set(graph.edges) == set(gpt_graph.edges)
    again = LayerGraph.model_validate_json(gpt_graph.model_dump_json())
    assert again == gpt_graph
    assert again.backward_flops == gpt_graph.backward_flops


def test_capture_leaves_a_real_model_untouched() -> None:
    model = build_model("gpt-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    capture(model, seq_len=16)
    assert not model.training
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all("forward" not in vars(m) for m in model.modules())


def test_capture_leaves_a_block_registered_twice_on_its_device() -> None:
    """One block object at two places of a ModuleList (ALBERT-style sharing across depth), beside a weight tied
    between two modules: every path keeps the user's real tensors after capture."""

    class SharedDepth(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            shared = nn.Sequential(nn.Linear(16, 16), nn.GELU())
            self.blocks = nn.ModuleList([shared, nn.Sequential(nn.Linear(16, 16)), shared])
            self.head = nn.Linear(16, 32, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(tokens)
            for block in self.blocks:
                hidden = block(hidden)
            return self.head(hidden)

    model = SharedDepth()
    before = {name: tensor.clone() for name, tensor in model.state_dict(keep_vars=False).items()}
    capture(model, seq_len=8)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert not any(tensor.is_meta for tensor in after.values())
    assert all(torch.equal(before[name], tensor) for name, tensor in after.items())
    assert model.head.weight is model.embed.weight and model.blocks[0] is model.blocks[2]


class _Stack(nn.Module):
    """Embedding, two MLP blocks, a dropout of p=0 (it returns its input itself) and a head; ``returns`` picks the
    output: the logits, ``(logits, hidden)`` or a dict of both ("keyword": the logits, the dropout called with
    ``input=``)."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.returns = returns
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2))
        self.dropout = nn.Dropout(0.0)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> object:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        dropped = self.dropout(input=hidden) if self.returns == "keyword" else self.dropout(hidden)
        logits = self.head(dropped)
        return {"tuple": (logits, hidden), "dict": {"logits": logits, "hidden": hidden}}.get(self.returns, logits)


def test_outputs_beside_the_logits_and_an_identity_module_keep_each_layers_backward() -> None:
    """The counter scopes a module's backward between its output's gradient and its input's: more outputs than the
    logits, or a module returning its input itself, once moved backward FLOPs between layers (negative ones)."""
    plain = {layer.fqn: (layer.forward_flops, layer.backward_flops) for layer in capture(_Stack("logits"), seq_len=8).layers}
    assert plain["dropout"] == (0, 0) and plain["head"][1] == 2 * plain["head"][0] > 0
    for returns in ("tuple", "dict", "keyword"):
        layers = capture(_Stack(returns), seq_len=8).layers
        assert {layer.fqn: (layer.forward_flops, layer.backward_flops) for layer in layers} == plain


def test_capture_leaves_a_real_moe_model_untouched() -> None:
    model = build_model("moe-tiny")
    model(torch.zeros(1, 8, dtype=torch.long))
    aux = model.blocks[0].moe.aux_loss
    capture(model, seq_len=16, expert_capacity_factor=1.5)
    assert model.blocks[0].moe.aux_loss is aux and model.blocks[0].moe.capacity_factor == 1.0
    assert all("forward" not in vars(m) for m in model.modules())


def test_llama3_70b_on_meta_is_fast_and_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture_module, "_CAPTURED", {})  # measure a capture, not the memo of an earlier test's
    start = time.perf_counter()
    graph = capture_preset("llama3-70b", seq_len=8192)
    elapsed = time.perf_counter() - start
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    assert peak_rss_bytes < 2 * 2**30
    assert graph.param_count == pytest.approx(70.6e9, rel=0.01)
    assert len(graph.blocks) == 80 and len(graph.unique_signatures()) == 5
    assert elapsed < 20  # ~1 s on 2 cores; generous for loaded CI machines


def test_looked_through_wrapper_and_plain_container() -> None:
    """Hugging Face style: the blocks live in model.layers; lm_head sits beside the wrapper."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(16, 32)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.model(ids))

    graph = capture(Outer(), seq_len=8, name="toy")
    assert [(layer.fqn, layer.kind) for layer in graph.layers] == [
        ("model.embed", "embedding"),
        ("model.layers.0", "block"),
        ("model.layers.1", "block"),
        ("lm_head", "head"),
        ("loss", "loss"),
    ]
    assert graph.model_name == "toy"


def test_layer_facts_heads_experts_vocab_hidden(gpt_graph: LayerGraph, llama_graph: LayerGraph) -> None:
    block = gpt_graph.blocks[0]
    assert (block.hidden_size, block.attention_heads, block.kv_heads, block.experts) == (H, HEADS, HEADS, 0)
    assert (gpt_graph.layer("tok_emb").vocab_size, gpt_graph.layer("head").vocab_size) == (V, V)
    assert gpt_graph.layer("pos_emb").vocab_size == 0  # a position table is not a vocabulary
    assert gpt_graph.layer("head").hidden_size == V  # the width of the head's output: the logits
    assert gpt_graph.layer("ln_f").hidden_size == H and gpt_graph.layer("loss").hidden_size == 0
    llama_block = llama_graph.blocks[0]
    assert (llama_block.attention_heads, llama_block.kv_heads) == (4, 2)  # grouped-query attention
    moe = capture_preset("moe-tiny", seq_len=32)
    assert [b.experts for b in moe.blocks] == [4, 4] and moe.blocks[0].kv_heads == 2


def test_tensor_parallel_pairs_from_the_data_flow(gpt_graph: LayerGraph, llama_graph: LayerGraph) -> None:
    def pairs(layer):  # noqa: ANN001, ANN202
        return [(p.role, p.column, p.row) for p in layer.tp_pairs]

    assert pairs(gpt_graph.blocks[0]) == [
        ("attention", ("attn.q", "attn.k", "attn.v"), "attn.o"),
        ("mlp", ("mlp.up",), "mlp.down"),
    ]
    assert pairs(llama_graph.blocks[1])[1] == ("mlp", ("mlp.gate", "mlp.up"), "mlp.down")
    moe = capture_preset("moe-tiny:shared=32", seq_len=16).blocks[0]
    assert pairs(moe)[0] == ("attention", ("attn.q", "attn.k", "attn.v"), "attn.o")
    experts = [p for p in pairs(moe) if p[0] == "expert"]
    assert experts[2] == ("expert", ("moe.experts.2.gate", "moe.experts.2.up"), "moe.experts.2.down")
    assert len(experts) == 4 and ("mlp", ("moe.shared.gate", "moe.shared.up"), "moe.shared.down") in pairs(moe)
    # The router feeds the experts only through its top-k indices: no pair. Layers outside blocks have none.
    assert not any("router" in p[1] for p in pairs(moe))
    assert gpt_graph.layer("head").tp_pairs == ()


def test_selective_recompute_drops_what_only_attention_saves(gpt_graph: LayerGraph) -> None:
    block = gpt_graph.blocks[0]
    # Flash attention saves q, k, v, its output, fp32 logsumexp (heads x T) and its RNG seed/offset (24 bytes).
    # Recomputing it keeps q, k, v (the checkpoint holds them) and the output (the o projection saves a view of
    # it), so only the logsumexp and RNG state go.
    assert block.saved_bytes_no_recompute - block.saved_bytes_selective == HEADS * T * 4 + 24
    assert block.saved_bytes_full_recompute == T * H * 2  # the block input only
    assert block.selective_recompute_flops == 2 * 2 * T * T * H  # the attention core's forward FLOPs
    assert gpt_graph.layer("head").saved_bytes_selective is None  # no attention core: not measured


def test_op_level_selective_recompute_counts_every_second_matmul(llama_graph: LayerGraph) -> None:
    """torchtitan's op-level policy re-runs every second ``aten.mm`` of a block in the order they run: in a Llama
    block q, k, v, o, gate, up, down, so k, o and up (``cost_models.profiles``); at every captured length."""
    hidden, kv, ffn = 64, 32, 192  # llama-tiny: 4 heads of 16, 2 key/value heads
    for graph in (llama_graph, capture_preset("llama-tiny:layers=4", seq_len=128, fit_seq_scaling=True)):
        expected = 2 * graph.seq_len * (hidden * kv + hidden * hidden + hidden * ffn)
        assert {block.op_selective_recompute_flops for block in graph.blocks} == {expected}
    assert graph.at_seq_len(64).blocks[3].op_selective_recompute_flops == 2 * 64 * (hidden * kv + hidden * hidden + hidden * ffn)
    assert llama_graph.layer("head").op_selective_recompute_flops == 0  # one matmul: the first is kept
    # What the policy keeps (bf16): the block input, the outputs of q, v, gate and down, and the attention core's
    # output, fp32 logsumexp per head and RNG seed/offset (24 bytes).
    t, heads = llama_graph.seq_len, 4
    kept = t * 2 * (hidden + (hidden + kv + ffn + hidden) + hidden) + t * heads * 4 + 24
    assert llama_graph.blocks[0].saved_bytes_op_selective == kept < llama_graph.blocks[0].saved_bytes_selective
    moe = capture_preset("moe-tiny", seq_len=32).blocks[0]  # replayed experts: their matmuls are not seen one by one
    assert (moe.op_selective_recompute_flops, moe.saved_bytes_op_selective) == (0, None)


@pytest.mark.parametrize("spec", [
    GPT_SPEC, "llama-tiny",  # biased linears (aten.addmm) and plain ones (aten.mm)
    "moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32,experts=2,top_k=1",  # experts not replayed
])
def test_blocks_measure_the_activations_their_linears_read(spec: str) -> None:
    """What an FP8 recipe casts: each distinct input of a block's linears, counted here on a real CPU forward by
    hooks on the ``nn.Linear`` modules (q, k and v read one tensor; each expert its own slice of the dispatched
    tokens); at every captured length."""
    model = build_model(spec)
    read: dict[tuple, int] = {}
    calls: list[int] = []

    def record(_module: nn.Module, args: tuple) -> None:
        read.setdefault((args[0].data_ptr(), tuple(args[0].shape)), args[0].numel())  # where the view starts
        calls.append(args[0].numel())

    hooks = [m.register_forward_pre_hook(record) for m in model.blocks[1].modules() if isinstance(m, nn.Linear)]
    seq_len = model.config.seq_len
    model(torch.zeros(1, seq_len, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    expected = 2 * sum(read.values())  # bf16, as captured
    graph = capture(build_model(spec, device="meta"), seq_len=seq_len, fit_seq_scaling=True)
    assert {block.linear_input_bytes for block in graph.blocks} == {expected}
    assert graph.at_seq_len(2 * seq_len).blocks[1].linear_input_bytes == 2 * expected
    assert {block.linear_call_input_bytes for block in graph.blocks} == {2 * sum(calls)}  # every call's input
    assert graph.layer("head").linear_input_bytes is not None  # measured, though the cost model casts blocks only
    moe = capture_preset("moe-tiny", seq_len=32).blocks[0]  # replayed experts: their matmuls are not seen one by one
    assert moe.linear_input_bytes is None


def test_a_block_multiplying_two_activations_reports_no_linear_inputs() -> None:
    """Attention written out by hand (``softmax(q @ k^T) @ v``) multiplies activations, which no FP8 recipe casts
    as a linear's input: the block's linears do not account for its FLOPs, so nothing is reported (the cost model
    falls back to its share), at every length."""

    class HandAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(H, H) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.q(x), self.k(x), self.v(x)
            return x + torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.blocks, self.head = nn.Embedding(V, H), nn.ModuleList([HandAttention()]), nn.Linear(H, V)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks[0](self.emb(ids)))

    graph = capture(Tiny(), seq_len=T, fit_seq_scaling=True)
    assert graph.layer("blocks.0").linear_input_bytes is None
    assert graph.at_seq_len(4 * T).layer("blocks.0").linear_input_bytes is None
    assert graph.layer("head").linear_input_bytes == T * H * 2  # a plain linear: its input


def test_moe_experts_are_measured_at_their_expected_load() -> None:
    """Each expert runs ceil(top_k * tokens / experts * factor) tokens; the factor is settable at capture."""
    hidden, ffn, experts, top_k, seq = 64, 128, 4, 2, 32

    def expert_flops(graph: LayerGraph) -> float:
        return graph.blocks[0].forward_flops - graph.layer("blocks.0").selective_recompute_flops

    balanced = capture_preset("moe-tiny", seq_len=seq)
    skewed = capture_preset("moe-tiny", seq_len=seq, expert_capacity_factor=1.5)
    per_token = 2 * 3 * hidden * ffn  # gate, up, down
    attention_linear = 2 * seq * (2 * hidden * hidden + 2 * hidden * 32)  # q, o: 64x64; k, v: 64x32 (GQA)
    router = 2 * seq * hidden * experts
    expected = top_k * seq  # tokens over all experts at factor 1.0
    assert expert_flops(balanced) == attention_linear + router + expected * per_token
    assert expert_flops(skewed) - expert_flops(balanced) == 0.5 * expected * per_token


def test_moe_layers_report_per_expert_parameters_flops_and_load() -> None:
    """What expert parallelism needs: routed-expert parameters and FLOPs apart from the dense ones, top_k, the
    load factor measured at; per expert: parameters, FLOPs per routed token, expected tokens."""
    from tessera.planner.experts import expert_summary

    hidden, ffn, experts, top_k, seq = 64, 128, 4, 2, 32
    graph = capture_preset("moe-tiny:shared=32", seq_len=seq, expert_capacity_factor=1.5, fit_seq_scaling=True)
    block = graph.blocks[0]
    per_expert = 3 * hidden * ffn  # gate, up, down (no biases)
    assert (block.experts, block.top_k, block.expert_capacity_factor) == (experts, top_k, 1.5)
    assert block.expert_param_count == experts * per_expert < block.param_count  # router, shared, attention are dense
    slots = top_k * seq * 1.5  # token slots over all experts at factor 1.5
    assert block.expert_forward_flops == slots * 2 * per_expert
    assert block.expert_backward_flops == 2 * block.expert_forward_flops  # input and weight gradients
    [summary] = expert_summary(graph.layers, seq_len=seq)
    assert (summary.layers, summary.params_per_expert, summary.flops_per_token) == (2, per_expert, 2 * per_expert)
    assert summary.expected_tokens_per_expert == top_k * seq / experts * 1.5
    assert graph.layer("tok_emb").expert_param_count == 0 and graph.layer("tok_emb").top_k == 0
    # The fields rescale with the sequence like every other measured number.
    assert graph.at_seq_len(2 * seq).blocks[0].expert_forward_flops == 2 * block.expert_forward_flops


def test_a_rope_preset_extends_its_tables_to_a_longer_sequence() -> None:
    """A built-in RoPE model computes its position tables (no parameters): a longer sequence needs no override."""
    graph = capture_preset("llama-tiny", seq_len=128)  # the preset covers 64 positions
    assert graph.seq_len == 128 and graph.param_count == capture_preset("llama-tiny", seq_len=64).param_count
    with pytest.raises(ModelSpecError, match="covers 64 positions"):
        capture_preset("gpt-tiny", seq_len=128)  # learned positions: the table is a parameter


def test_untraceable_model_raises_capture_error_naming_the_module() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                return self.proj(x)
            return x

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.gates = nn.ModuleList([Gate()])
            self.head = nn.Linear(8, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.gates[0](self.emb(ids)))

    with pytest.raises(CaptureError) as info:
        capture(Toy(), seq_len=4)
    message = str(info.value)
    assert "gates.0 (Gate)" in message
    assert "if x.sum() > 0" in message
    # Every front end was tried and says why it failed; the next steps name the remedies.
    for front_end in ("torch.fx.symbolic_trace cannot", "torch.export cannot", "make_fx cannot"):
        assert front_end in message
    assert "Next step" in message and "leaf_modules" in message and "example_inputs" in message


def test_capture_preset_rejects_unknown_model() -> None:
    with pytest.raises(ModelSpecError, match="llama3-70b"):
        capture_preset("llama3-70x", seq_len=128)


@pytest.mark.parametrize("spec", ["gpt-tiny:layers=5,tie=true", "moe-tiny:layers=7,dense_layers=2,dense_ffn=96"])
def test_a_deep_builtin_model_captures_as_its_whole_self(spec: str) -> None:
    # capture_preset measures dense_layers + 3 blocks and repeats the last; the graph equals a capture of every block.
    short = capture_preset(spec, seq_len=32, fit_seq_scaling=True)
    whole = capture(build_model(spec, device="meta"), seq_len=32, name=spec, fit_seq_scaling=True)
    assert short == whole and len(short.blocks) == int(spec.split("layers=")[1].split(",")[0])


def test_deepseek_v3_captures_in_seconds_with_dense_and_moe_groups() -> None:
    start = time.perf_counter()
    graph = capture_preset("deepseek-v3", seq_len=4096)
    seconds = time.perf_counter() - start
    kinds = [block.block_kind for block in graph.blocks]
    assert kinds == ["attention"] * 3 + ["moe"] * 58
    assert len({block.signature for block in graph.blocks[4:]}) == 1 and graph.blocks[0].signature != graph.blocks[4].signature
    assert graph.param_count == pytest.approx(672.1e9, rel=0.001)
    assert seconds < 60, f"{seconds:.1f} s"  # ~4 s on an idle core (a whole capture of 63,000 modules took ~40 s)


def test_blocks_record_their_widest_and_largest_matrix():
    # what an FP8 cast of a matmul operand allocates scales with (cost_models.memory.fp8_cast_elements)
    graph = capture_preset("gpt-tiny", seq_len=32)
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    assert {(layer.widest_matrix_dim, layer.largest_matrix_params) for layer in blocks} == {(256, 64 * 256)}
    assert all(layer.widest_matrix_dim == 0 for layer in graph.layers if layer.kind != "block")
    # routed experts (inner width 128) see only their tokens: the widest dense matrix is attention's 64
    moe = [layer for layer in capture_preset("moe-tiny", seq_len=32).layers if layer.kind == "block"]
    assert {(layer.widest_matrix_dim, layer.largest_matrix_params) for layer in moe} == {(64, 128 * 64)}


def test_a_process_keeps_its_captures_of_built_in_and_hugging_face_specs_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(capture_module, "_CAPTURED", {})
    first = capture_preset("llama-tiny:layers=2", seq_len=32)
    assert capture_preset("llama-tiny:layers=2", seq_len=32) is first  # the same text: the same capture
    assert capture_preset("llama-tiny:layers=2", seq_len=64) is not first  # any argument changes it
    # a tensor-parallel plan's entries in another order are another plan (its first matching glob wins)
    plan = {"blocks.*.mlp.*": "colwise", "blocks.*.mlp.down": "rowwise"}
    ordered = capture_preset("llama-tiny:layers=2", seq_len=32, tp_plan=plan)
    assert capture_preset("llama-tiny:layers=2", seq_len=32, tp_plan=dict(reversed(plan.items()))) is not ordered
    # a factory in a file the process may edit is captured afresh
    factory = tmp_path / "model.py"
    factory.write_text("from tessera.models import build_model\n\n"
                       "def make():\n    return build_model('llama-tiny:layers=2', device='meta')\n")
    spec = f"{factory}:make"
    assert capture_preset(spec, seq_len=32) is not capture_preset(spec, seq_len=32)


def test_a_block_applied_twice_in_a_row_is_charged_both_backwards() -> None:
    """``block(block(x))``: one tensor is the first call's output and the second's input, where the counter's scope
    hooks could fire in the wrong order and charge the first call's backward to the layer before (the embedding)."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(x)

    class Repeated(nn.Module):
        def __init__(self, calls: int) -> None:
            super().__init__()
            self.calls = calls
            self.embed = nn.Embedding(32, 16)
            self.blocks = nn.ModuleList(Residual() for _ in range(2))
            self.head = nn.Linear(16, 32)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(tokens)
            for block in self.blocks:
                for _ in range(self.calls):
                    hidden = block(hidden)
            return self.head(hidden)

    once, twice = ({layer.fqn: (layer.forward_flops, layer.backward_flops) for layer in capture(Repeated(calls),
                                                                                                   seq_len=8).layers}
                   for calls in (1, 2))
    assert twice["embed"] == once["embed"] == (0, 0)
    for fqn in ("blocks.0", "blocks.1"):
        assert twice[fqn] == (2 * once[fqn][0], 2 * once[fqn][1]) and once[fqn][1] == 2 * once[fqn][0] > 0
