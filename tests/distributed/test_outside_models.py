"""Models Tessera did not write train with no adapter and match one process: Hugging Face causal LMs with the
default loss, outputs that are dicts, ``ModelOutput`` s and tuples under pipeline and tensor parallelism, and a
CNN whose BatchNorm normalises over the whole data-parallel batch.

Every case trains from the same seed with AdamW on the same global batches and is compared with plain
single-process training on the whole global batch (cross-entropy on ``.logits`` for the Hugging Face models,
written out here, not Tessera's loss): per-step losses, identical on every rank, and final parameters
(tolerances and why: ``harness.py``). All cases run in one spawn of 2 ranks (start-up dominates on 2 cores).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.errors import NotModelledError
from tessera.planner.plan import Plan, PlannedLayer
from tessera.runtime.apply import apply_plan
from tessera.runtime.data_parallel import CpuSyncBatchNorm

from .harness import (
    FP32_TOL, GLOBAL_BATCH, GPT, LR, PARAM_TOL, SEED, SEQ_LEN, dummy_estimate, full_tensors, make_batches,
    make_model, make_plan, reference, run_named,
)

pytestmark = pytest.mark.distributed

WORLD, STEPS = 2, 3
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")

# ------------------------------------------------------------------------------------------ Hugging Face models


def hf_llama() -> nn.Module:
    """transformers' LlamaForCausalLM, random init from the seed: 2 layers, hidden 32, vocabulary 256 (~50K)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=SEQ_LEN, use_cache=False))


def hf_gpt2() -> nn.Module:
    """transformers' GPT2LMHeadModel (``Conv1D``, tied embeddings): 2 layers, hidden 32, no dropout (~25K)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=SEQ_LEN,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      bos_token_id=0, eos_token_id=0))


HF_LAYERS = {  # what capture would name, by hand: embedding, the blocks (FSDP units), final norm, head
    "llama": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
    "gpt2": ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
             "lm_head"],
}
HF_MODELS = {"llama": hf_llama, "gpt2": hf_gpt2}


def listed_plan(name: str, model: nn.Module, strategy: str, fqns: list[str], *, global_batch: int) -> Plan:
    """A hand-built plan over ``fqns`` (``*.layers.N`` / ``*.h.N`` are blocks); no pipeline, no recomputation."""
    kinds = {"embed_tokens": "embedding", "wte": "embedding", "wpe": "embedding", "norm": "norm", "ln_f": "norm",
             "lm_head": "head"}
    layers = [PlannedLayer(fqn=fqn, kind=kinds.get(fqn.rsplit(".", 1)[-1], "block"), recompute="none") for fqn in fqns]
    training = TrainingConfig(global_batch=global_batch, seq_len=SEQ_LEN, precision="fp32")
    return Plan(model_name=name, param_count=sum(p.numel() for p in model.parameters()), cluster="test",
                device_name="cpu", training=training, strategy=Strategy.parse(strategy), estimate=dummy_estimate(),
                layers=(*layers, PlannedLayer(fqn="loss", kind="loss", recompute="none")))


def hf_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """The reference's loss, written out: plain cross-entropy on ``.logits``."""
    return F.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------------------- a CNN with BatchNorm

CLASSES, IMAGE = 10, 8


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        # no bias before BatchNorm (as in ResNet): its exact gradient is zero, the mean shift is normalised away,
        # and AdamW would turn the rounding noise of that zero into lr-sized steps of either sign
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return x + torch.relu(self.bn(self.conv(x)))


class TinyCNN(nn.Module):
    """Image classifier, ~1.4K parameters: conv stem, two residual conv-BatchNorm blocks, pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(8) for _ in range(2))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def make_cnn(seed: int = SEED) -> TinyCNN:
    torch.manual_seed(seed)
    return TinyCNN()


def image_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE, generator=generator) * 2 + 1,  # stats far from (0, 1)
             torch.randint(CLASSES, (GLOBAL_BATCH,), generator=generator)) for _ in range(steps)]


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name.removeprefix("module."): b.detach().clone() for name, b in module.named_buffers()}


# ----------------------------------------------------------------------------------- a forward of several inputs
class TokensAndFeatures(nn.Module):
    """Token ids and a per-sample feature vector (a conditioning signal), as positional or keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.side = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.side(features)[:, None, :]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_two_inputs(seed: int = SEED) -> TokensAndFeatures:
    torch.manual_seed(seed)
    return TokensAndFeatures()


def two_input_batches(steps: int = STEPS) -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [((torch.randint(32, (GLOBAL_BATCH, SEQ_LEN), generator=generator),
              torch.randn(GLOBAL_BATCH, 4, generator=generator)),
             torch.randint(32, (GLOBAL_BATCH, SEQ_LEN), generator=generator)) for _ in range(steps)]


