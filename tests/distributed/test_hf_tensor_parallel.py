"""Tensor (and sequence) parallelism on models Tessera did not write matches one process: Hugging Face families
of every projection structure (separate q/k/v: Llama; fused q|k|v and gate|up declared gathered: Phi-3; fused
q/k/v interleaved per head: GPT-NeoX; ``Conv1D`` with packed q|k|v and tied embeddings: GPT-2), FSDP2 (ZeRO-3) on
the fused ones, and on 4 ranks GPT-2's packed q|k|v split by tp and sharded again by FSDP2 on dp. Under ``-m slow``:
Qwen2, Mistral, Gemma (tied), Gemma 2 (post-norms), OPT (learned positions, tied), torchtitan's Llama 3 (its q/k/v
in a ``qkv_linear`` module; fused ``wqkv`` too) and Phi-3 with a user plan packing gate|up, DDP and ZeRO-3 on more
families, and dp2 x tp2 (ZeRO 0, 1 and 3, with and without sp) on 4 ranks. docs/parity-matrix.md lists every cell.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.errors import ConfigError
from tessera.planner.plan import Plan, PlannedLayer
from tessera.runtime.apply import apply_plan

from .harness import FP32_TOL, GLOBAL_BATCH, LR, PARAM_TOL, SEED, SEQ_LEN, dummy_estimate, full_tensors, run_named

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")]

STEPS, VOCAB = 3, 256
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None

# ------------------------------------------------------------------------------------------------ the models

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=SEQ_LEN, use_cache=False)
"""Shared fields of the Hugging Face configs below."""


def _hf(config_name: str, model_name: str, **fields) -> nn.Module:
    import transformers  # noqa: PLC0415

    torch.manual_seed(SEED)
    config = getattr(transformers, config_name)(**fields)
    return getattr(transformers, model_name)(config)


FAMILIES = {
    "llama": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **SMALL, num_key_value_heads=2),
    "phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", **SMALL, num_key_value_heads=2, pad_token_id=0,
                        original_max_position_embeddings=SEQ_LEN),
    "gpt_neox": lambda: _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **SMALL, rotary_pct=0.5),
    "gpt2": lambda: _hf("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                        n_positions=SEQ_LEN, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0),
    "qwen2": lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", **SMALL, num_key_value_heads=2),
    "mistral": lambda: _hf("MistralConfig", "MistralForCausalLM", **SMALL, num_key_value_heads=2),
    "gemma": lambda: _hf("GemmaConfig", "GemmaForCausalLM", **SMALL, num_key_value_heads=2, head_dim=8),
    "gemma2": lambda: _hf("Gemma2Config", "Gemma2ForCausalLM", **SMALL, num_key_value_heads=2, head_dim=8),
    "opt": lambda: _hf("OPTConfig", "OPTForCausalLM", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ_LEN, dropout=0.0,
                       attention_dropout=0.0, word_embed_proj_dim=32, use_cache=False, pad_token_id=1),
}


def torchtitan_llama3(fuse_qkv: bool = False) -> nn.Module:
    """torchtitan's Llama 3 (``Llama3Model``), debug-model structure at hidden 64: 2 layers, 4 heads, 2 key/value
    heads, vocabulary 256, plain SDPA attention (flex attention has no CPU backward)."""
    from torchtitan.models import llama3  # noqa: PLC0415
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: PLC0415
    from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: PLC0415

    dim, heads = 64, 4
    layers = llama3._build_llama3_layers(
        fuse_qkv=fuse_qkv, n_layers=2, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=128, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ_LEN, theta=500000, scaling="none"))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=llama3._output_linear_init(dim)))
    torch.manual_seed(SEED)
    model = config.build()
    model.init_weights() if hasattr(model, "init_weights") else None
    return model


FAMILIES["torchtitan"] = torchtitan_llama3
FAMILIES["torchtitan_fused"] = functools.partial(torchtitan_llama3, fuse_qkv=True)
FAMILIES["phi3_packed"] = FAMILIES["phi3"]  # Phi-3 under a user tp_plan that packs gate|up (TP_PLANS)
TP_PLANS = {"phi3_packed": {"model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
                            "model.layers.*.self_attn.o_proj": "rowwise_split_input",
                            "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}}
"""User tensor-parallel plans by family (the others use what the model declares or the module tree)."""


def planned(model: nn.Module) -> list[PlannedLayer]:
    """The layers capture would plan, in execution order: embeddings, the blocks (elements of a ModuleList or
    ModuleDict), then the other norms and the head (the model's last linear)."""
    blocks = [f"{name}.{key}" for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))
              for key in m._modules]
    inside = tuple(f"{fqn}." for fqn in blocks)
    leaves = [(name, m) for name, m in model.named_modules() if name and not name.startswith(inside)]
    embeddings = [name for name, m in leaves if isinstance(m, nn.Embedding)]
    norms = [name for name, m in leaves if type(m).__name__.lower().endswith("norm") and m.weight is not None]
    head = [name for name, m in leaves if isinstance(m, nn.Linear)][-1:]
    kinds = [*((f, "embedding") for f in embeddings), *((f, "block") for f in blocks), *((f, "norm") for f in norms),
             *((f, "head") for f in head)]
    return [*(PlannedLayer(fqn=fqn, kind=kind, recompute="none") for fqn, kind in kinds),
            PlannedLayer(fqn="loss", kind="loss", recompute="none")]


