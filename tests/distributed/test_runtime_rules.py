"""Single-process checks of the runtime's rules: how layers are split for tensor parallelism (and the clear
errors when they cannot be), what selective recomputation recomputes, and how the pipeline split cuts the
root's forward. No process group: these build styles, graphs and modules only.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.cost_models.layer_stats import LinearPair
from tessera.errors import ConfigError, NotModelledError
from tessera.models import build_model
from tessera.planner.plan import PlannedLayer
from tessera.runtime import pipeline
from tessera.runtime.recompute import apply_recompute
from tessera.runtime.tensor_parallel import check_sequence_parallel, find_linear_pairs, layer_styles

from .harness import GPT, LLAMA, make_batches, make_model, make_plan


def block(fqn: str = "blocks.0") -> PlannedLayer:
    return PlannedLayer(fqn=fqn, kind="block", recompute="none")


def test_linear_pairs_are_found_from_the_module_tree():
    gpt, llama = build_model(GPT, device="meta"), build_model(LLAMA, device="meta")
    assert find_linear_pairs(gpt.blocks[0]) == (
        LinearPair(column=("attn.q", "attn.k", "attn.v"), row="attn.o", role="attention"),
        LinearPair(column=("mlp.up",), row="mlp.down", role="mlp"),
    )
    assert find_linear_pairs(llama.blocks[0])[1] == LinearPair(column=("mlp.gate", "mlp.up"), row="mlp.down", role="mlp")


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o, self.head_dim = nn.Linear(64, 160), nn.Linear(64, 64), 16  # not 3 x 64: no packing fits


class ScaledBlock(nn.Module):
    """A block with a parameter outside any linear pair or norm: no known sharding."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)
        self.gain = nn.Parameter(torch.ones(128))


def test_fused_projection_is_refused_naming_the_layer():
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].attn = FusedAttention()
    with pytest.raises(NotModelledError, match=r"cannot split blocks\.0 .*attn\.qkv \(64->160\)"):
        layer_styles(model, block(), tp=2, sp=False, pairs=None)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention, cut down: keys and values come up from a 32-wide latent."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.wq, self.wkv_a, self.wkv_b, self.wo = nn.Linear(64, 96), nn.Linear(64, 40), nn.Linear(32, 128), nn.Linear(64, 64)


def test_a_latent_projection_is_refused_naming_the_linear_that_reads_the_latent():
    # It was refused as "a reordered projection?", naming no linear in particular.
    model = nn.Module()
    model.blocks = nn.ModuleList([LatentAttention()])
    with pytest.raises(NotModelledError, match=r"wkv_b reads 32 features, not the block's 64: it follows another "
                                               r"linear \(a low-rank or latent projection"):
        layer_styles(model, block(), tp=2, sp=False, pairs=None)


def test_unknown_parameter_in_a_block_is_refused_naming_it():
    model = nn.Module()
    model.blocks = nn.ModuleList([ScaledBlock()])
    with pytest.raises(NotModelledError, match=r"blocks\.0\.gain"):
        layer_styles(model, block(), tp=2, sp=False, pairs=None)


def test_other_layer_with_parameters_is_refused():
    model = build_model(GPT, device="meta")
    with pytest.raises(NotModelledError, match="layer ln_f .*no known tensor-parallel sharding"):
        layer_styles(model, PlannedLayer(fqn="ln_f", kind="other", recompute="none"), tp=2, sp=False, pairs=None)


def test_key_value_heads_must_divide_tp():
    model = build_model(LLAMA, device="meta")  # 4 query heads, 2 key/value heads
    layer_styles(model, block(), tp=2, sp=True, pairs=None)
    with pytest.raises(NotModelledError, match=r"blocks\.0\.attn\.k has 2 key/value heads .*not divisible by tp=4"):
        layer_styles(model, block(), tp=4, sp=False, pairs=None)


def test_pairs_given_by_the_plan_are_used_and_checked():
    model = build_model(GPT, device="meta")
    reordered = (LinearPair(column=("mlp.down",), row="mlp.up", role="mlp"),)
    with pytest.raises(NotModelledError, match="not column linears"):
        layer_styles(model, block(), tp=2, sp=False, pairs=reordered)


def test_sequence_parallel_needs_a_divisible_sequence():
    check_sequence_parallel(16, 4)
    with pytest.raises(ConfigError, match="seq_len=10 divisible by tp=4"):
        check_sequence_parallel(10, 4)