TWO_INPUT_CASES = [("tuple", "dp=2,zero=0,mbs=2"), ("dict", "dp=2,zero=3,mbs=4")]


def two_input_case(form: str, strategy: str) -> dict:
    model = make_two_inputs(SEED + dist.get_rank())
    parallel = apply_plan(model, make_plan("two-inputs", model, strategy))
    batches = [((dict(zip(("ids", "features"), inputs)) if form == "dict" else inputs), targets)
               for inputs, targets in two_input_batches()]
    return train(parallel, batches)


# --------------------------------------------------------------------- a user's attention declaring no head size


class OwnAttention(nn.Module):
    """Attention as a user writes it: a head count, no ``head_dim``; the width per head read off the input."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, -1, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class OwnBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = OwnAttention(dim, heads=4)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class OwnLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(OwnBlock(dim) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_own(seed: int = SEED) -> OwnLM:
    torch.manual_seed(seed)
    return OwnLM()


def own_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(32, (steps, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(3))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]


OWN_CASES = ["dp=1,tp=2,sp=true,mbs=4"]  # each rank attends over the whole sequence, gathered before the q/k/v


def own_case(strategy: str) -> dict:
    model = make_own(SEED + dist.get_rank())
    return train(apply_plan(model, make_plan("own-lm", model, strategy)), own_batches())


# --------------------------------------------------------------------- ignored targets spread unevenly over rows
MASKED_CASES = ["dp=2,zero=0,mbs=2", "dp=1,pp=2,mbs=2,schedule=1f1b", "dp=1,tp=2,mbs=4", "dp=2,zero=3,mbs=4"]


def masked_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows 0-2 keep one target each (a prompt masked with -100, as fine-tuning does), the rest all of theirs: a
    mean of each rank's or micro-batch's mean is not the global batch's mean over its targets."""
    batches = []
    for inputs, targets in make_batches(GPT, steps):
        targets = targets.clone()
        targets[:3, 1:] = -100
        batches.append((inputs, targets))
    return batches


def masked_case(strategy: str) -> dict:
    model = make_model(GPT, SEED + dist.get_rank())
    return train(apply_plan(model, make_plan(GPT, model, strategy)), masked_batches())


# --------------------------------------------------------------------- outputs that are dicts, ModelOutputs, tuples


class DictOutput:
    """Mixed into Tessera's GPT: ``forward`` returns ``{"logits": ...}``."""

    def forward(self, input_ids):
        return {"logits": super().forward(input_ids)}


class TupleOutput:
    """Mixed into Tessera's GPT: ``forward`` returns ``(logits,)`` (Hugging Face's ``return_dict=False``)."""

    def forward(self, input_ids):
        return (super().forward(input_ids),)


class ModelOutputOutput:
    """Mixed into Tessera's GPT: ``forward`` returns a Hugging Face ``CausalLMOutput`` (a dict if not installed)."""

    def forward(self, input_ids):
        logits = super().forward(input_ids)
        if not HAS_TRANSFORMERS:
            return {"logits": logits}
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=logits)


WRAPPERS = {"dict": DictOutput, "tuple": TupleOutput, "model-output": ModelOutputOutput}


def wrapped_gpt(output: str, seed: int) -> nn.Module:
    """Tessera's GPT (so pp and tp apply) returning ``output`` instead of the logits tensor: the same function."""
    model = make_model(GPT, seed)
    mixin = WRAPPERS[output]
    model.__class__ = type(f"{mixin.__name__}GPT", (mixin, type(model)), {})
    return model


# ------------------------------------------------------------------------------------------------ the spawn

# (name, strategy): every case trains with the DEFAULT loss (no loss_fn).
HF_CASES = [("llama", "dp=2,zero=0,mbs=2"),  # DDP, 2 micro-batches per step
            ("gpt2", "dp=2,zero=3,mbs=4")]  # FSDP2 over the blocks; tied embedding and head
CNN_CASES = ["dp=2,zero=0,mbs=4", "dp=2,zero=3,mbs=4"]  # DDP; FSDP2 (BatchNorm parameters sharded)
OUTPUT_CASES = [("dict", "dp=1,pp=2,mbs=2,schedule=1f1b"),  # the last stage returns a dict
                ("tuple", "dp=1,pp=2,mbs=2,schedule=interleaved:2"),  # ... a 1-tuple (shape inference unpacks it)
                ("model-output", "dp=1,tp=2,mbs=4")]  # loss_parallel on the ModelOutput's logits


def train(parallel, batches) -> dict:
    losses = [parallel.train_step(batch) for batch in batches]
    return {"losses": losses, "params": full_tensors(parallel.named_parameters()),
            "buffers": {k: v for m in parallel.modules for k, v in buffers_of(m).items()}}