def plan_for(name: str, model: nn.Module, strategy: str) -> Plan:
    training = TrainingConfig(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32")
    return Plan(model_name=name, param_count=sum(p.numel() for p in model.parameters()), cluster="test",
                device_name="cpu", training=training, strategy=Strategy.parse(strategy), estimate=dummy_estimate(),
                layers=tuple(planned(model)))


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(VOCAB, (steps, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]


# ------------------------------------------------------------------------------------------------ the spawns

TP, TP_SP = "dp=1,tp=2,mbs=4", "dp=1,tp=2,sp=true,mbs=4"
DP, ZERO3 = "dp=2,zero=0,mbs=4", "dp=2,zero=3,mbs=4"
DP_TP, DP_TP_ZERO1, DP_TP_ZERO3 = "dp=2,tp=2,zero=0,mbs=4", "dp=2,tp=2,zero=1,mbs=4", "dp=2,tp=2,zero=3,mbs=4"
DP_TP_SP_ZERO3 = "dp=2,tp=2,sp=true,zero=3,mbs=2"
DEFAULT = {2: [(family, strategy) for family in ("llama", "phi3", "gpt_neox", "gpt2") for strategy in (TP, TP_SP)]
           + [("phi3", ZERO3), ("gpt_neox", ZERO3)],  # FSDP2 on fused projections (GPT-2: test_outside_models)
           4: [("gpt2", DP_TP_ZERO3)]}  # packed q|k|v (Conv1D) split by tp, then sharded again by FSDP2 on dp
SLOW = {2: [(family, strategy) for family in ("qwen2", "mistral", "gemma", "gemma2", "opt", "torchtitan",
                                              "torchtitan_fused", "phi3_packed") for strategy in (TP, TP_SP)]
        + [(family, DP) for family in ("phi3", "gpt_neox", "gpt2", "gemma")]
        + [(family, ZERO3) for family in ("llama", "gemma", "opt")],
        4: [(family, strategy) for family in ("llama", "phi3", "torchtitan", "torchtitan_fused")
            for strategy in (DP_TP, DP_TP_SP_ZERO3)]
        + [("gpt2", DP_TP), ("gpt2", DP_TP_ZERO1), ("gpt2", DP_TP_SP_ZERO3), ("phi3_packed", DP_TP_ZERO3),
           ("phi3_packed", DP_TP_ZERO1), ("gpt_neox", DP_TP_ZERO3), ("gemma", DP_TP_ZERO3),
           ("gpt2", "dp=1,tp=4,mbs=4"), ("gpt_neox", "dp=1,tp=4,sp=true,mbs=4")]}  # 4 heads: one per rank


def build(family: str, strategy: str):
    model = FAMILIES[family]()
    return apply_plan(model, plan_for(family, model, strategy), tp_plan=TP_PLANS.get(family))


def train_case(family: str, strategy: str) -> dict:
    parallel = build(family, strategy)
    losses = [parallel.train_step(batch) for batch in batches()]
    return {"losses": losses, "params": full_tensors(parallel.named_parameters())}


CHECKPOINT = ("gpt2", DP_TP_ZERO3)
"""Packed q|k|v under FSDP2 x TP: written gathered on tp (DCP takes one chunk per rank), resumed, read in one process."""
CHECKPOINT_FOLDER = tempfile.mkdtemp(prefix="tessera-packed-")  # the 4-rank spawn saves here; read in-process too
atexit.register(shutil.rmtree, CHECKPOINT_FOLDER, ignore_errors=True)


def checkpoint_case(folder: str) -> dict:
    """Train a step, save, train 2 more; a fresh model loading the save trains the same 2 more steps."""
    data = batches()
    parallel = build(*CHECKPOINT)
    parallel.train_step(data[0])
    parallel.save(folder).wait()
    saved = full_tensors(parallel.named_parameters())
    after = [parallel.train_step(batch) for batch in data[1:]]
    restored = build(*CHECKPOINT)
    restored.load(folder)
    return {"saved": saved, "after": after, "resumed": [restored.train_step(batch) for batch in data[1:]]}


def refused_targets() -> dict[str, str]:
    """Under tp=2, what ``train_step`` says of targets the vocabulary-parallel loss would drop silently: one equal to
    the vocabulary size, one negative (not -100). Both ranks refuse before any collective."""
    parallel, (inputs, targets) = build("llama", TP), batches(1)[0]
    said = {}
    for name, value in (("vocab", VOCAB), ("negative", -5)):
        bad = targets.clone()
        bad[0, 0] = value
        try:
            parallel.train_step((inputs, bad))
        except ConfigError as error:
            said[name] = str(error)
    return said


def refused_snapshots() -> str:
    """Under tp=2, what enabling in-memory snapshots says of GPT-2's packed q|k|v: before the first step."""
    from tessera.runtime.snapshots import SnapshotConfig  # noqa: PLC0415

    try:
        build("gpt2", TP).enable_snapshots(SnapshotConfig(every=1))
    except ConfigError as error:
        return str(error)
    return "not refused"


def run_cases(cases: list[tuple[str, str]], folder: str | None = None) -> dict:
    """Runs on every rank: every case (a failure ends the spawn, named), with its wall time; with ``folder``, the
    checkpoint case too; on 2 ranks, the targets refused."""
    runs = [(case, functools.partial(train_case, *case)) for case in cases]
    runs += [("checkpoint", functools.partial(checkpoint_case, folder))] if folder else []
    runs += [("targets", refused_targets), ("snapshots", refused_snapshots)] if dist.get_world_size() == 2 else []
    results, seconds = run_named(runs)
    return {**results, "seconds": seconds}


@functools.cache
def spawned(world: int, slow: bool) -> list[dict]:
    from tessera.runtime.launch import spawn  # noqa: PLC0415

    cases = SLOW[world] if slow else DEFAULT[world]
    if not HAS_TORCHTITAN:
        cases = [case for case in cases if not case[0].startswith("torchtitan")]
    folder = CHECKPOINT_FOLDER if world == 4 and not slow else None
    return spawn(run_cases, nprocs=world, args=(cases, folder), timeout_s=900)


@functools.cache
def single_process(family: str) -> dict:
    """Plain training on the whole global batch: cross-entropy on the logits, AdamW."""
    model = FAMILIES[family]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches():
        outputs = model(inputs)
        logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_tensors(model.named_parameters())}


def check_case(world: int, slow: bool, family: str, strategy: str) -> None:
    if family.startswith("torchtitan") and not HAS_TORCHTITAN:
        pytest.skip("torchtitan is not installed")
    per_rank = [results[(family, strategy)] for results in spawned(world, slow)]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), "ranks disagree on the loss"
    expected = single_process("phi3" if family == "phi3_packed" else family)
    torch.testing.assert_close(per_rank[0]["losses"], expected["losses"], **FP32_TOL)
    assert per_rank[0]["params"].keys() == expected["params"].keys()  # FQNs kept; every shard gathered
    torch.testing.assert_close(per_rank[0]["params"], expected["params"], **PARAM_TOL)


