"""Front ends (fx, export, make_fx), their fallbacks, leaf modules, example inputs and tracing errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.errors import CaptureError
from tessera.models import build_model
from tessera.planner.capture import capture


class ShapeGate(nn.Module):
    """Python control flow on a size: torch.fx cannot follow it, torch.export (real shapes) can."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) % 2 == 0:
            return x + self.down(torch.relu(self.up(x)))
        return x


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(ShapeGate() for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def toy_graph():  # noqa: ANN201
    return capture(Toy(), seq_len=8)


def test_falls_back_to_export_and_says_why(toy_graph) -> None:  # noqa: ANN001
    assert toy_graph.front_end == "torch.export"
    (reason,) = toy_graph.fallback_reasons
    assert reason.startswith("torch.fx.symbolic_trace cannot trace blocks.0 (ShapeGate)")
    assert "if x.size(1) % 2 == 0" in reason
    assert [layer.fqn for layer in toy_graph.layers] == ["emb", "blocks.0", "blocks.1", "blocks.2", "head", "loss"]
    assert [(p.column, p.row, p.role) for p in toy_graph.blocks[0].tp_pairs] == [(("up",), "down", "mlp")]


def test_front_ends_agree(toy_graph) -> None:  # noqa: ANN001
    leaf = capture(Toy(), seq_len=8, leaf_modules=(ShapeGate,))
    assert leaf.front_end == "torch.fx.symbolic_trace" and leaf.fallback_reasons == ()
    assert leaf.layers[:1] == toy_graph.layers[:1] and leaf.edges == toy_graph.edges
    assert leaf.blocks[0].tp_pairs == ()  # a leaf is one node in the graph: its linears are not seen
    by_name = capture(Toy(), seq_len=8, leaf_modules=("blocks.0", "blocks.1", "blocks.2"))
    assert by_name.front_end == "torch.fx.symbolic_trace"
    made = capture(Toy(), seq_len=8, front_ends=("make_fx",))
    assert made.front_end == "make_fx" and made.layers == toy_graph.layers and made.edges == toy_graph.edges


def test_every_front_end_gives_the_same_graph_for_llama() -> None:
    model = build_model("llama-tiny", device="meta")
    graphs = [capture(model, seq_len=16, front_ends=(name,)) for name in ("fx", "export", "make_fx")]
    assert [g.front_end for g in graphs] == ["torch.fx.symbolic_trace", "torch.export", "make_fx"]
    assert graphs[0].layers == graphs[1].layers == graphs[2].layers
    assert graphs[0].edges == graphs[1].edges == graphs[2].edges


def test_a_real_model_is_traced_through_a_meta_twin() -> None:
    model = Toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = capture(model, seq_len=8, front_ends=("export",))
    assert graph.front_end == "torch.export"
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unknown_front_end_is_named() -> None:
    with pytest.raises(CaptureError, match="unknown front end"):
        capture(Toy(), seq_len=8, front_ends=("jit",))


class TinyCNN(nn.Module):
    """Image classifier: input (B, 3, H, W), not token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stages = nn.Sequential(*(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(3)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(images))).flatten(1))  # (B, 10)


def test_example_inputs_for_a_model_that_does_not_take_token_ids() -> None:
    images = torch.randn(2, 3, 16, 16)  # real values are never read: they become meta tensors
    graph = capture(TinyCNN(), seq_len=1, example_inputs=(images,), name="cnn", dtype=torch.float32)
    assert [(layer.fqn, layer.kind) for layer in graph.layers] == [
        ("stem", "other"),
        ("stages.0", "block"),
        ("stages.1", "block"),
        ("stages.2", "block"),
        ("pool", "other"),
        ("fc", "head"),
        ("loss", "loss"),
    ]
    conv_flops = 2 * 2 * 16 * 16 * 8 * 8 * 9  # batch x pixels x out x in x 3x3, 2 FLOPs per multiply-add
    assert graph.layer("stages.1").forward_flops == conv_flops
    assert graph.layer("stem").saved_bytes_full_recompute == images.numel() * 4
    assert graph.layer("fc").vocab_size == 10 and graph.seq_scaling == ()
    keyword = capture(TinyCNN(), seq_len=1, example_inputs={"images": images}, dtype=torch.float32)
    assert keyword.layers == graph.layers


def test_data_dependent_model_names_module_op_and_remedies() -> None:
    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.gate = Gate()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gate(self.emb(ids))

    with pytest.raises(CaptureError) as info:
        capture(Model(), seq_len=4)
    message = str(info.value)
    assert message.count("gate (Gate)") == 3  # each front end names the module
    assert "x.sum() > 0" in message and "torch.where" in message and "leaf_modules" in message


def test_meta_autocast_shim_is_restored_after_overlapping_captures_in_threads() -> None:
    # Two captures overlap: the first to leave must not restore torch's autocast while the second still needs the shim,
    # and the last to leave must restore it (a save/restore pair per capture left the shim installed for good).
    import threading

    from tessera.planner.front_ends import meta_autocast_off

    original, original_enter, original_exit = torch.autocast.__init__, torch.autocast.__enter__, torch.autocast.__exit__
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with meta_autocast_off():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with meta_autocast_off():
            second_in.set()
            first_out.wait(5)
            with torch.autocast("meta", dtype=torch.bfloat16):  # still shimmed after the first left
                seen.append(True)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [True]
    assert torch.autocast.__init__ is original
    assert torch.autocast.__enter__ is original_enter and torch.autocast.__exit__ is original_exit


class _MaskedAttentionModel(nn.Module):
    """An attention that, like torchtitan's flex backend, asserts it was handed a BlockMask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, attention_masks=None) -> torch.Tensor:
        assert attention_masks is not None, f"attention_masks must be instance of BlockMask, got {type(attention_masks)}"
        return self.head(self.emb(ids))


def test_an_attention_asking_for_a_block_mask_says_how_to_plan_it():
    # The generic advice (a meta kernel; make the code traceable, mark a leaf...) did not say what was missing. This
    # model fails when measured; torchtitan's flex Llama 3 fails in the trace (its RoPE stops torch.fx), same advice.
    with pytest.raises(CaptureError, match=r"Next step: this attention needs a mask object the training loop builds "
                                           r"\(torchtitan's flex and varlen backends"):
        capture(_MaskedAttentionModel(), seq_len=8)


def test_a_meta_autocast_region_is_traced_as_nothing_and_the_model_keeps_its_training_mode() -> None:
    # torchtitan's MoE router autocasts on meta and counts its tokens in a no_grad region when training: torch.export
    # made a higher-order op of each, recompiling the graph every time (Qwen3-30B-A3B's plan: 45 s -> 19 s here).
    from tessera.planner.front_ends import EXPORT, meta_autocast_off, trace_model

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.register_buffer("counts", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type=x.device.type, dtype=torch.float32):
                scores = self.gate(x)
            if self.training:
                with torch.no_grad():
                    self.counts.add_(scores.sum(dim=(0, 1)))
            return x + scores.sum(-1, keepdim=True)

    model = nn.Sequential(Router(), Router()).to("meta").train()
    with meta_autocast_off():
        traced = trace_model(model, (torch.empty(1, 4, 8, device="meta"),), {}, front_ends=("export",), leaf_modules=())
    assert traced.front_end == EXPORT
    assert not any("autocast" in str(node.target) or "set_grad" in str(node.target) for node in traced.graph.nodes)
    assert all(module.training for module in model.modules())
