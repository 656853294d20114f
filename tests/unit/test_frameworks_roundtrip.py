"""Export -> import gives the same strategy (issue 20): for a representative set of plans, each framework's export
read back by Tessera's own reader is the strategy the export says the framework runs, and that is the plan's own
strategy wherever the framework can express it (the rest: the nearest setting, named)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.cost_models.types import Strategy, TrainingConfig
from tessera.errors import ConfigError
from tessera.planner.frameworks import export_plan, import_config
from tessera.planner.frameworks.common import canonical
from tessera.planner.plan import PlannedLayer
from tessera.topology import load_cluster

ROOT = Path(__file__).resolve().parents[2]


def plan_like(strategy: str | Strategy, *, blocks: int, global_batch: int, seq_len: int = 4096,
              precision: str = "bf16") -> SimpleNamespace:
    """A plan's data as the renderers read it: its strategy, training and per-layer decisions (chunks from
    ``chunk_blocks`` or the even split, recomputation per block)."""
    s = strategy if isinstance(strategy, Strategy) else Strategy.parse(strategy)
    chunks = list(s.chunk_blocks) or [blocks // (s.pp * s.virtual_stages)] * (s.pp * s.virtual_stages)
    assert sum(chunks) == blocks
    owners = [c for c, size in enumerate(chunks) for _ in range(size)]
    layers = [PlannedLayer(fqn="tok_embeddings", kind="embedding", recompute="none", chunk=0)]
    layers += [PlannedLayer(fqn=f"layers.{i}", kind="block", recompute=s.recompute_of_block(i), chunk=owners[i])
               for i in range(blocks)]
    layers += [PlannedLayer(fqn=name, kind=kind, recompute="none", chunk=len(chunks) - 1)
               for name, kind in (("norm", "norm"), ("output", "head"), ("loss", "loss"))]
    training = TrainingConfig(global_batch=global_batch, seq_len=seq_len, precision=precision)
    return SimpleNamespace(model_name="test-model", cluster="dgx-h100:nodes=8", training=training, strategy=s,
                           layers=tuple(layers))


def source_of(export, framework: str, tmp_path: Path) -> str:
    """Where the reader finds the export: the Megatron-LM text itself, else a file holding it."""
    if framework == "megatron":
        return export.text
    path = tmp_path / ("config.py" if framework == "torchtitan" else "ds_config.json")
    path.write_text(export.text)
    return str(path)


def round_trip(plan, framework: str, tmp_path: Path):
    export = export_plan(plan, framework)
    imported = import_config(framework, source_of(export, framework, tmp_path), world_size=plan.strategy.world_size)
    assert imported.strategy == canonical(export.strategy), (export.text, imported.strategy.to_string())
    assert imported.global_batch == plan.training.global_batch
    assert imported.unread == ()
    return export, imported


# (plan strategy, blocks, global batch) -> per framework: what it runs ("same" = the plan) or "refused"
CASES = {
    "ddp": ("dp=8,zero=0,mbs=2,recompute=none", 8, 64,
            {"megatron": "same", "torchtitan": "same", "deepspeed": "same"}),
    "zero1": ("dp=8,zero=1,mbs=1,recompute=full", 8, 64,
              {"megatron": "same", "torchtitan": "dp=8,zero=2,mbs=1,recompute=full", "deepspeed": "same"}),
    "zero2": ("dp=8,zero=2,mbs=1,recompute=selective", 8, 64,
              {"megatron": "same", "torchtitan": "same", "deepspeed": "dp=8,zero=2,mbs=1,recompute=full"}),
    "fsdp-recompute-mix": ("dp=64,zero=3,mbs=1,recompute=none,block_recompute=69xfull/11xnone", 80, 1024,
                           {"megatron": "same", "torchtitan": "dp=64,zero=3,mbs=1,recompute=full",
                            "deepspeed": "dp=64,zero=3,mbs=1,recompute=full"}),
    "tp-pp-interleaved-sp": (
        "dp=2,tp=8,pp=4,zero=1,mbs=1,recompute=selective,sp=true,schedule=interleaved:2", 80, 64,
        {"megatron": "dp=2,tp=8,pp=4,zero=1,mbs=1,recompute=selective,sp=true,sp_regather=true,schedule=interleaved:2",
         "torchtitan": "dp=2,tp=8,pp=4,zero=2,mbs=1,recompute=selective,sp=true,schedule=interleaved:2",
         "deepspeed": "refused"}),
    "uneven-stages": ("dp=4,tp=4,pp=4,zero=0,mbs=1,recompute=full,chunk_blocks=9/10/10/11,schedule=1f1b", 40, 32,
                      {"megatron": "same", "torchtitan": "same", "deepspeed": "refused"}),
    "first-blocks-of-each-chunk": (
        "dp=4,pp=2,zero=3,mbs=1,recompute=none,block_recompute=2xfull/2xnone/2xfull/2xnone/2xfull/2xnone/2xfull/2xnone,"
        "schedule=interleaved:2", 16, 64, {"megatron": "same", "torchtitan": None, "deepspeed": "refused"}),
    "experts": ("dp=8,tp=2,ep=4,zero=1,mbs=1,recompute=full", 8, 64,  # torchtitan: experts over efsdp x ep, no tp
                {"megatron": "same", "torchtitan": "dp=8,tp=2,ep=4,etp=1,zero=2,mbs=1,recompute=full",
                 "deepspeed": "refused"}),
    "experts-ddp": ("dp=8,ep=8,zero=0,mbs=1,recompute=none", 8, 64,
                    {"megatron": "same", "torchtitan": "dp=8,ep=8,zero=3,mbs=1,recompute=none", "deepspeed": "refused"}),
    "context": ("dp=2,tp=2,cp=4,zero=3,mbs=1,recompute=full", 8, 16,
                {"megatron": "same", "torchtitan": "same", "deepspeed": "refused"}),
    "context-ddp": ("dp=2,cp=4,zero=0,mbs=1,recompute=none", 8, 16,
                    {"megatron": "same", "torchtitan": "dp=2,cp=4,zero=3,mbs=1,recompute=none", "deepspeed": "refused"}),
    "zero-bubble": ("dp=2,pp=4,zero=1,mbs=1,recompute=none,schedule=zero-bubble", 8, 16,
                    {"megatron": "dp=2,pp=4,zero=1,mbs=1,recompute=none,schedule=1f1b", "torchtitan": None,
                     "deepspeed": "refused"}),
    "pipeline-passes": ("dp=2,pp=4,zero=3,mbs=1,recompute=full,schedule=1f1b,pipeline_passes=2", 8, 32,
                        {"megatron": "dp=2,pp=4,zero=3,mbs=1,recompute=full,schedule=1f1b", "torchtitan": "same",
                         "deepspeed": "refused"}),
    "offload-first-blocks": ("dp=8,zero=1,mbs=1,recompute=none,block_recompute=2xoffload/6xnone", 8, 64,
                             {"megatron": "same", "torchtitan": "dp=8,zero=2,mbs=1,recompute=full",
                              "deepspeed": "dp=8,zero=1,mbs=1,recompute=full"}),
    "offload-scattered": ("dp=8,zero=0,mbs=1,recompute=none,block_recompute=offload/none/offload/5xnone", 8, 64,
                          {"megatron": "dp=8,zero=0,mbs=1,recompute=none,block_recompute=2xoffload/6xnone",
                           "torchtitan": "dp=8,zero=0,mbs=1,recompute=full", "deepspeed": None}),
    "offload-every-block": ("dp=8,zero=0,mbs=1,recompute=offload", 8, 64,
                            {"megatron": "dp=8,zero=0,mbs=1,recompute=none,block_recompute=7xoffload/none",
                             "torchtitan": "dp=8,zero=0,mbs=1,recompute=full",
                             "deepspeed": "dp=8,zero=0,mbs=1,recompute=full"}),
    "offload-with-pp": ("dp=2,pp=2,zero=1,mbs=1,recompute=none,block_recompute=offload/3xnone/offload/3xnone,"
                        "schedule=1f1b", 8, 16,
                        {"megatron": "dp=2,pp=2,zero=1,mbs=1,recompute=none,block_recompute=full/3xnone/full/3xnone,"
                                     "schedule=1f1b",
                         "torchtitan": "dp=2,pp=2,zero=2,mbs=1,recompute=full,schedule=1f1b", "deepspeed": "refused"}),
    "offload-with-recompute": ("dp=8,zero=0,mbs=1,recompute=none,block_recompute=offload/full/6xnone", 8, 64,
                               {"megatron": "dp=8,zero=0,mbs=1,recompute=none,block_recompute=2xfull/6xnone",
                                "torchtitan": None, "deepspeed": None}),
    "reshard-mix": ("dp=8,zero=3,mbs=1,recompute=none,block_reshard=2xfalse/6xtrue", 8, 64,
                    {"megatron": "dp=8,zero=3,mbs=1,recompute=none", "torchtitan": "dp=8,zero=3,mbs=1,recompute=none",
                     "deepspeed": "dp=8,zero=3,mbs=1,recompute=none"}),
    "reshard-none": ("dp=8,zero=3,mbs=1,recompute=none,block_reshard=8xfalse", 8, 64,
                     {"megatron": "dp=8,zero=3,mbs=1,recompute=none", "torchtitan": "dp=8,zero=2,mbs=1,recompute=none",
                      "deepspeed": "dp=8,zero=3,mbs=1,recompute=none"}),
    "expert-folding": ("dp=4,tp=2,ep=8,etp=1,zero=1,mbs=1,recompute=full", 8, 64,
                       {"megatron": "same", "torchtitan": "dp=4,tp=2,ep=8,etp=1,zero=2,mbs=1,recompute=full",
                        "deepspeed": "refused"}),
    "named-pieces": ("dp=8,zero=1,mbs=1,recompute=selective,recompute_modules=mla_up_proj/mlp", 8, 64,
                     {"megatron": "same", "torchtitan": "dp=8,zero=2,mbs=1,recompute=selective",
                      "deepspeed": "dp=8,zero=1,mbs=1,recompute=full"}),
    "named-pieces-alone": ("dp=8,zero=1,mbs=1,recompute=none,recompute_modules=mla_up_proj", 8, 64,
                           {"megatron": "same", "torchtitan": "dp=8,zero=2,mbs=1,recompute=none",
                            "deepspeed": "dp=8,zero=1,mbs=1,recompute=none"}),
    "gpipe": ("dp=2,pp=2,zero=0,mbs=2,recompute=full,schedule=gpipe", 8, 16,
              {"megatron": "dp=2,pp=2,zero=0,mbs=2,recompute=full,schedule=1f1b", "torchtitan": "same",
               "deepspeed": "refused"}),
}


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_then_import_gives_what_the_framework_runs(name, framework, tmp_path):
    strategy, blocks, batch, expected = CASES[name]
    plan = plan_like(strategy, blocks=blocks, global_batch=batch)
    runs = expected[framework]
    if runs == "refused":
        with pytest.raises(ConfigError, match="data parallelism and ZeRO only"):
            export_plan(plan, framework)
        return
    export, _ = round_trip(plan, framework, tmp_path)
    if runs is None:  # only the round trip is checked
        return
    want = plan.strategy if runs == "same" else Strategy.parse(runs)
    assert canonical(export.strategy) == canonical(want), export.text
    assert export.differs_from(plan.strategy) == (runs != "same")
    assert bool(export.notes) or runs == "same" or framework == "megatron" and "sp_regather" in runs


def test_megatron_block_recompute_mix_names_the_nearest(tmp_path):
    # Full on the first 6 blocks of chunk 0 only: Megatron-LM recomputes the same first blocks of every chunk.
    plan = plan_like("dp=2,tp=8,pp=4,zero=2,mbs=1,recompute=none,sp=true,block_recompute=6xfull/74xnone,"
                     "schedule=interleaved:2", blocks=80, global_batch=1024)
    export, imported = round_trip(plan, "megatron", tmp_path)
    assert "nearest is full on the first 6 blocks of each chunk" in export.text
    assert imported.strategy.block_recompute == ("full",) * 6 + ("none",) * 4 + ("full",) * 6 + ("none",) * 4 + \
        (("full",) * 6 + ("none",) * 4) * 6


def test_megatron_recomputes_selective_blocks_beside_full_ones_whole():
    """Megatron-LM cannot mix full and selective recomputation: the selective blocks become full, never none, so
    the export keeps no more memory than the plan, which fits (none had left 99 of 80 GiB for the README's 70B)."""
    plan = plan_like("dp=64,zero=3,mbs=1,recompute=none,block_recompute=52xfull/28xselective", blocks=80,
                     global_batch=1024)
    export = export_plan(plan, "megatron")
    assert "nearest is full on every block (selective blocks recomputed whole" in export.text
    assert "--recompute-method uniform" in export.text and export.strategy.recompute == "full"


def test_megatron_export_is_shell_quoted_lines():
    plan = plan_like("dp=4,tp=4,pp=4,zero=0,mbs=1,recompute=full,chunk_blocks=9/10/10/11,schedule=1f1b",
                     blocks=40, global_batch=32)
    text = export_plan(plan, "megatron").text
    assert "--pipeline-model-parallel-layout 'Et*9|t*10|t*10|t*11L'" in text  # '|' and '*' quoted for the shell
    assert text.splitlines()[-1].startswith("  --") and text.count(" \\\n") > 5


# ------------------------------------------------------------------ the published-runs benchmark's configurations


def _published_rows():
    """``benchmarks/`` is scripts, not a package: load the rows module from its file."""
    spec = importlib.util.spec_from_file_location("published_rows", ROOT / "benchmarks" / "published_rows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("published_rows", module)
    spec.loader.exec_module(module)
    return module


def _benchmark_script(name: str):
    """A script of ``benchmarks/`` loaded as a module (its sibling modules importable while it loads)."""
    _published_rows()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_pairs_are_two_configurations_one_source_measured():
    """``benchmarks/published.py`` judges choices between configurations on pairs of runs of one workload from one
    source document: two documents' runs of one configuration differ by software version, not by a choice."""
    published = _benchmark_script("published")
    runs = published.measured_runs()
    pairs = {frozenset((p.first, p.second)) for p in published.workload_pairs(runs, {r["id"]: 1.0 for r in runs})}
    december, june = "torchtitan-h100-llama3-70b-256gpu-s8192-2d", "torchtitan2506-h100-llama3-70b-256gpu-fp8"
    assert frozenset((december, december + "-asynctp")) in pairs  # one document, TP against async TP
    assert frozenset((june + "-tp", june + "-asynctp")) in pairs
    assert frozenset((december + "-asynctp", june + "-asynctp")) not in pairs  # one configuration, two versions


def published_strategies() -> list[tuple[str, str, Strategy, int, int]]:
    """Each published run with a stated layout: (id, framework profile, its pins completed, blocks, global batch).
    Micro-batch 1 and 2 chunks per stage where the source leaves them out, as the benchmark's planner may fill."""
    rows = _published_rows()
    cases = []
    for run in rows.measured_runs():
        pins = {"micro_batch": 1, **rows.pins(run)}
        if pins.get("schedule") == "interleaved":
            pins.setdefault("virtual_stages", 2)
        blocks = run["model"]["layers"]
        if blocks % (pins["pp"] * pins.get("virtual_stages", 1)):
            continue  # Megatron-LM's even split does not hold; the benchmark's plans use an explicit layout there
        strategy = Strategy(**pins)
        cases.append((run["id"], rows.framework_profile(run).name, strategy, blocks, run["training"]["global_batch"]))
    return cases


def test_published_runs_round_trip_through_the_framework_that_ran_them(tmp_path):
    cases = published_strategies()
    assert len(cases) >= 20
    exact = {"megatron": "megatron", "deepspeed": "deepspeed"}
    for run_id, profile, strategy, blocks, batch in cases:
        plan = plan_like(strategy, blocks=blocks, global_batch=batch)
        if profile in exact:  # Megatron-LM and DeepSpeed rows: pinned as those frameworks run them
            export, imported = round_trip(plan, exact[profile], tmp_path)
            assert not export.differs_from(strategy), run_id
            assert imported.profile == profile
        if profile != "deepspeed":
            round_trip(plan, "torchtitan", tmp_path)


def test_the_renderers_never_import_the_plan():
    # The plan stays data (tests/unit/test_layering.py): it may delegate to planner.frameworks without a cycle.
    from test_layering import tessera_imports  # pytest puts this folder on sys.path

    for path in (ROOT / "planner" / "frameworks").glob("*.py"):
        assert "tessera.planner.plan" not in tessera_imports(path), path.name


def test_fp8_plans_name_each_frameworks_fp8_setting(tmp_path):
    plan = plan_like("dp=8,tp=2,zero=1,mbs=1,recompute=full", blocks=8, global_batch=64)
    plan.training = TrainingConfig(global_batch=64, seq_len=4096, precision="fp8", fp8_scaling="delayed")
    export, imported = round_trip(plan, "megatron", tmp_path)
    assert "--fp8-format hybrid" in export.text and "--fp8-recipe delayed" in export.text
    assert imported.precision == "fp8"
    assert any("Float8LinearConverter" in note for note in export_plan(plan, "torchtitan").notes)


README_STRATEGIES = [  # README.md's examples: (strategy, blocks, global batch)
    ("dp=16,tp=8,pp=8,zero=1,mbs=1,recompute=full,sp=true,schedule=interleaved:2", 96, 1536),
    ("dp=32,tp=4,pp=8,zero=1,mbs=1,recompute=none,sp=true,schedule=interleaved:4", 96, 1536),
    ("dp=128,tp=8,zero=0,mbs=1,recompute=none,sp=true", 96, 1536),
    ("dp=64,zero=3,mbs=1,recompute=none,block_recompute=53xfull/27xselective", 80, 1024),
]


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
def test_readme_example_plans_round_trip(framework, tmp_path):
    from tessera.planner.plan import Plan

    plans = [plan_like(s, blocks=b, global_batch=g) for s, b, g in README_STRATEGIES]
    plans += [Plan.from_json(ROOT / "docs" / name / "plan.json") for name in ("report-llama3-70b", "report-llama3-70b-pp")]
    expressible = [p for p in plans if framework != "deepspeed" or p.strategy.world_size == p.strategy.dp]
    assert expressible  # deepspeed refuses the tp/pp plans (tested above) but keeps the ZeRO-only ones
    for plan in expressible:
        export, imported = round_trip(plan, framework, tmp_path)  # asserts the strategy comes back unchanged
        assert imported.global_batch == plan.training.global_batch and export.text


@pytest.mark.parametrize("name", list(CASES))
def test_pin_string_pins_every_field(name):
    # Strategy.to_string leaves tp=1 and sp=false out; as pins the planner would fill those. pin_string does not.
    from tessera.planner.frameworks.common import pin_string

    strategy = Strategy.parse(CASES[name][0])
    assert Strategy.parse(pin_string(strategy)) == strategy
    assert set(Strategy.parse_fields(pin_string(strategy))) >= {"dp", "tp", "pp", "cp", "ep", "zero", "micro_batch",
                                                                "recompute", "sp", "tp_overlap", "sp_regather", "schedule"}


def test_megatron_offload_and_expert_tensor_parallel_flags_are_written():
    offload = export_plan(plan_like(CASES["offload-first-blocks"][0], blocks=8, global_batch=64), "megatron")
    assert "--cpu-offloading \\\n  --cpu-offloading-num-layers 2" in offload.text and not offload.notes
    folding = export_plan(plan_like(CASES["expert-folding"][0], blocks=8, global_batch=64), "megatron")
    assert "--expert-tensor-parallel-size 1" in folding.text
    mix = export_plan(plan_like(CASES["reshard-mix"][0], blocks=8, global_batch=64), "torchtitan")
    assert "fsdp_reshard_after_forward = 'default'" in mix.text
    assert any("block_reshard keeps 2 of 8 blocks" in note for note in mix.notes)


def test_each_published_row_is_priced_with_what_its_source_states_about_the_framework():
    rows = _published_rows()
    runs = {run["id"]: run for run in rows.measured_runs()}
    profile = {run_id: rows.framework_profile(run) for run_id, run in runs.items()}
    pure = [run_id for run_id, run in runs.items() if run["training"].get("mixed_precision_mode") == "PURE"]
    assert pure and all(profile[run_id].gradient_bytes == 2 for run_id in pure)  # FSDP PURE: bf16 reductions
    assert profile["foundry-a100-mpt350m-s2048-8gpu"].gradient_bytes == 4  # DEFAULT: fp32 reductions
    assert profile["foundry-a100-mpt350m-s2048-8gpu"].cross_entropy == "flash-attn"
    assert profile["torchtitan2506-h200-llama3-8b-32gpu-fsdp-float8"].cross_entropy == "compiled"  # its 2025 version
    assert profile["torchtitan-h100-llama3-8b-8gpu-s8192-fsdp-torchcompile"].cross_entropy == "torch"  # 9dec370: not
    assert profile["torchtitan-a100-llama2-13b-no-lbs2"].fused_rms_norm  # its 64-A100 preset: fused_rmsnorm
    assert not profile["torchtitan-a100-llama2-70b-full-lbs2"].fused_rms_norm  # its preset: the composite
    assert profile["megatron-sc21-t2-zero3-529.6b-640gpu"].zero3_by_parameter is not None  # DeepSpeed
    assert {profile["megatron-sc21-t1-1.7b"].name, profile["korthikanti-22B-full"].name} == {"megatron-2021"}
    assert profile["megatron-core-h100-weak-1.7b"].name == "megatron"
    assert profile["nemo2407-fp8-llama2-7b-8gpu"].name == "nemo-2024"  # its 24.07 container's recipes: bf16 grads
    assert profile["nemo2407-fp8-llama2-7b-8gpu"].attention_kernels == ("fa2",)  # its launcher: NVTE_FUSED_ATTN=0
    assert profile["nemo2511-fp8cs-llama3-70b-64gpu"].name == "megatron-bridge"  # bf16 grads, cuDNN attention
    assert profile["nemo2511-fp8cs-llama3-70b-64gpu"].gradient_bytes == 2
    assert not any(p.cp_ring_slowdown for name, p in profile.items() if name.startswith("nemo"))  # TE's ring
    automodel = profile["automodel2604-bf16-llama31-70b-64gpu-fsdp32-cp2"]  # "NeMo AutoModel", not Megatron-Core
    assert (automodel.name, automodel.gradient_bytes, automodel.cp_ring_slowdown) == ("automodel", 2, True)
    deepseek = runs["automodel2510-bf16-deepseek-v3-256gpu-pp4-ep64"]  # its own MoE model: TE, DeepEP, a fake gate
    moe = profile[deepseek["id"]]
    assert (moe.name, moe.gradient_bytes, moe.ep_dispatch, moe.ep_routing) == ("automodel-moe", 4, "per-node", "consecutive")
    assert rows.pins(deepseek)["chunk_blocks"] == (2,) * 29 + (1,) * 3  # AutoPipeline's 32 stages of 61 blocks
    assert rows.pins(deepseek)["block_reshard"] == (False,) * 61  # reshard_after_forward=not pp_enabled
    assert profile["torchtitan-h100-llama3-8b-8gpu-s131072-fsdp2-cp4"].cp_ring_slowdown  # PyTorch's ring
    with pytest.raises(ValueError, match="framework 'Colossal-AI' is not one Tessera profiles; known .*: DeepSpeed"):
        rows.framework_profile({**runs["megatron-core-h100-weak-1.7b"], "framework": "Colossal-AI"})


def test_a_recipe_that_counts_the_embedding_and_the_loss_as_layers_splits_the_pipeline_so():
    """Megatron-Bridge's 405B recipe (``account_for_embedding_in_pipeline_split`` and ``..._loss_...``): 126 blocks
    and 2 counted layers over 8 stages x 8 virtual ones, two a chunk, the first and the last chunk one block each; a
    split that does not come out even, or an unknown ``pipeline_split``, is one line."""
    rows = _published_rows()
    run = next(r for r in rows.measured_runs() if r["id"] == "nemo2511-fp8cs-llama31-405b-1024gpu")
    assert rows.pins(run)["chunk_blocks"] == (1,) + (2,) * 62 + (1,)
    assert rows.framework_profile(run).gradient_bytes == 2  # its recipes: grad_reduce_in_fp32 False
    uneven = {**run, "parallel": {**run["parallel"], "virtual_pipeline": 5}}
    with pytest.raises(ValueError, match="126 blocks with the embedding and the loss do not split evenly into 40"):
        rows.pins(uneven)
    one_chunk = {**run, "parallel": {**run["parallel"], "pp": 1, "virtual_pipeline": None, "dp": 64}}
    with pytest.raises(ValueError, match="into 1 pipeline chunks"):
        rows.pins(one_chunk)
    with pytest.raises(ValueError, match="pipeline_split 'uniform' is not 'embedding-and-loss'"):
        rows.pins({**run, "parallel": {**run["parallel"], "pipeline_split": "uniform"}})


def test_megatron_cpu_offloading_pins_its_first_blocks_to_offload_and_megatron_bridge_keeps_fp8_weights():
    rows = _published_rows()
    run = next(r for r in rows.measured_runs() if r["id"] == "nemo2604-fp8cs-llama3-70b-gb200-64gpu-fsdp")
    assert rows.pins(run)["block_recompute"] == ("offload",) * 40 + ("none",) * 40
    profile = rows.framework_profile(run)
    assert profile.fp8_params and profile.offload_copies_overlap and not profile.offload_buffered
    deepseek = next(r for r in rows.measured_runs() if r["id"] == "nemo2604-mxfp8-deepseek-v3-b200-256gpu")
    per_block = {**deepseek, "parallel": {**deepseek["parallel"], "recompute": "layer"}}
    assert len(rows.pins(per_block)["block_recompute"]) == 62  # its multi-token-prediction module is a block


def test_a_row_in_nemos_model_tflops_converts_with_nemos_formula_and_part_of_a_node_is_that_part():
    """NeMo's long-sequence table prints model TFLOP/s only: the step time is NeMo's Llama FLOPs over them. The
    formula reproduces NeMo 24.07's own table, which prints both (Llama 2 7B at 4K: 767 TFLOP/s, 16,634 tokens/s per
    GPU). A run on 4 of a node's 8 GPUs is priced on a 4-GPU node."""
    rows = _published_rows()
    run = next(r for r in rows.measured_runs() if r["id"] == "nemo2403-fp8-llama2-7b-s4k-4gpu-cp1")
    as_in_2407 = {**run, "hardware": {**run["hardware"], "gpus": 8},
                  "training": {**run["training"], "global_batch": 128}, "reported": {**run["reported"], "tflops_per_gpu": 767}}
    tokens_per_gpu_s = 128 * 4096 / (rows.published_step_s(as_in_2407) * 8)
    assert tokens_per_gpu_s == pytest.approx(16634, rel=1e-3)
    assert rows.cluster_spec(run) == "dgx-h100:nodes=1,gpus_per_node=4"
    assert rows.framework_profile(run).name == "nemo-2024"  # its launcher's recipes reduce gradients in bf16
    with pytest.raises(ValueError, match="unknown flops_formula 'nemo_llama'; known: megatron-sc21-eq3, nemo-llama"):
        rows.published_step_s({**run, "reported": {**run["reported"], "flops_formula": "nemo_llama"}})
    with pytest.raises(ValueError, match="6 GPUs are not whole nodes of gpus_per_node 4"):
        rows.cluster_spec({**run, "hardware": {**run["hardware"], "gpus": 6}})
    assert load_cluster(rows.cluster_spec(run)).num_devices == 4
    slice_of_a_rack = next(r for r in rows.measured_runs() if r["id"] == "nemo2604-mxfp8-qwen3-30b-a3b-gb200-8gpu")
    assert load_cluster(rows.cluster_spec(slice_of_a_rack)).num_devices == 8  # 8 of an NVL72 rack's 72, not 72
    with pytest.raises(ValueError, match="hardware.gpu 'V100-SXM2-32GB' has no preset; name one of A100-SXM4-80GB"):
        rows.cluster_spec({**run, "hardware": {**run["hardware"], "gpu": "V100-SXM2-32GB"}})  # not priced as an A100


def test_the_attention_gap_prices_the_attention_slower_and_finds_the_slowdown_a_step_implies():
    """``benchmarks/attention_gap.py``: at slowdown 1 the step is the benchmark's estimate; slower attention lengthens
    it; the slowdown found for a step 10% longer lies above 1 and reproduces that step."""
    gap = _benchmark_script("attention_gap")
    run = next(r for r in gap.measured_runs() if r["id"] == "nemo2403-fp8-llama2-7b-s16k-16gpu-cp1")
    strategy, estimate = gap.plan_run(run, gap.GPU_CALIBRATION)[:2]
    assert gap.step_with_attention_slowed(run, strategy, 1.0) == pytest.approx(estimate.step_time_s)
    assert gap.step_with_attention_slowed(run, strategy, 2.0) > 1.05 * estimate.step_time_s
    slowdown = gap.slowdown_for(run, strategy, 1.1 * estimate.step_time_s)
    assert slowdown > 1 and gap.step_with_attention_slowed(run, strategy, slowdown) == pytest.approx(
        1.1 * estimate.step_time_s, rel=1e-3)
    assert gap.priced_kernel(run) == "fa2"  # NeMo 24.03's launcher turned Transformer Engine's cuDNN attention off
    later = next(r for r in gap.measured_runs() if r["id"] == "nemo2511-fp8cs-llama3-8b-8gpu-fsdp")
    assert gap.priced_kernel(later) == "cudnn"  # Megatron-Bridge leaves it on: Transformer Engine's choice on an H100


def test_a_torchtitan_export_that_turns_on_compile_is_priced_with_its_compiled_loss(tmp_path):
    """The export turns on ``compile`` for async TP, and torchtitan then compiles the loss too (``compile.components``
    defaults to model and loss): the export and its import are priced as ``torchtitan-compiled``."""
    overlapped = plan_like("dp=2,tp=4,zero=3,mbs=1,recompute=full,sp=true,tp_overlap=true", blocks=8, global_batch=16)
    export, imported = round_trip(overlapped, "torchtitan", tmp_path)
    assert export.profile == imported.profile == "torchtitan-compiled"
    plain = export_plan(plan_like("dp=2,tp=4,zero=3,mbs=1,recompute=full,sp=true", blocks=8, global_batch=16),
                        "torchtitan")
    assert plain.profile == "torchtitan"


def test_a_published_moe_run_is_a_hugging_face_config_with_its_expert_layout_pinned():
    """Megatron-Bridge's Qwen3 235B-A22B row: the model is transformers' qwen3_moe built from its published shape
    (head_dim 128 whatever the width: a key default configs lack), its experts folded over the tensor-parallel ranks
    (expert_tensor_parallel_size 1), TP overlap pinned off as its recipe states, and judged as mixture of experts
    although it ran FP8, the precedence a plan's band takes."""
    rows = _published_rows()
    run = next(r for r in rows.measured_runs() if r["id"] == "nemo2511-fp8cs-qwen3-235b-a22b-256gpu")
    spec = rows.model_spec(run)
    assert spec.startswith("hf:qwen3_moe:num_hidden_layers=94,hidden_size=4096,") and "head_dim=128" in spec
    assert "norm_topk_prob=true" in spec and "tie_word_embeddings=false" in spec  # as the spec reader parses them
    fixed = rows.pins(run)
    assert (fixed["ep"], fixed["etp"], fixed["tp_overlap"], fixed["tp"]) == (32, 1, False, 2)
    assert Strategy(**fixed).expert_tp == 1
    assert rows.regime(run) == "moe" and rows.training_config(run).precision == "fp8"
    dense = next(r for r in rows.measured_runs() if r["id"] == "nemo2511-fp8cs-llama3-70b-64gpu")
    assert rows.pins(dense)["ep"] == 1 and rows.regime(dense) == "fp8"
    # its recipe's all-to-alls: overlapped with another micro-batch; 26.04's 30B sends once per node (HybridEP)
    by_id = {r["id"]: r for r in rows.measured_runs()}
    overlapped = rows.framework_profile(run)
    assert overlapped.ep_overlap and overlapped.ep_dispatch == "per-expert" and overlapped.gradient_bytes == 2
    assert rows.pins(run)["sp_regather"]  # a row's varied profile is still Megatron-Core's (compared by name)
    hybrid = rows.framework_profile(by_id["nemo2604-fp8cs-qwen3-30b-a3b-16gpu"])
    assert hybrid.ep_dispatch == "per-node" and not hybrid.ep_overlap
    assert not rows.framework_profile(by_id["nemo2511-fp8cs-qwen3-30b-a3b-16gpu"]).ep_overlap  # recipe not the row's
    with pytest.raises(ValueError, match="model.experts 64 is not its config's num_local_experts 128"):
        rows.model_spec({**run, "model": {**run["model"], "experts": 64}})


def test_megatrons_moe_model_flops_reproduce_megatron_bridges_own_pair_and_a_gb200_row_is_one_nvlink_domain():
    """Megatron-LM's MoE recipe index prints model TFLOP/s only: its rows convert with Megatron's count of a routed-expert
    decoder, which reproduces Megatron-Bridge's own pair for the same model (244.039 TFLOP/s at 24.7138 s per step of
    1024 x 4096 tokens on 16 GPUs, a row that prints both). A GB200 row's 16 GPUs are 16 of one NVL72 domain, and a
    recipe that leaves overlap_grad_reduce off reduces its gradients after the backward."""
    rows = _published_rows()
    bridge = next(r for r in rows.measured_runs() if r["id"] == "mbridge2607-bf16-qwen3-30b-a3b-16gpu")
    as_tflops = {**bridge, "reported": {"tflops_per_gpu": 244.039, "flops_formula": "megatron-moe"}}
    assert rows.published_step_s(as_tflops) == pytest.approx(24.7138, rel=1e-4)
    shared = {**as_tflops, "model": {**bridge["model"], "config": {**bridge["model"]["config"], "n_shared_experts": 1}}}
    with pytest.raises(ValueError, match="the config sets n_shared_experts: give the step time instead"):
        rows.published_step_s(shared)
    gb200 = next(r for r in rows.measured_runs() if r["id"] == "mlm2608-bf16-qwen3-30b-a3b-gb200-16gpu")
    assert rows.cluster_spec(gb200) == "gb200-nvl72:nodes=1,gpus_per_node=16"
    by_id = {r["id"]: r for r in rows.measured_runs()}  # Blackwell Ultra: DGX B300 nodes of 8, GB300 in one rack
    assert rows.cluster_spec(by_id["nemo2604-mxfp8-deepseek-v3-b300-256gpu"]) == "dgx-b300:nodes=32"
    assert rows.cluster_spec(by_id["nemo2604-mxfp8-llama3-70b-gb300-64gpu"]) == "gb300-nvl72:nodes=1,gpus_per_node=64"
    assert not rows.framework_profile(gb200).dp_overlap and rows.framework_profile(bridge).dp_overlap
    assert rows.framework_profile(bridge).name == "megatron-bridge"  # grad_reduce_in_fp32 False
