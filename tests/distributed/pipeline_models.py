"""Models Tessera did not write, for the pipeline tests: tiny random-init Hugging Face causal LMs and
torchtitan's Llama 3, their planned layers, hand-built pipeline plans and the single-process reference.

Every model has 4 blocks (so pp=2 can interleave 2 chunks per rank), hidden 32, vocabulary 256, fp32, no
dropout, ``use_cache=False`` where the config has it; torchtitan's attention is its plain SDPA backend (flex
attention has no CPU backward). Plans put the embeddings in the first chunk, the blocks evenly over the
chunks, the final norm and the head in the last.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.planner.plan import Plan, PlannedLayer

from .harness import LR, SEED, dummy_estimate, full_tensors

VOCAB, HIDDEN, BLOCKS, BATCH, SEQ = 256, 32, 4, 8, 16
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


def _hf(config_name: str, model_name: str, **fields):
    import transformers

    config = getattr(transformers, config_name)(vocab_size=VOCAB, use_cache=False, **fields)
    return getattr(transformers, model_name)(config)


DECODER = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=BLOCKS, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=SEQ)
BUILDERS = {
    "hf-llama": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **DECODER),  # separate q/k/v, RoPE, GQA
    "hf-qwen2": lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", **DECODER),  # q/k/v with biases
    "hf-phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, eos_token_id=0, bos_token_id=0,
                           **DECODER),  # fused qkv_proj and gate_up_proj
    "hf-gemma": lambda: _hf("GemmaConfig", "GemmaForCausalLM", head_dim=8, **DECODER),  # tied embeddings
    # sliding-window and global layers; its rotary_emb (a planned layer) is called with the layer type, a string
    "hf-gemma3": lambda: _hf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=8, **DECODER),
    # no SDPA in transformers (eager attention): attention and final logit softcapping, sliding and global layers
    "hf-gemma2": lambda: _hf("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8, **DECODER),
    "hf-gpt2": lambda: _hf("GPT2Config", "GPT2LMHeadModel", n_embd=HIDDEN, n_layer=BLOCKS, n_head=2, n_positions=SEQ,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0),  # Conv1D, learned positions, tied embeddings
    # encoder-decoder: the decoder's embeddings sit between the encoder's blocks and the decoder's
    "hf-bart": lambda: _hf("BartConfig", "BartForConditionalGeneration", d_model=HIDDEN, encoder_layers=BLOCKS // 2,
                           decoder_layers=BLOCKS // 2, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0),
}
PLANNED_BY_TESSERA = {"hf-bart"}
"""Models whose pipeline plan is Tessera's own (``tessera.plan`` with the strategy pinned), not hand-built."""
DECODER_LAYERS = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(BLOCKS)), "model.norm", "lm_head"]
LAYERS = {
    "hf-llama": DECODER_LAYERS, "hf-qwen2": DECODER_LAYERS, "hf-phi3": DECODER_LAYERS, "hf-gemma": DECODER_LAYERS,
    "hf-gemma2": DECODER_LAYERS,
    "hf-gpt2": ["transformer.wte", "transformer.wpe", *(f"transformer.h.{i}" for i in range(BLOCKS)),
                "transformer.ln_f", "lm_head"],
    "tt-llama3": ["tok_embeddings", *(f"layers.{i}" for i in range(BLOCKS)), "norm", "lm_head"],
    "hf-gemma3": ["model.embed_tokens", "model.rotary_emb", *DECODER_LAYERS[1:]],
    "hf-bart": None,  # PLANNED_BY_TESSERA
}
KINDS = {"embed_tokens": "embedding", "wte": "embedding", "wpe": "embedding", "tok_embeddings": "embedding",
         "rotary_emb": "other", "norm": "norm", "ln_f": "norm", "lm_head": "head"}


def torchtitan_llama3() -> nn.Module:
    """torchtitan's ``Llama3Model`` built from its own config classes, plain SDPA attention (~60K parameters)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # torchtitan's language models allow only masked attention backends (flex, varlen: no CPU backward); its
    # layer builder takes a backend name, so the plain SDPA backend is handed in for the build only
    original = llama3.get_attention_config
    llama3.get_attention_config = lambda _backend: ScaledDotProductAttention.Config()
    try:
        layers = llama3._build_llama3_layers(
            fuse_qkv=False, n_layers=BLOCKS, dim=HIDDEN, n_heads=4, n_kv_heads=2, hidden_dim=64, attn_backend="sdpa",
            rope=ComplexRoPE.Config(dim=HIDDEN // 4, max_seq_len=SEQ, theta=10000.0, scaling="none"))
    finally:
        llama3.get_attention_config = original
    config = llama3.Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB, layers=layers, norm=RMSNorm.Config(normalized_shape=HIDDEN),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB))
    return config.build()


BUILDERS["tt-llama3"] = torchtitan_llama3


def make_outside(name: str, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]()


def requirement(name: str) -> str | None:
    """Why ``name`` cannot be built here (a package is missing), else ``None``."""
    if name.startswith("hf-") and not HAS_TRANSFORMERS:
        return "transformers is not installed"
    if name.startswith("tt-") and not HAS_TORCHTITAN:
        return "torchtitan is not installed"
    return None


def outside_plan(name: str, model: nn.Module, strategy: str) -> Plan:
    """Embeddings in chunk 0, the blocks evenly over ``pp * V`` chunks, final norm and head in the last; or, for
    ``PLANNED_BY_TESSERA``, the planner's own layers and chunks."""
    if name in PLANNED_BY_TESSERA:
        import tessera

        return tessera.plan(model, f"cpu:ranks={Strategy.parse(strategy).world_size}", global_batch=BATCH,
                            seq_len=SEQ, strategy=strategy, precision="fp32")
    parsed = Strategy.parse(strategy)
    chunks = parsed.pp * parsed.virtual_stages
    layers, block = [], 0
    for fqn in LAYERS[name]:
        kind = KINDS.get(fqn.rsplit(".", 1)[-1], "block")
        if kind == "block":
            chunk, block = block * chunks // BLOCKS, block + 1
        else:
            chunk = 0 if kind in ("embedding", "other") else chunks - 1
        layers.append(PlannedLayer(fqn=fqn, kind=kind, recompute=parsed.recompute if kind == "block" else "none",
                                   chunk=chunk))
    layers.append(PlannedLayer(fqn="loss", kind="loss", recompute="none", chunk=chunks - 1))
    return Plan(model_name=name, param_count=sum(p.numel() for p in model.parameters()), cluster="test",
                device_name="cpu", training=TrainingConfig(global_batch=BATCH, seq_len=SEQ, precision="fp32"),
                strategy=parsed, estimate=dummy_estimate(), layers=tuple(layers))


def outside_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(VOCAB, (steps, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]


def logits(outputs) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs


@functools.cache
def outside_reference(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training: cross-entropy on the logits, written out (not Tessera's loss)."""
    model = make_outside(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in outside_batches(steps):
        loss = F.cross_entropy(logits(model(inputs)).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, full_tensors(model.named_parameters())