@pytest.mark.parametrize(("family", "strategy"), DEFAULT[2], ids=[f"{f}-{s}" for f, s in DEFAULT[2]])
def test_tensor_parallel_hugging_face_models_train_like_one_process(family, strategy):
    check_case(2, False, family, strategy)


@pytest.mark.parametrize(("family", "strategy"), DEFAULT[4], ids=[f"{f}-{s}" for f, s in DEFAULT[4]])
def test_packed_projections_train_under_fsdp_and_tensor_parallelism_like_one_process(family, strategy):
    check_case(4, False, family, strategy)


def test_a_packed_checkpoint_under_fsdp_and_tensor_parallelism_resumes_and_loads_into_one_process():
    result = spawned(4, False)[0]["checkpoint"]
    assert result["resumed"] == result["after"]
    model = FAMILIES[CHECKPOINT[0]]()
    one = apply_plan(model, plan_for(CHECKPOINT[0], model, "dp=1,mbs=4"))
    one.load(CHECKPOINT_FOLDER)  # the true q|k|v matrices, not a rank's interleaved slices
    torch.testing.assert_close(full_tensors(one.named_parameters()), result["saved"], rtol=0, atol=0)


def test_targets_the_vocabulary_parallel_loss_would_drop_are_refused_on_every_rank():
    """One process's cross-entropy raises on them; the vocabulary-parallel loss would ignore them (a batch of them
    alone reports a loss of 0), so ``train_step`` refuses them, naming the value."""
    said = [results["targets"] for results in spawned(2, False)]
    assert said[0] == said[1]
    assert said[0]["vocab"].startswith(f"target {VOCAB} is not below the model's {VOCAB} classes")
    assert said[0]["negative"].startswith("target -5 is negative")


