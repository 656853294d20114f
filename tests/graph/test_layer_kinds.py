"""Block kinds (``LayerStats.block_kind``) from module structure and declared config fields, and signatures that
tell unlike blocks apart while identical ones share one: tiny random-init Hugging Face configs on meta (no
downloads) and Tessera's own models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.planner.block_kinds import attention_window, encoder_blocks
from tessera.planner.capture import capture, capture_preset

transformers = pytest.importorskip("transformers")

T = 16
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256,
         "max_position_embeddings": 64, "use_cache": False}


def hf_capture(config_class: type, **fields: object):  # noqa: ANN205
    """Capture a transformers causal LM built on meta from ``config_class(**SMALL, **fields)``."""
    config = config_class(**{**SMALL, **fields})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return capture(model, seq_len=T)


def kinds(graph) -> list[str]:  # noqa: ANN001
    return [block.block_kind for block in graph.blocks]


def test_deepseek_v3_dense_first_layers_and_moe_layers() -> None:
    graph = hf_capture(transformers.DeepseekV3Config, num_hidden_layers=3, first_k_dense_replace=1,
                       num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16)
    assert kinds(graph) == ["attention", "moe", "moe"]
    dense, moe_1, moe_2 = graph.blocks
    assert (dense.experts, moe_1.experts) == (0, 4)
    assert dense.signature != moe_1.signature  # planned as two groups, each with its own costs
    assert moe_1.signature == moe_2.signature  # identical MoE layers still share one record
    assert all(layer.block_kind == "" for layer in graph.layers if layer.kind != "block")


def test_gemma3_alternating_local_and_global_attention() -> None:
    # Gemma 3's pattern (5 sliding-window layers per global one) declared by config.layer_types.
    layer_types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    graph = hf_capture(transformers.Gemma3TextConfig, num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                       sliding_window=T // 2, layer_types=layer_types)
    assert kinds(graph) == ["local-attention"] * 2 + ["attention"] + ["local-attention"] * 2 + ["attention"]
    assert [block.attention_window for block in graph.blocks] == [T // 2] * 2 + [0] + [T // 2] * 2 + [0]
    blocks = graph.blocks
    assert blocks[1].signature == blocks[3].signature == blocks[4].signature  # alike local blocks: one record
    assert blocks[1].signature != blocks[2].signature  # same shapes and numbers, other kind: never merged
    assert blocks[2].forward_flops == blocks[5].forward_flops
    # Each first user holds its kind's rotary tables, and no full causal mask, which a GPU run of unpacked rows does
    # not build (planner.kernels); every sliding layer keeps its window as SDPA's bf16 bias, made anew each call, and
    # its keys and values repeated to every query head (transformers does under a mask), as a GPU run does
    local_extra, global_extra = (blocks[0].saved_bytes_no_recompute - blocks[1].saved_bytes_no_recompute,
                                 blocks[2].saved_bytes_no_recompute - blocks[5].saved_bytes_no_recompute)
    assert local_extra == global_extra
    heads, kv_heads, head_dim, bf16 = 4, 2, 16, 2
    repeated = 2 * (heads - kv_heads) * head_dim * T * bf16  # keys and values
    assert blocks[1].saved_bytes_no_recompute - blocks[5].saved_bytes_no_recompute == bf16 * T * T + repeated


def test_qwen2_window_covering_the_sequence_is_global() -> None:
    fields = {"num_hidden_layers": 2, "num_key_value_heads": 2, "use_sliding_window": True, "max_window_layers": 1}
    assert kinds(hf_capture(transformers.Qwen2Config, sliding_window=T // 2, **fields)) == ["attention", "local-attention"]
    assert kinds(hf_capture(transformers.Qwen2Config, sliding_window=T, **fields)) == ["attention", "attention"]


def test_jamba_hybrid_of_state_space_and_attention_blocks() -> None:
    graph = hf_capture(transformers.JambaConfig, num_hidden_layers=6, num_key_value_heads=2, attn_layer_period=2,
                       attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, num_experts=4,
                       num_experts_per_tok=2, mamba_d_state=4, mamba_dt_rank=8)
    assert kinds(graph) == ["ssm-moe", "attention"] * 3
    mamba_moe, attention = graph.blocks[0], graph.blocks[1]
    assert mamba_moe.experts == 4 and mamba_moe.attention_heads == 0 and attention.attention_heads == 4
    assert graph.blocks[2].signature == graph.blocks[4].signature != graph.blocks[3].signature
    # the first block holds the inputs every block receives (mask, positions): a checkpoint keeps them once
    assert mamba_moe.saved_bytes_full_recompute > graph.blocks[2].saved_bytes_full_recompute
    assert mamba_moe.forward_flops == graph.blocks[2].forward_flops


def test_tessera_models_are_global_attention_and_moe() -> None:
    gpt = capture_preset("gpt-tiny:layers=4", seq_len=T)
    assert kinds(gpt) == ["attention"] * 4
    assert len({block.signature for block in gpt.blocks[1:]}) == 1
    assert kinds(capture_preset("moe-tiny:layers=3", seq_len=T)) == ["moe"] * 3


class _Block(nn.Module):
    """Pre-norm attention + MLP block (bidirectional in the encoder, causal in the decoder)."""

    def __init__(self, width: int, *, causal: bool) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, S, 3, 4, C // 4).permute(2, 0, 3, 1, 4)  # (B, 4, S, C/4) each
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, 4, S, C/4)
        x = x + self.out(y.transpose(1, 2).reshape(B, S, C))  # (B, S, C)
        return x + self.mlp(x)  # (B, S, C)


class _VisionLanguage(nn.Module):
    """An encoder stack over patch features in front of a decoder stack over tokens (LLaVA's layout, in small)."""

    def __init__(self, width: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.patches = nn.Linear(12, width)
        self.encoder = nn.ModuleList(_Block(width, causal=False) for _ in range(2))
        self.tok_emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width, causal=True) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        image = self.patches(pixels)  # (B, P, C)
        for layer in self.encoder:
            image = layer(image)
        x = torch.cat([image, self.tok_emb(input_ids)], dim=1)  # (B, P + T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, P + T, V)


def test_an_encoder_stack_in_front_of_the_language_model() -> None:
    with torch.device("meta"):
        model = _VisionLanguage()
    inputs = (torch.zeros(1, 4, 12, device="meta"), torch.zeros(1, T, dtype=torch.int64, device="meta"))
    graph = capture(model, seq_len=T, example_inputs=inputs)
    assert {b.fqn: b.block_kind for b in graph.blocks} == {
        "encoder.0": "encoder", "encoder.1": "encoder", "blocks.0": "attention", "blocks.1": "attention"}
    assert graph.layer("encoder.1").signature != graph.layer("blocks.1").signature


def test_rules_read_structure_and_declarations() -> None:
    assert encoder_blocks(["vision.layers.0", "vision.layers.1", "lm.layers.0"]) == {"vision.layers.0", "vision.layers.1"}
    assert encoder_blocks(["a.0", "b.0", "a.1"]) == set()  # interleaved containers: one stack, no encoder
    attention = nn.Linear(4, 4)
    attention.sliding_window = 512  # a module's own declaration (torchtitan's GPT-OSS, Tessera's style)
    assert attention_window(attention, None, 0) == 512
    attention.sliding_window = None  # declared global
    assert attention_window(attention, type("C", (), {"sliding_window": 64})(), 0) is None
    declared = type("C", (), {"layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": 256})()
    assert [attention_window(nn.Linear(4, 4), declared, i) for i in (0, 1)] == [256, None]


def gemma3(implementation: str, *, seq_len: int = T, fit_seq_scaling: bool = False):  # noqa: ANN201
    """A 4-block Gemma 3 (local, global, local, global; window T / 4) built for ``implementation``, captured."""
    config = transformers.Gemma3TextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                           sliding_window=T // 4, layer_types=["sliding_attention", "full_attention"] * 2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config._attn_implementation = implementation  # the kernel training will run (may not exist on meta)
    return model, capture(model, seq_len=seq_len, fit_seq_scaling=fit_seq_scaling)


def test_a_windowed_kernel_prices_local_blocks_at_their_windows_share_and_global_ones_as_measured() -> None:
    _, dense = gemma3("sdpa")  # SDPA applies the window as a dense mask: every pair is computed
    model, windowed = gemma3("flex_attention")
    assert (dense.windowed_attention, windowed.windowed_attention) == (False, True)
    assert model.config._attn_implementation == "flex_attention"  # measured as SDPA, then restored
    share = (T * (T // 4) - (T // 4) ** 2 / 2) / (T**2 / 2)
    for measured, priced in zip(dense.blocks, windowed.blocks):
        if priced.block_kind == "local-attention":
            assert priced.selective_recompute_flops == pytest.approx(measured.selective_recompute_flops * share)
            assert priced.forward_flops < measured.forward_flops and priced.signature != measured.signature
        else:
            assert priced == measured
    assert windowed.blocks[0].saved_bytes_no_recompute == dense.blocks[0].saved_bytes_no_recompute


def test_windowed_blocks_rescale_from_dense_polynomials_to_what_a_capture_at_that_length_gives() -> None:
    _, fitted = gemma3("flash_attention_2", fit_seq_scaling=True)
    _, direct = gemma3("flash_attention_2", seq_len=2 * T)
    assert fitted.at_seq_len(2 * T).layers == direct.layers  # window share 0.23 at 2T, 0.44 at T: not a polynomial


def test_an_hf_spec_declares_the_training_kernel_and_a_bad_one_is_refused() -> None:
    from tessera.errors import ModelSpecError  # noqa: PLC0415

    spec = ("hf:gemma3_text:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
            "num_key_value_heads=2,head_dim=16,vocab_size=256,sliding_window=4")
    assert not capture_preset(spec, seq_len=T).windowed_attention  # sdpa unless declared
    assert capture_preset(f"{spec},attn_implementation=flex_attention", seq_len=T).windowed_attention
    with pytest.raises(ModelSpecError, match="attn_implementation='flash' is not one of sdpa"):
        capture_preset(f"{spec},attn_implementation=flash", seq_len=T)


GEMMA2 = ("hf:gemma2:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
          f"num_key_value_heads=2,head_dim=16,vocab_size=256,sliding_window={T // 4}")


def test_gemma2_which_has_no_sdpa_is_built_eager_and_says_what_that_costs(caplog) -> None:
    # transformers refuses attn_implementation="sdpa" for Gemma-2 (_supports_sdpa = False: no logit softcapping)
    from tessera.planner.model_source import resolve_model  # noqa: PLC0415

    model, _ = resolve_model(GEMMA2)
    assert model.config._attn_implementation == "eager"
    assert "Gemma2ForCausalLM has no SDPA attention" in caplog.text
    assert "attn_implementation=flash_attention_2" in caplog.text
    graph = capture(model, seq_len=T)
    assert kinds(graph) == ["local-attention", "attention"] and not graph.windowed_attention


def test_gemma2_declaring_a_windowed_kernel_is_measured_as_sdpa_ignoring_its_softcap() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

    graph = capture_preset(f"{GEMMA2},attn_implementation=flash_attention_2", seq_len=T)  # was: SDPA refused softcap
    local, full = graph.blocks
    assert graph.windowed_attention and local.block_kind == "local-attention"
    assert 0 < local.selective_recompute_flops < full.selective_recompute_flops  # the fused core, at its window
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # the measurement's override is gone


def test_a_kernel_the_model_class_does_not_support_is_refused_naming_those_it_does() -> None:
    from tessera.errors import ModelSpecError  # noqa: PLC0415

    with pytest.raises(ModelSpecError, match="Gemma2ForCausalLM does not support attn_implementation='sdpa'.*"
                       "declare one of eager, flash_attention_2, flash_attention_3, flex_attention"):
        capture_preset(f"{GEMMA2},attn_implementation=sdpa", seq_len=T)


def test_attention_support_is_read_from_the_flags_of_old_and_new_transformers() -> None:
    from tessera.planner.model_source import _supported_attention

    class Before454:  # transformers 4.40 - 4.53 name the flash kernels' flags by version
        _supports_sdpa, _supports_flash_attn_2 = True, True

    class Since454:
        _supports_sdpa, _supports_flash_attn, _supports_flex_attn = True, True, True

    assert set(_supported_attention(Before454)) == {"eager", "sdpa", "flash_attention_2"}
    assert set(_supported_attention(Since454)) == {"eager", "sdpa", "flash_attention_2", "flash_attention_3",
                                                   "flex_attention"}
