"""Pipeline parallelism on models Tessera did not write (issue 18): user models whose forward has optional
arguments (they keep their defaults in the chunks) or ties the embedding to the head (the copies' gradients
are summed over the stages holding them, Megatron-LM's embedding all-reduce, also under tensor parallelism);
Hugging Face Llama, Qwen2, Phi-3, Gemma, Gemma 2 (eager attention), Gemma 3 and GPT-2 and torchtitan's Llama 3, which torch.fx cannot trace (or,
for torchtitan, traces with optional arguments) and which are split from a torch.export trace, their causal
masks and rotary tables recomputed by each chunk, trained with the default loss (no adapter).

Every case must match single-process training (``harness`` tolerances; losses per step and final parameters),
and the copies of a tied weight must be identical. By default: pp=2 under 1F1B and interleaved (2 chunks per
rank) on 2 ranks, tied dp=2 x pp=2 (DDP, FSDP) on 4; ``-m slow`` adds every family under both schedules,
DP x PP and TP x PP on 4 ranks. Every case of one world size runs in one spawn. A tied pipeline's checkpoint
resumes exactly under the same plan and in one process, and one saved without pipelining resumes under pp (disk and
snapshot). Single-process checks of the chunk construction and
of the refusals need no process group.
"""

from __future__ import annotations

import atexit
import copy
import functools
import inspect
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.cost_models.types import Strategy
from tessera.errors import ConfigError, NotModelledError
from tessera.runtime import pipeline, pipeline_ties
from tessera.runtime.apply import apply_plan
from tessera.runtime.elastic import resume_if_possible
from tessera.runtime.snapshots import SnapshotConfig

from .harness import FP32_TOL, LR, PARAM_TOL, SEED, full_tensors, make_plan
from .pipeline_models import LAYERS, make_outside, outside_batches, outside_plan, outside_reference, requirement

pytestmark = pytest.mark.distributed

VOCAB, HIDDEN, BLOCKS, BATCH, SEQ, STEPS = 64, 32, 4, 8, 16, 4
OUTSIDE_STEPS = 3
TIED_FQNS = ("emb.weight", "head.weight")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))  # (B, T, C)
        if mask is not None:
            h = h * mask[..., None]
        return x + scale * h


class MaskedStack(nn.Module):
    """A user's model whose forward has optional arguments, used by the root and by every block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 0.5) -> torch.Tensor:
        x = self.emb(ids) * scale
        if mask is not None:
            x = x * mask[..., None]
        for block in self.blocks:
            x = block(x, mask, scale)
        return self.head(self.norm(x))


class TiedStack(nn.Module):
    """GPT-2/Gemma/OPT style: the LM head is the input embedding's matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        nn.init.normal_(self.emb.weight, std=0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TransposedStack(nn.Module):
    """Carries its residual stream as ``(B, C, T)`` views between blocks (a convolutional front end's layout): what a
    stage sends is a strided view, which gloo's send refuses unless made contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(1, 2)  # (B, C, T), a view
        for block in self.blocks:
            x = block(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x.transpose(1, 2))


class HiddenOut(MaskedStack):
    """MaskedStack's layers, returning the last hidden state beside the logits (``output_hidden_states``-like): under
    zero-bubble PyTorch detached the last stage's outputs in place before the weight-gradient pass, which still
    needed that state."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)), x


MODELS = {"masked": MaskedStack, "tied": TiedStack, "transposed": TransposedStack, "hidden-out": HiddenOut}