def hf_case(name: str, strategy: str) -> dict:
    model = HF_MODELS[name]()
    plan = listed_plan(f"hf-{name}", model, strategy, HF_LAYERS[name], global_batch=GLOBAL_BATCH)
    return train(apply_plan(model, plan), make_batches(GPT, STEPS))


def cnn_case(strategy: str) -> dict:
    model = make_cnn(SEED + dist.get_rank())  # rank 0's weights must win (broadcast)
    parallel = apply_plan(model, make_plan("tiny-cnn", model, strategy))
    synced = [fqn.removeprefix("module.") for fqn, module in parallel.module.named_modules()
              if isinstance(module, CpuSyncBatchNorm)]
    return {**train(parallel, image_batches()), "synced": synced}


def output_case(output: str, strategy: str) -> dict:
    model = wrapped_gpt(output, SEED + dist.get_rank())
    return train(apply_plan(model, make_plan(GPT, model, strategy)), make_batches(GPT, STEPS))


def unsynced_ddp_step() -> dict:
    """What Tessera's conversion prevents: torch's DDP around the CNN with plain BatchNorm, one step."""
    model = make_cnn()
    ddp = DistributedDataParallel(model)
    images, targets = image_batches(1)[0]
    rows = slice(dist.get_rank() * GLOBAL_BATCH // WORLD, (dist.get_rank() + 1) * GLOBAL_BATCH // WORLD)
    loss = F.cross_entropy(ddp(images[rows]), targets[rows])
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return {"loss": mean.item() / WORLD, "buffers": buffers_of(model)}


def run_all() -> dict:
    """Runs on every rank: every case (a failure ends the spawn, named), with its wall time."""
    cases = [*((("hf", *case), functools.partial(hf_case, *case)) for case in HF_CASES if HAS_TRANSFORMERS),
             *((("cnn", case), functools.partial(cnn_case, case)) for case in CNN_CASES),
             *((("output", *case), functools.partial(output_case, *case)) for case in OUTPUT_CASES),
             *((("two-inputs", *case), functools.partial(two_input_case, *case)) for case in TWO_INPUT_CASES),
             *((("masked", case), functools.partial(masked_case, case)) for case in MASKED_CASES),
             *((("own", case), functools.partial(own_case, case)) for case in OWN_CASES),
             (("unsynced",), unsynced_ddp_step)]
    results, seconds = run_named(cases)
    return {**results, "seconds": seconds}


@functools.cache
def outside_results() -> list[dict]:
    from tessera.runtime.launch import spawn  # noqa: PLC0415

    return spawn(run_all, nprocs=WORLD, timeout_s=300)


def case_result(key: tuple) -> dict:
    per_rank = [results[key] for results in outside_results()]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), "ranks disagree on the loss"
    params = {}
    for result in per_rank:  # pipeline ranks hold different layers
        params.update(result["params"])
    return {**per_rank[0], "params": params}


# ---------------------------------------------------------------------------------------- single-process truth


def single_process(model: nn.Module, batches, loss_fn, call=None) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches:
        loss = loss_fn(call(inputs) if call is not None else model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_tensors(model.named_parameters()), "buffers": buffers_of(model)}


@functools.cache
def cnn_reference(steps: int = STEPS) -> dict:
    return single_process(make_cnn(), image_batches(steps), F.cross_entropy)


# ---------------------------------------------------------------------------------------------------- tests


@needs_transformers
@pytest.mark.parametrize(("name", "strategy"), HF_CASES, ids=[f"{n}-{s}" for n, s in HF_CASES])
def test_hugging_face_models_train_with_the_default_loss_like_one_process(name, strategy):
    result = case_result(("hf", name, strategy))
    expected = single_process(HF_MODELS[name](), make_batches(GPT, STEPS), hf_loss)
    torch.testing.assert_close(result["losses"], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["params"], expected["params"], **PARAM_TOL)


@pytest.mark.parametrize("strategy", CNN_CASES)
def test_batch_norm_under_data_parallelism_trains_like_one_process(strategy):
    result = case_result(("cnn", strategy))
    expected = cnn_reference()
    torch.testing.assert_close(result["losses"], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["params"], expected["params"], **PARAM_TOL)
    # running averages of the whole batch's statistics, as one process keeps them (num_batches_tracked too)
    torch.testing.assert_close(result["buffers"], expected["buffers"], **FP32_TOL)
    assert result["synced"] == ["blocks.0.bn", "blocks.1.bn"]