def test_megatron_only_cost_model_options_are_refused_by_the_runtime():
    from tessera.runtime.apply import check_supported

    plan = make_plan(GPT, make_model(GPT, device="meta"), "dp=1,tp=2,tp_overlap=true")
    with pytest.raises(NotModelledError, match="drop tp_overlap=true"):
        check_supported(plan)
    plan = make_plan(GPT, make_model(GPT, device="meta"), "dp=1,tp=2,sp=true,sp_regather=true")
    with pytest.raises(NotModelledError, match="drop sp_regather=true"):
        check_supported(plan)
    plan = make_plan(GPT, make_model(GPT, device="meta"), "dp=1,pp=2,pipeline_passes=2")
    with pytest.raises(NotModelledError, match="drop pipeline_passes"):
        check_supported(plan)
    plan = make_plan(GPT, make_model(GPT, device="meta"), "dp=1,recompute=selective,recompute_modules=mlp")
    with pytest.raises(NotModelledError, match="drop recompute_modules"):
        check_supported(plan)


def test_zero_bubble_with_recomputation_is_refused_by_name():
    from tessera.runtime.apply import check_supported

    plan = make_plan(GPT, make_model(GPT, device="meta"), "dp=1,pp=2,schedule=zero-bubble,recompute=full")
    with pytest.raises(NotModelledError, match="zero-bubble with activation recomputation"):
        check_supported(plan)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_ops(recompute: str) -> dict[str, int]:
    model = make_model(GPT)
    blocks = tuple(f"blocks.{i}" for i in range(4))
    apply_recompute(model, blocks if recompute == "full" else (), selective_fqns=blocks if recompute == "selective" else ())
    inputs, targets = make_batches(GPT)[0]
    with OpCounter() as counter:
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    return counter.counts


def test_selective_recompute_reruns_attention_but_not_the_linears():
    none, selective, full = count_ops("none"), count_ops("selective"), count_ops("full")
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert (none[attention], selective[attention], full[attention]) == (4, 8, 8)  # 4 blocks: + recomputation
    linears = none.get("addmm", 0) + none.get("mm", 0)
    assert selective.get("addmm", 0) + selective.get("mm", 0) == linears  # matmul outputs saved, not redone
    assert full.get("addmm", 0) + full.get("mm", 0) > linears


@pytest.mark.parametrize("spec", [GPT, LLAMA])
def test_pipeline_chunks_keep_fqns_share_modules_and_compose_to_the_model(spec):
    model = make_model(spec)
    plan = make_plan(spec, model, "dp=1,pp=2,schedule=interleaved:2")
    layer_chunks = {layer.fqn: layer.chunk for layer in plan.layers if layer.kind != "loss"}
    graph = pipeline.trace_layers(model, list(layer_chunks))
    chunks = [pipeline.build_chunk_module(model, graph, pipeline.node_chunks(graph, layer_chunks), c) for c in range(4)]
    assert chunks[1].get_submodule("blocks.1") is model.blocks[1]
    names = [name for chunk in chunks for name, _ in chunk.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()]
    inputs, _ = make_batches(spec)[0]
    values = (inputs,)
    for chunk in chunks:
        values = chunk(*values)
        values = values if isinstance(values, tuple) else (values,)
    torch.testing.assert_close(values[0], model(inputs), rtol=0, atol=0)
    if spec == LLAMA:  # the RoPE tables computed from root buffers travel with the hidden states
        assert len(chunks[0].graph.find_nodes(op="output")[0].args[0]) == 3
        assert "rope_cos" not in chunks[1].state_dict()


def test_chunks_against_the_data_flow_are_refused():
    model = make_model(GPT)
    layer_chunks = {"tok_emb": 1, "pos_emb": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "blocks.3": 1,
                    "ln_f": 1, "head": 1}
    graph = pipeline.trace_layers(model, list(layer_chunks))
    with pytest.raises(ConfigError, match="blocks.0 in pipeline chunk 0 but it reads a value computed in chunk 1"):
        pipeline.node_chunks(graph, layer_chunks)


def test_parameter_outside_every_planned_layer_is_refused():
    from tessera.runtime.tensor_parallel import check_tensor_parallel

    model = build_model(GPT, device="meta")
    model.scale = nn.Parameter(torch.ones(1, device="meta"))
    plan = make_plan(GPT, build_model(GPT, device="meta"), "dp=1,tp=2")
    check_tensor_parallel(build_model(GPT, device="meta"), plan.layers, tp=2, sp=True)
    with pytest.raises(NotModelledError, match="parameter scale belongs to no planned layer"):
        check_tensor_parallel(model, plan.layers, tp=2, sp=False)