def test_snapshots_of_packed_splits_are_refused_when_enabled():
    said = [results["snapshots"] for results in spawned(2, False)]
    assert said[0] == said[1]
    assert said[0].startswith("in-memory snapshots cannot hold packed tensor-parallel splits yet (transformer.h.0.")


def test_the_spawn_stays_fast():
    seconds = spawned(2, False)[0]["seconds"]
    print({" ".join(key): round(value, 1) for key, value in seconds.items()})
    assert sum(seconds.values()) < 90, seconds


@pytest.mark.slow
@pytest.mark.parametrize(("family", "strategy"), SLOW[2], ids=[f"{f}-{s}" for f, s in SLOW[2]])
def test_more_families_under_tensor_parallelism_train_like_one_process(family, strategy):
    check_case(2, True, family, strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "strategy"), SLOW[4], ids=[f"{f}-{s}" for f, s in SLOW[4]])
def test_data_and_tensor_parallel_on_four_ranks_train_like_one_process(family, strategy):
    check_case(4, True, family, strategy)


# ------------------------------------------------------------------------------- plans and refusals (no processes)


def test_a_user_tp_plan_overrides_the_declared_one_and_packs_gate_up():
    from tessera.runtime.tensor_parallel import layer_styles, resolve_tp_plan  # noqa: PLC0415
    from tessera.runtime.tp_styles import ColumnSplit  # noqa: PLC0415

    model = FAMILIES["phi3"]()
    user = TP_PLANS["phi3_packed"]
    block = PlannedLayer(fqn="model.layers.0", kind="block", recompute="none")
    styles = layer_styles(model, block, tp=2, sp=False, pairs=None, tp_plan=resolve_tp_plan(model, user))
    gate_up, qkv = styles["mlp.gate_up_proj"], styles["self_attn.qkv_proj"]
    assert isinstance(gate_up, ColumnSplit) and gate_up.parts == 2 and not gate_up.gather_output
    assert qkv.gather_output  # Phi-3 slices q, k, v at offsets of the whole model's head counts


def test_a_plan_style_the_runtime_does_not_apply_is_refused_in_one_line():
    from tessera.errors import NotModelledError  # noqa: PLC0415
    from tessera.runtime.tensor_parallel import check_tensor_parallel  # noqa: PLC0415

    model = FAMILIES["llama"]()
    with pytest.raises(NotModelledError, match=r"'model.layers.\*.mlp.up_proj': style 'local_colwise' is not "
                                               r"implemented .* pass tp_plan= with those styles") as raised:
        check_tensor_parallel(model, planned(model), tp=2, sp=False,
                              tp_plan={"model.layers.*.mlp.up_proj": "local_colwise"})
    assert "\n" not in str(raised.value)


def test_heads_read_from_the_shared_config_are_refused_when_split():
    from tessera.errors import NotModelledError  # noqa: PLC0415
    from tessera.runtime.tensor_parallel import check_tensor_parallel  # noqa: PLC0415

    model = FAMILIES["phi3"]()
    plain = {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
             "model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    with pytest.raises(NotModelledError, match=r"heads of model.layers.0.self_attn .*reads config.num_attention_heads"):
        check_tensor_parallel(model, planned(model), tp=2, sp=False, tp_plan=plain)