def test_without_the_conversion_data_parallel_batch_norm_differs():
    per_rank = [results[("unsynced",)] for results in outside_results()]
    expected = cnn_reference(1)
    ranks_differ = not torch.allclose(per_rank[0]["buffers"]["blocks.0.bn.running_mean"],
                                      per_rank[1]["buffers"]["blocks.0.bn.running_mean"], **FP32_TOL)
    assert ranks_differ, "each rank's running mean should be its own rows' (per-rank statistics)"
    for result in per_rank:
        with pytest.raises(AssertionError):
            torch.testing.assert_close(result["buffers"], expected["buffers"], **FP32_TOL)
    with pytest.raises(AssertionError):  # the loss itself is another function of the batch
        torch.testing.assert_close(per_rank[0]["loss"], expected["losses"][0], **FP32_TOL)


@pytest.mark.parametrize(("output", "strategy"), OUTPUT_CASES, ids=[f"{o}-{s}" for o, s in OUTPUT_CASES])
def test_dict_tuple_and_model_outputs_under_pipeline_and_tensor_parallelism(output, strategy):
    result = case_result(("output", output, strategy))
    ref_losses, _, ref_params = reference(GPT, STEPS)
    torch.testing.assert_close(result["losses"], ref_losses, **FP32_TOL)
    torch.testing.assert_close(result["params"], ref_params, **PARAM_TOL)


@pytest.mark.parametrize(("form", "strategy"), TWO_INPUT_CASES, ids=[f"{f}-{s}" for f, s in TWO_INPUT_CASES])
def test_a_forward_of_several_inputs_trains_like_one_process(form, strategy):
    result = case_result(("two-inputs", form, strategy))
    model = make_two_inputs()
    expected = single_process(model, [(inputs, targets) for inputs, targets in two_input_batches()],
                              lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
                              call=lambda inputs: model(*inputs))
    torch.testing.assert_close(result["losses"], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["params"], expected["params"], **PARAM_TOL)


@pytest.mark.parametrize("strategy", MASKED_CASES)
def test_ignored_targets_spread_unevenly_give_the_global_batchs_mean(strategy):
    result = case_result(("masked", strategy))
    model = make_model(GPT)
    expected = single_process(model, masked_batches(), lambda logits, targets: F.cross_entropy(
        logits.flatten(0, 1), targets.flatten()))  # the mean over every counted target of the batch
    torch.testing.assert_close(result["losses"], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["params"], expected["params"], **PARAM_TOL)


@pytest.mark.parametrize("strategy", OWN_CASES)
def test_a_users_attention_without_a_head_size_trains_under_sequence_parallelism_like_one_process(strategy):
    result = case_result(("own", strategy))
    expected = single_process(make_own(), own_batches(), lambda logits, targets: F.cross_entropy(
        logits.flatten(0, 1), targets.flatten()))
    torch.testing.assert_close(result["losses"], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["params"], expected["params"], **PARAM_TOL)


def test_the_spawn_stays_fast():
    seconds = outside_results()[0]["seconds"]
    print({" ".join(key): round(value, 1) for key, value in seconds.items()})
    assert sum(seconds.values()) < 90, seconds


# ------------------------------------------------------------- BatchNorm where it cannot be exact (no processes)


@pytest.mark.parametrize(("strategy", "says"), [
    ("dp=1,tp=2,mbs=8", "blocks.0.bn (BatchNorm2d) normalises over the batch, but tensor or context parallelism"),
    ("dp=1,pp=2,mbs=8,schedule=gpipe", "blocks.0.bn (BatchNorm2d) normalises over the batch, but pipeline"),
    ("dp=2,mbs=2", "runs 2 micro-batches per step (global batch 8, dp=2, micro_batch=2), so a step would not "
                   "equal one step on the whole batch; plan with micro_batch=4"),
    ("dp=2,mbs=4,recompute=full", "blocks.0.bn (BatchNorm2d): recomputing blocks.0 (full) would run BatchNorm's"),
])
def test_batch_norm_refuses_what_it_cannot_run_exactly_naming_the_layer(strategy, says):
    model = make_cnn()
    with pytest.raises(NotModelledError) as raised:
        apply_plan(model, make_plan("tiny-cnn", model, strategy))  # refused before any process group is needed
    message = str(raised.value)
    assert says in message and "\n" not in message
    assert "GroupNorm" in message or "plan blocks.0 with recompute=none" in message  # the next step


def test_batch_norm_in_one_process_is_left_alone_and_exact():
    model = make_cnn()
    parallel = apply_plan(model, make_plan("tiny-cnn", model, f"dp=1,mbs={GLOBAL_BATCH}"))
    assert isinstance(model.blocks[0].bn, nn.BatchNorm2d)
    result = train(parallel, image_batches())
    expected = cnn_reference()
    torch.testing.assert_close(result["losses"], expected["losses"], **FP32_TOL)
    torch.testing.assert_close(result["buffers"], expected["buffers"], **FP32_TOL)