def make(name: str, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(VOCAB, (steps, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]


@functools.cache
def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches():
        outputs = model(inputs)
        logits = outputs[0] if isinstance(outputs, tuple) else outputs
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, full_tensors(model.named_parameters())


# ------------------------------------------------------------------------------------------ the spawns

CASES = {
    2: [("masked", "dp=1,pp=2,mbs=2,schedule=1f1b"),
        ("masked", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),
        ("tied", "dp=1,pp=2,mbs=2,schedule=1f1b"),
        ("tied", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),  # tie between chunk 0 (rank 0) and chunk 3 (rank 1)
        # models torch.fx cannot trace, split from a torch.export trace (masks, rotary tables recomputed per chunk)
        ("hf-llama", "dp=1,pp=2,mbs=2,schedule=1f1b"),
        ("hf-gpt2", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),  # + tied wte/lm_head across ranks
        ("tt-llama3", "dp=1,pp=2,mbs=2,schedule=1f1b"),  # torchtitan: optional positions/attention_masks
        ("hf-gemma3", "dp=1,pp=2,mbs=2,schedule=1f1b"),  # rotary_emb traced as glue, its tables on every rank
        ("hf-gemma2", "dp=1,pp=2,mbs=2,schedule=1f1b"),  # eager attention (no SDPA), softcapping, tied
        ("hf-bart", "dp=1,pp=2,mbs=2,schedule=1f1b"),  # encoder-decoder, as the planner chunks it
        ("transposed", "dp=1,pp=2,mbs=2,schedule=1f1b"),  # strided views between stages
        ("hidden-out", "dp=1,pp=2,mbs=1,schedule=zero-bubble")],  # a second output the weight pass needs
    4: [("tied", "dp=2,pp=2,zero=0,mbs=2,schedule=1f1b"),  # tie reduction over pp after DDP's over dp
        ("tied", "dp=2,pp=2,zero=3,mbs=1,schedule=1f1b")],  # FSDP-sharded copies, summed shard by shard
}
SLOW_CASES = {  # the rest of the matrix: every family under both schedules, DP x PP and TP x PP
    2: [("hf-llama", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),
        ("hf-qwen2", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),
        ("hf-qwen2", "dp=1,pp=2,mbs=2,schedule=1f1b,recompute=full"),
        ("hf-phi3", "dp=1,pp=2,mbs=2,schedule=1f1b"),
        ("hf-phi3", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),
        ("hf-gpt2", "dp=1,pp=2,mbs=2,schedule=1f1b"),
        ("hf-gemma", "dp=1,pp=2,mbs=1,schedule=interleaved:2"),
        ("tt-llama3", "dp=1,pp=2,mbs=1,schedule=interleaved:2,recompute=selective")],
    4: [("hf-llama", "dp=2,pp=2,zero=0,mbs=2,schedule=1f1b"),
        ("hf-gpt2", "dp=2,pp=2,zero=3,mbs=1,schedule=interleaved:2"),
        ("hf-phi3", "dp=2,pp=2,zero=3,mbs=2,schedule=1f1b"),  # fused qkv_proj/gate_up_proj: FSDP2 per stage
        ("hf-gemma", "dp=2,pp=2,zero=0,mbs=1,schedule=interleaved:2"),
        ("tt-llama3", "dp=2,pp=2,zero=1,mbs=2,schedule=1f1b"),
        ("hf-llama", "dp=1,pp=4,mbs=2,schedule=1f1b"),  # one block per stage
        ("hf-gpt2", "dp=1,pp=4,mbs=2,schedule=1f1b"),  # wte on rank 0 tied to lm_head on rank 3
        ("tied", "dp=1,tp=2,pp=2,mbs=2,schedule=1f1b"),  # tied copies vocabulary-sharded alike, summed per shard
        ("hf-llama", "dp=1,tp=2,pp=2,mbs=2,schedule=1f1b"),
        ("hf-gemma", "dp=1,tp=2,pp=2,mbs=1,schedule=interleaved:2"),  # tied + tp
        ("hf-gpt2", "dp=1,tp=2,pp=2,mbs=2,schedule=1f1b"),  # tied + tp on Conv1D
        ("hf-gpt2", "dp=1,tp=2,pp=2,mbs=1,schedule=interleaved:2"),  # ... tied across ranks, packed q|k|v
        ("hf-phi3", "dp=1,tp=2,pp=2,mbs=1,schedule=interleaved:2"),  # fused projections, gathered
        ("hf-gemma2", "dp=1,tp=2,pp=2,mbs=2,schedule=1f1b"),  # softcapped scores of head-sharded attention
        ("tt-llama3", "dp=1,tp=2,pp=2,mbs=2,schedule=1f1b")],
}
CHECKPOINT_CASE = ("tied", "dp=1,pp=2,mbs=2,schedule=1f1b")


def is_outside(name: str) -> bool:
    return name in LAYERS


def build(name: str, strategy: str, **options):
    rank = dist.get_rank()
    if is_outside(name):
        model = make_outside(name, SEED + rank)
        return apply_plan(model, outside_plan(name, model, strategy), **options)  # the default loss: no adapter
    model = make(name, SEED + rank)  # rank 0's weights are broadcast: both copies of a tied weight start equal
    return apply_plan(model, make_plan(name, model, strategy), **options)


def train_case(name: str, strategy: str) -> dict:
    parallel = build(name, strategy)
    data = outside_batches(OUTSIDE_STEPS) if is_outside(name) else batches()
    started = time.perf_counter()
    losses = [parallel.train_step(batch) for batch in data]
    return {"losses": losses, "params": full_tensors(parallel.named_parameters()),
            "seconds": time.perf_counter() - started}


def checkpoint_case(folder: str) -> dict:
    """Train 2 steps, save, train 2 more; a fresh model loading the save trains the same 2 more steps."""
    parallel = build(*CHECKPOINT_CASE)
    data = batches()
    for batch in data[:2]:
        parallel.train_step(batch)
    parallel.save(folder).wait()
    after = [parallel.train_step(batch) for batch in data[2:]]
    restored = build(*CHECKPOINT_CASE)
    restored.load(folder)
    resumed = [restored.train_step(batch) for batch in data[2:]]
    return {"after": after, "resumed": resumed, "params": full_tensors(parallel.named_parameters()),
            "restored": full_tensors(restored.named_parameters())}


CROSSINGS = {  # a tied model saved under one plan resumes under another, from disk and from a snapshot
    "tied-into-pp": (("tied", "dp=2,zero=0,mbs=4"), CHECKPOINT_CASE),  # the state saved under emb.weight only
    "bart-into-pp": (("hf-bart", "dp=2,zero=0,mbs=4"), ("hf-bart", "dp=1,pp=2,mbs=2,schedule=1f1b")),  # model.shared
    "bart-out-of-pp": (("hf-bart", "dp=1,pp=2,mbs=2,schedule=1f1b"), ("hf-bart", "dp=2,zero=0,mbs=4")),  # never saved
}


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A schedule whose learning rate a resume gets wrong unless every param group's settings are restored."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def crossing_case(folder: str, saved_as: tuple[str, str], loaded_as: tuple[str, str]) -> dict:
    """Train 2 steps under ``saved_as``, save to disk and snapshot, train 2 more; ``loaded_as`` resumes from each and
    trains the same 2 steps: a tied weight's copies take the state saved under whichever of its names was saved."""
    saved = build(*saved_as, lr_scheduler_factory=halving)
    data = outside_batches(4) if is_outside(saved_as[0]) else batches()
    saved.enable_snapshots(SnapshotConfig(every=1000, store=Path(folder) / "store"))
    for batch in data[:2]:
        saved.train_step(batch)
    saved.save(Path(folder) / "disk").wait()
    saved.snapshots.snapshot(saved).wait()
    dist.barrier()  # committed on every rank
    if saved.snapshots._lock is not None:  # the node leader's: as if this run were gone, a restart reads its store
        os.close(saved.snapshots._lock)
    after = [saved.train_step(batch) for batch in data[2:]]
    resumed = {}
    for source in ("disk", "snapshot"):
        restored = build(*loaded_as, lr_scheduler_factory=halving)
        if source == "snapshot":
            restored.enable_snapshots(SnapshotConfig(every=1000, store=Path(folder) / "store"))
        info = resume_if_possible(restored, Path(folder) / "disk")
        resumed[source] = {"path": info.path, "losses": [restored.train_step(batch) for batch in data[2:]]}
        restored.close()
    return {"after": after, "resumed": resumed}


def meta_tied_case() -> dict:
    """The tied model built on meta (as a spec's model is) under pp: each stage initialises its own copy."""
    torch.manual_seed(SEED)  # every rank alike: each initialises its shards as the whole model would be
    with torch.device("meta"):
        model = TiedStack()
    parallel = apply_plan(model, make_plan("tied", model, CHECKPOINT_CASE[1]))
    return {"losses": [parallel.train_step(batch) for batch in batches()]}


def careless_case() -> dict[str, str]:
    """What ``train_step`` under pp says, on every rank before any step, of batches differing between ranks, of rows
    of another length than the plan's (gloo aborted the process on the mismatched receive), of a dict batch, and
    what a second ``apply_plan`` of the same model says."""
    model, strategy = make("masked", SEED + dist.get_rank()), "dp=1,pp=2,mbs=2,schedule=1f1b"
    parallel, (inputs, targets) = apply_plan(model, make_plan("masked", model, strategy)), batches(1)[0]
    said = {}
    for name, batch in (("per rank", ((inputs + dist.get_rank()) % VOCAB, targets)),  # a per-rank shard's
                        ("longer", (torch.cat([inputs, inputs], 1), torch.cat([targets, targets], 1))),
                        ("dict", {"input_ids": inputs, "labels": targets})):
        try:
            parallel.train_step(batch)
        except ConfigError as error:
            said[name] = str(error)
    try:
        apply_plan(model, make_plan("masked", make("masked"), strategy))
    except ConfigError as error:
        said["again"] = str(error)
    said["trains after"] = str(parallel.train_step((inputs, targets)))
    return said


def run_world(cases: list[tuple[str, str]], folder: str | None) -> dict:
    """Every case on this rank. A refusal (``NotModelledError``: raised alike on every rank before training)
    is recorded and the next case runs; any other error ends the spawn (peers may be waiting in a send)."""
    results = {}
    for case in cases:
        if requirement(case[0]) is not None:
            continue
        try:
            results[case] = train_case(*case)
        except NotModelledError as error:
            results[case] = {"refused": str(error)}
    if folder is not None:
        results["checkpoint"] = checkpoint_case(folder)
        results["crossing"] = {name: crossing_case(f"{folder}-crossing/{name}", *case) for name, case in CROSSINGS.items()
                               if requirement(case[0][0]) is None}
        results["careless"] = careless_case()
        results["meta-tied"] = meta_tied_case()
    return results


CHECKPOINT_FOLDER = tempfile.mkdtemp(prefix="tessera-pp-tied-")  # the 2-rank spawn saves here; read in-process too
atexit.register(shutil.rmtree, CHECKPOINT_FOLDER, ignore_errors=True)
atexit.register(shutil.rmtree, f"{CHECKPOINT_FOLDER}-crossing", ignore_errors=True)  # crossing_case's


@functools.cache
def world_results(world: int, slow: bool = False) -> list[dict]:
    """Every case of one world size (the default ones, or the slow ones) in one spawn; a failed spawn is
    cached too, so every test of that world reports it without spawning again."""
    from tessera.runtime.launch import WorkerError, spawn  # noqa: PLC0415

    folder = CHECKPOINT_FOLDER if world == 2 and not slow else None
    cases = SLOW_CASES[world] if slow else CASES[world]
    try:
        return spawn(run_world, nprocs=world, args=(cases, folder), timeout_s=1200 if slow else 400)
    except WorkerError as error:
        return [{"spawn_error": str(error)}] * world


def case_results(world: int, slow: bool, key) -> list[dict]:
    per_rank = world_results(world, slow)
    if "spawn_error" in per_rank[0]:
        raise AssertionError(per_rank[0]["spawn_error"])
    return [result[key] for result in per_rank]


def case_id(case) -> str:
    return f"{case[2]}-{case[3]}-{case[0]}ranks"


ALL = [(world, False, *case) for world, cases in CASES.items() for case in cases] + [
    pytest.param(world, True, *case, marks=pytest.mark.slow) for world, cases in SLOW_CASES.items() for case in cases]


@pytest.mark.parametrize(("world", "slow", "name", "strategy"), ALL,
                         ids=[case_id(c.values if hasattr(c, "values") else c) for c in ALL])
def test_pipeline_matches_single_process_training(world, slow, name, strategy):
    if requirement(name) is not None:
        pytest.skip(requirement(name))
    per_rank = case_results(world, slow, (name, strategy))
    if "refused" in per_rank[0]:
        pytest.fail(f"the runtime refused {name} under {strategy}: {per_rank[0]['refused']}")
    ref_losses, ref_params = outside_reference(name, OUTSIDE_STEPS) if is_outside(name) else reference(name)
    for result in per_rank:
        torch.testing.assert_close(result["losses"], ref_losses, **FP32_TOL)
    params = {}
    for result in per_rank:
        params.update(result["params"])
    model = make_outside(name) if is_outside(name) else make(name)
    plan = outside_plan(name, model, strategy) if is_outside(name) else make_plan(name, model, strategy)
    for tie in pipeline_ties.cross_chunk_ties(model, plan):  # one copy on each end stage of every replica
        copies = [r["params"][fqn] for r in per_rank for fqn in tie.fqns if fqn in r["params"]]
        assert len(copies) == Strategy.parse(strategy).dp * len(tie.fqns) * Strategy.parse(strategy).tp
        assert all(torch.equal(copy_, copies[0]) for copy_ in copies), f"the copies of {tie.names} differ"
        for fqn in tie.fqns[1:]:  # the reference lists the tied parameter once, under its first name
            assert torch.equal(params.pop(fqn), params[tie.fqns[0]])
        first = next(name for name, param in model.named_parameters() if param is model.get_parameter(tie.fqns[0]))
        params[first] = params.pop(tie.fqns[0])  # BART's model.shared, a module no stage holds, comes first
    assert params.keys() == ref_params.keys()
    torch.testing.assert_close(params, ref_params, **PARAM_TOL)


def test_tied_pipeline_checkpoint_resumes_exactly():
    per_rank = case_results(2, False, "checkpoint")
    for result in per_rank:
        assert result["resumed"] == result["after"]
        torch.testing.assert_close(result["restored"], result["params"], rtol=0, atol=0)
    assert torch.equal(per_rank[0]["params"]["emb.weight"], per_rank[1]["params"]["head.weight"])


@pytest.mark.parametrize("crossing", list(CROSSINGS))
def test_a_tied_model_resumes_across_pipelining_from_disk_and_snapshots(crossing):
    """``tied-into-pp``: the last stage's ``head.weight`` reads the state saved under ``emb.weight``; BART into pp:
    every stage's copy reads ``model.shared.weight``'s (no stage holds that module), whose param-group settings the
    first stage's group takes; BART out of pp: ``model.shared.weight``, never saved under pp, is the loaded copy."""
    if requirement(CROSSINGS[crossing][0][0]) is not None:
        pytest.skip(requirement(CROSSINGS[crossing][0][0]))
    for result in case_results(2, False, "crossing"):
        case = result[crossing]
        assert "snapshot" in case["resumed"]["snapshot"]["path"]
        for source in ("disk", "snapshot"):
            torch.testing.assert_close(case["resumed"][source]["losses"], case["after"], **FP32_TOL)


def test_a_tied_model_built_on_meta_trains_under_pp_like_one_process_built_alike():
    """Was refused ("tied across pipeline stages in a model on the meta device"), though planned: the copies now
    take the last stage's initial value, which one process's init leaves in the one parameter."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = TiedStack()
    single = apply_plan(model, make_plan("tied", model, "dp=1,mbs=8"))
    expected = [single.train_step(batch) for batch in batches()]
    for result in case_results(2, False, "meta-tied"):
        torch.testing.assert_close(result["losses"], expected, **FP32_TOL)


def test_careless_batches_and_a_second_plan_are_refused_alike_on_every_rank():
    said = case_results(2, False, "careless")
    assert said[0] == said[1]
    assert said[0]["per rank"].startswith("train_step got different batches on rank 0 and rank 1: every rank passes "
                                          "the same GLOBAL batch")
    assert said[0]["longer"].startswith(f"under pipeline parallelism the stages exchange activations of the planned "
                                        f"shape: these token ids have {2 * SEQ} positions, the plan's seq_len is {SEQ}")
    assert said[0]["dict"].startswith("train_step takes a tuple (inputs, targets), got a dict with keys "
                                      "['input_ids', 'labels']")
    assert "already parallelised" in said[0]["again"]
    assert math.isfinite(float(said[0]["trains after"]))  # the refusals left the model as it was


def test_tied_pipeline_checkpoint_loads_into_one_process():
    # The pipeline saved emb.weight (rank 0) and head.weight (rank 1); one process's tied model loads both
    # FQNs into its one parameter and trains on exactly as the pipeline did.
    after = case_results(2, False, "checkpoint")[0]["after"]
    model = make("tied")
    parallel = apply_plan(model, make_plan("tied", model, "dp=1,mbs=8"))
    parallel.load(CHECKPOINT_FOLDER)
    torch.testing.assert_close([parallel.train_step(batch) for batch in batches()[2:]], after, **FP32_TOL)


# ------------------------------------------------------------------------------------------ single process


def chunks_of(model: nn.Module, strategy: str) -> list[torch.fx.GraphModule]:
    plan = make_plan("masked", model, strategy)
    layer_chunks = {layer.fqn: layer.chunk for layer in plan.layers if layer.kind != "loss"}
    graph = pipeline.trace_layers(model, list(layer_chunks))
    node_chunks = pipeline.node_chunks(graph, layer_chunks)
    return [pipeline.build_chunk_module(model, graph, node_chunks, c) for c in range(len(plan.chunk_fqns()))]


def test_first_chunk_keeps_the_forwards_defaults_and_chunks_compute_the_model():
    model = make("masked")
    chunks = chunks_of(model, "dp=1,pp=2,mbs=1,schedule=interleaved:2")
    defaults = [p.default for p in inspect.signature(chunks[0].forward).parameters.values()][1:]
    assert defaults == [None, 0.5]
    assert all(len(inspect.signature(c.forward).parameters) == 1 for c in chunks[1:])  # no None/float handed over
    ids = batches(1)[0][0]
    value = ids
    for chunk in chunks:
        value = chunk(*value) if isinstance(value, tuple) else chunk(value)
    torch.testing.assert_close(value, model(ids), rtol=0, atol=0)


def test_cross_chunk_ties_are_found_and_each_stage_keeps_its_copy():
    model = make("tied")
    plan = make_plan("tied", model, "dp=1,pp=2,mbs=2,schedule=1f1b")
    (tie,) = pipeline_ties.cross_chunk_ties(model, plan)
    assert tie == pipeline_ties.TiedWeight(TIED_FQNS, (0, 1)) and tie.pp_ranks(2) == (0, 1)
    for local, kept in ((0, "emb"), (1, "head")):
        freed = copy.deepcopy(model)
        pipeline.free_remote_layers(freed, plan, [local])
        weights = {name: freed.get_submodule(name).weight for name in ("emb", "head")}
        assert not weights[kept].is_meta and torch.equal(weights[kept], model.emb.weight)
        assert all(w.is_meta for name, w in weights.items() if name != kept)


def test_tied_weights_in_two_chunks_of_one_rank_are_refused_naming_the_weights():
    model = make("tied")
    plan = make_plan("tied", model, "dp=1,pp=2,mbs=2,schedule=1f1b")
    ties = pipeline_ties.cross_chunk_ties(model, plan)
    pipeline_ties.check_ties(ties, Strategy.parse("dp=1,tp=2,pp=2,mbs=2,schedule=1f1b"))  # tp: kept
    with pytest.raises(NotModelledError, match=r"emb\.weight and head\.weight are tied between chunks"):
        pipeline_ties.check_ties(ties, Strategy.parse("dp=1,pp=1,mbs=2"))


# ------------------------------------------------------------------------------------------ export traces


def export_chunks(name: str, strategy: str):
    model = make_outside(name)
    plan = outside_plan(name, model, strategy)
    traced = pipeline.trace_plan(model, plan)  # what apply_plan does on every rank before anything is sharded
    chunks = pipeline.node_chunks(traced.graph, pipeline.layer_chunks(plan))
    modules = [pipeline.build_chunk_module(model, traced.graph, chunks, c, attributes=traced.attributes)
               for c in range(len(plan.chunk_fqns()))]
    return model, traced, modules


@pytest.mark.skipif(requirement("hf-llama") is not None, reason="transformers is not installed")
def test_export_chunks_call_the_users_layers_recompute_the_glue_and_compose_to_the_model():
    model, traced, chunks = export_chunks("hf-llama", "dp=1,pp=2,mbs=2,schedule=interleaved:2")
    assert traced.front_end == "torch.export"  # torch.fx cannot trace it
    assert chunks[1].get_submodule("model.layers.1") is model.model.layers[1]
    names = [name for chunk in chunks for name, _ in chunk.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()]  # each once, in order, the user's FQNs
    # the causal mask, rotary cos/sin and position ids depend on no input: each chunk computes its own, so
    # only the hidden states cross a boundary
    assert all(len(c.graph.find_nodes(op="placeholder")) == 1 for c in chunks)
    assert "model.rotary_emb.inv_freq" not in chunks[1].state_dict()  # non-persistent, as in the model
    ids = outside_batches(1)[0][0][:2]
    values = (ids,)
    for chunk in chunks:
        values = chunk(*values)
        values = values if isinstance(values, tuple) else (values,)
    output = pipeline.TreeOutput(traced.exported.output_spec, traced.exported.output_constants).rebuild(values)
    assert type(output) is type(model(ids))  # the loss receives the model's own CausalLMOutputWithPast
    torch.testing.assert_close(output.logits, model(ids).logits, rtol=0, atol=0)
    pipeline.check_input_shapes(chunks[0], traced.exported.input_shapes)
    with pytest.raises(ConfigError, match=r"traced with torch.export at input shape \(2, 16\) .* given \(2, 8\)"):
        chunks[0](ids[:, :8])


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.block = nn.Embedding(VOCAB, HIDDEN), Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(self.emb(ids)))


def test_export_refuses_a_layer_called_twice_by_name():
    from tessera.runtime.pipeline_export import export_forward  # noqa: PLC0415

    with pytest.raises(NotModelledError, match="calls block more than once"):
        export_forward(CalledTwice(), ["emb", "block"], torch.zeros(2, SEQ, dtype=torch.long))


class EmbeddingsInput(nn.Module):
    """A Hugging Face decoder driven with ``inputs_embeds`` (a vision or speech front end would feed it)."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, embeds: torch.Tensor):
        return self.decoder(inputs_embeds=embeds)


@pytest.mark.skipif(requirement("hf-llama") is not None, reason="transformers is not installed")
def test_a_model_whose_input_is_not_token_ids_is_refused_for_pipelining_saying_why():
    model = EmbeddingsInput(make_outside("hf-llama"))
    layers = [f"decoder.{fqn}" for fqn in LAYERS["hf-llama"][1:]]  # the embedding table is not called
    with pytest.raises(NotModelledError, match=r"runs at a micro-batch of token ids: a model whose input is not "
                                               r"token ids, e.g. one driven with inputs_embeds .*plan it with pp=1"):
        pipeline.trace_forward(model, layers, example=torch.zeros(2, SEQ, dtype=torch.long))


class Gated(nn.Module):
    """A block with a gate whose output the layer drops (transformers' hooks record such outputs for the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.block = nn.Linear(HIDDEN, 1), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate(x)
        return self.block(x)


class Stashing(Gated):
    """A layer keeping an inner value on itself (``self.kept``), which the root then reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = x.mean() * 2  # computed by the layer's own forward
        return super().forward(x)


class ReadsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.layer = nn.Embedding(VOCAB, HIDDEN), Stashing()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.layer(self.emb(ids))
        return x + self.layer.kept


def test_a_value_the_layer_itself_computes_and_the_root_reads_is_refused_by_name():
    # a submodule's output read outside its layer is returned by the call (the HF MoE aux-loss cell,
    # test_hf_expert_parallel); a value of the layer's own forward cannot be, and the error says which
    from tessera.runtime.pipeline_export import export_forward  # noqa: PLC0415

    with pytest.raises(NotModelledError, match=r"a value computed inside layer \(\w+\) is read outside it, not as one "
                                               r"of its outputs or a submodule's"):
        export_forward(ReadsInside(), ["emb", "layer"], torch.zeros(2, SEQ, dtype=torch.long))


class RecordsGate(nn.Module):
    """transformers' way of returning router logits: a hook records an inner submodule's output for the root."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.layers = nn.Embedding(VOCAB, HIDDEN), nn.ModuleList(Gated() for _ in range(2))
        self.recorded: list[torch.Tensor] = []
        for layer in self.layers:
            layer.gate.register_forward_hook(lambda _module, _args, output: self.recorded.append(output))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.recorded.clear()
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x, torch.cat(self.recorded, -1).square().mean()  # (B, T, C), an aux loss from both layers' gates


def test_a_submodule_output_read_outside_its_layer_is_handed_on_by_the_pipeline_chunks():
    from tessera.runtime.pipeline_export import export_forward  # noqa: PLC0415

    model = RecordsGate()
    ids = batches(1)[0][0][:2]
    expected = model(ids)
    traced = export_forward(model, ["emb", "layers.0", "layers.1"], ids)
    chunk_of = {"emb": 0, "layers.0": 0, "layers.1": 1}
    nodes = pipeline.node_chunks(traced.graph, chunk_of)
    chunks = [pipeline.build_chunk_module(model, traced.graph, nodes, c, attributes=traced.attributes) for c in (0, 1)]
    handed = chunks[0](ids)
    assert len(handed) == 2  # the hidden states and layer 0's gate output (the rest is computed in chunk 1)
    torch.testing.assert_close(chunks[1](*handed), expected, rtol=0, atol=0)
    torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)  # called directly, the layers are unchanged
