"""The calibration set's rows as Tessera inputs: model spec, cluster, training config, pins, framework profile.

Two files in ``benchmarks/reference/``, every row with its source: ``published_runs.yaml`` (a copy of the
shared set: Megatron-LM SC'21, Megatron-Core, Korthikanti et al.; annotated with each row's ``framework`` and, for
SC'21, the FLOPs formula its TFLOP/s count, both from the row's source) and ``fsdp_fp8_runs.yaml`` (PyTorch FSDP
and FP8 runs: MosaicML llm-foundry, torchtitan, NeMo). A row pins only what its source states; the planner
fills the rest (``published.plan_run``). Each row is evaluated as the framework that ran it
(``cost_models.profiles``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import yaml

from tessera.cost_models import Strategy, TrainingConfig
from tessera.topology.presets import load_cluster
from tessera.cost_models.profiles import (
    AUTOMODEL, AUTOMODEL_MOE, DEEPSPEED, MEGATRON, MEGATRON_2021, MEGATRON_BRIDGE, NEMO_2024, PYTORCH_FSDP_TE, TORCHTITAN_2024,
    ImplementationProfile,
)
from tessera.planner.frameworks.megatron_layout import even_split

HERE = Path(__file__).resolve().parent
MEGATRON_FIELDS_FILE = "published_runs.yaml"  # the shared set's own field names (``_megatron_pins``)
REFERENCE_FILES = (MEGATRON_FIELDS_FILE, "fsdp_fp8_runs.yaml")
SC21_FLOPS = "megatron-sc21-eq3"  # Narayanan et al. 2021's eq. 3: the FLOPs its TFLOP/s count, recomputation included
MEGATRON_MOE_FLOPS = "megatron-moe"  # Megatron-LM's model FLOPs of a routed-expert decoder (megatron_moe_flops_per_token)
PRESETS = {  # catalog device -> (preset whose fabric it sits on, gpu= variant or None)
    "A100-SXM4-80GB": ("dgx-a100", None), "A100-SXM-80GB": ("dgx-a100", None),
    "A100-SXM-40GB": ("dgx-a100", "A100-SXM-40GB"), "H100-SXM-80GB": ("dgx-h100", None),
    "H100-SXM-96GB-500W": ("dgx-h100", "H100-SXM-96GB-500W"), "H200-SXM-141GB": ("dgx-h200", None),
    "B200-SXM-180GB": ("dgx-b200", None), "B200-GB200-NVL72": ("gb200-nvl72", None),
    "B300-SXM-288GB": ("dgx-b300", None), "B300-GB300-NVL72": ("gb300-nvl72", None),
}


def measured_runs() -> list[dict]:
    """Runs with a published step time, TFLOP/s or tokens/s per GPU and a stated parallel layout."""
    runs = [{**run, "file": name} for name in REFERENCE_FILES
            for run in yaml.safe_load((HERE / "reference" / name).read_text())["runs"]]
    reported = ("tflops_per_gpu", "step_time_s", "tokens_per_s_per_gpu")
    return [r for r in runs if r["parallel"].get("tp") and any(r["reported"].get(key) for key in reported)]


def model_spec(run: dict) -> str:
    m = run["model"]
    if m.get("family") == "hf":  # a Hugging Face config built offline from the model's published shape
        config = {"num_hidden_layers": m["layers"], **m["config"]}
        if m.get("experts") != config.get("num_local_experts", m.get("experts")):
            raise ValueError(f"{run['id']}: model.experts {m.get('experts')} is not its config's num_local_experts "
                             f"{config['num_local_experts']}")
        return f"hf:{m['model_type']}:" + ",".join(f"{key}={_spec_value(value)}" for key, value in config.items())
    if m.get("family") == "llama":
        return (f"llama:layers={m['layers']},hidden={m['hidden']},heads={m['heads']},kv_heads={m['kv_heads']},"
                f"ffn={m['ffn_hidden']},vocab={m['vocab']},seq={m['seq_len']}")
    spec = f"gpt:layers={m['layers']},hidden={m['hidden']},heads={m['heads']},vocab={m['vocab']},seq={m['seq_len']}"
    return spec + (f",ffn={m['ffn_hidden']}" if m.get("ffn_hidden") else "")


def _spec_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _preset(run: dict) -> tuple[str, str | None]:
    """(preset, gpu= variant) of the row's ``hardware.gpu``; a row naming only "H100" sits on a DGX H100 (its SXM
    part, as DGX-class sources run); any other name must be in ``PRESETS``, not guessed."""
    gpu = str(run["hardware"]["gpu"])
    if gpu in PRESETS:
        return PRESETS[gpu]
    if gpu == "H100" or gpu.startswith("H100 ("):
        return PRESETS["H100-SXM-80GB"]
    raise ValueError(f"{run['id']}: hardware.gpu {gpu!r} has no preset; name one of {', '.join(PRESETS)} "
                     "or add it to published_rows.PRESETS")


def cluster_spec(run: dict) -> str:
    preset, variant = _preset(run)
    gpus, per_node = run["hardware"]["gpus"], run["hardware"].get("gpus_per_node") or 8
    if gpus % per_node:
        raise ValueError(f"{run['id']}: {gpus} GPUs are not whole nodes of gpus_per_node {per_node}")
    size = f"nodes={gpus // per_node}" + (f",gpus_per_node={per_node}" if per_node != _nominal_per_node(preset) else "")
    return f"{preset}:{size}" + (f",gpu={variant}" if variant else "")


@cache  # the fit asks for every row's cluster at every grid point: read each preset once
def _nominal_per_node(preset: str) -> int:
    """GPUs a node of ``preset`` holds: 72 for an NVL72 rack, 8 for a DGX."""
    return load_cluster(f"{preset}:nodes=1").devices_per_node


def mtp_modules(run: dict) -> int:
    """The multi-token-prediction modules the run trained (``model.mtp_layers``: DeepSeek-V3's one)."""
    return run["model"].get("mtp_layers", 0)


def training_config(run: dict) -> TrainingConfig:
    training = run["training"]
    precision = training.get("precision") if training.get("precision") in ("bf16", "fp8") else "bf16"
    extra = {"fp8_scaling": training["fp8_scaling"]} if precision == "fp8" and training.get("fp8_scaling") else {}
    return TrainingConfig(global_batch=training["global_batch"], seq_len=run["model"]["seq_len"], precision=precision, **extra)


FRAMEWORKS = (  # a row's ``framework``, by how it begins -> the profile of that framework's behaviours
    ("DeepSpeed ZeRO-3 2021", DEEPSPEED),
    ("Megatron-LM 2021", MEGATRON_2021),
    ("Megatron-LM 2022", MEGATRON_2021),
    ("Megatron-Core", MEGATRON),
    ("NeMo 24.03", NEMO_2024),
    ("NeMo 24.07", NEMO_2024),
    ("NeMo 25.11", MEGATRON_BRIDGE),
    ("NeMo 26.04", MEGATRON_BRIDGE),
    ("NeMo 26.06", MEGATRON_BRIDGE),  # 26.06 and 26.06.01
    ("Megatron-Bridge", MEGATRON_BRIDGE),
    ("NeMo AutoModel", AUTOMODEL),
    ("NeMo AutoModel MoE", AUTOMODEL_MOE),
    ("NeMo", MEGATRON),
    ("torchtitan", TORCHTITAN_2024),
    ("llm-foundry", PYTORCH_FSDP_TE),
)


def framework_profile(run: dict) -> ImplementationProfile:
    """The framework that ran the row, by its ``framework`` (``FRAMEWORKS``), with what its stated config turns on:
    DeepSpeed for SC'21's ZeRO-3 rows; Megatron-LM of 2021-2022 for SC'21's other rows and Korthikanti et al.'s
    (unfused attention, scattered pipeline sends, gradients reduced after the backward); NeMo's 2024 containers
    reducing gradients in bf16; how a MoE row's expert all-to-alls cross nodes and overlap (``parallel.ep_dispatch``,
    ``parallel.ep_overlap``); Adam's moments in bf16 (``training.moment_bytes``); whether its data-parallel
    collectives overlap the backward (``parallel.dp_overlap``)."""
    framework = str(run.get("framework", ""))
    matches = [(len(prefix), p) for prefix, p in FRAMEWORKS if framework.startswith(prefix)]
    profile = max(matches, key=lambda match: match[0])[1] if matches else None  # the longest: 'NeMo 24.07' > 'NeMo'
    if profile is None:
        raise ValueError(f"{run['id']}: framework {framework!r} is not one Tessera profiles; known (as the name "
                         f"begins): {', '.join(prefix for prefix, _ in FRAMEWORKS)}")
    training, par = run["training"], run["parallel"]
    if profile is TORCHTITAN_2024:  # the row's config may turn on FP8 all-gathers and its fused RMSNorm
        profile = replace(profile, fp8_all_gather=bool(training.get("fsdp_float8_all_gather")),  # and its version
                          fused_rms_norm=training.get("norm_type") == "fused_rmsnorm",  # compile the loss
                          cross_entropy="compiled" if training.get("compiled_loss") else "torch")
    if profile is PYTORCH_FSDP_TE and training.get("mixed_precision_mode") == "PURE":
        profile = replace(profile, gradient_bytes=2)  # FSDP's PURE mixed precision reduces gradients in bf16 too
    if par.get("ep_dispatch") or par.get("ep_overlap"):  # how the row's recipe runs its expert all-to-alls
        profile = replace(profile, ep_dispatch=par.get("ep_dispatch") or profile.ep_dispatch,
                          ep_overlap=bool(par.get("ep_overlap")))
    if par.get("ep_routing"):  # a benchmark's fixed routing (AutoModel's fake balanced gate)
        profile = replace(profile, ep_routing=par["ep_routing"])
    if training.get("moment_bytes"):  # Megatron-Core's precision-aware optimizer keeping bf16 Adam moments
        profile = replace(profile, moment_bytes=training["moment_bytes"])
    if par.get("dp_overlap") is not None:  # a recipe that leaves Megatron's overlap_grad_reduce off
        profile = replace(profile, dp_overlap=bool(par["dp_overlap"]))
    return profile


def regime(run: dict) -> str:
    """The row's regime for per-regime errors: cp (context parallelism, whatever the precision), moe (routed experts,
    whatever the precision), fp8, deepspeed-zero3, fsdp (PyTorch ZeRO-3) or ptd-p; the precedence of a plan's band
    (``cost_models.error_bands.plan_regime``)."""
    par = run["parallel"]
    if (par.get("cp") or 1) > 1:
        return "cp"
    if run["model"].get("experts"):
        return "moe"
    if training_config(run).precision == "fp8":
        return "fp8"
    if framework_profile(run).name == DEEPSPEED.name:
        return "deepspeed-zero3"
    return "fsdp" if par.get("zero_stage") == 3 else "ptd-p"


def published_step_s(run: dict) -> float:
    """The source's step time: given, its tokens per GPU per second, or its FLOPs per step over its FLOP/s."""
    reported, m, b = run["reported"], run["model"], run["training"]["global_batch"]
    if reported.get("step_time_s"):
        return float(reported["step_time_s"])
    if reported.get("tokens_per_s_per_gpu"):
        return b * m["seq_len"] / (reported["tokens_per_s_per_gpu"] * run["hardware"]["gpus"])
    return _model_flops_per_step(run) / (reported["tflops_per_gpu"] * 1e12 * run["hardware"]["gpus"])


def _model_flops_per_step(run: dict) -> float:
    """The FLOPs of one step as the row's source counts them (``reported.flops_formula``)."""
    formula, m, b = run["reported"].get("flops_formula"), run["model"], run["training"]["global_batch"]
    if formula == MEGATRON_MOE_FLOPS:
        return b * m["seq_len"] * megatron_moe_flops_per_token(m)
    s, l, h, v = m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    if formula == SC21_FLOPS:  # eq. 3: forward, backward and recomputed forward
        return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    if formula == "nemo-llama":  # NeMo's Llama model FLOPs (the row's notes)
        ratios = 12 * m["kv_heads"] / m["heads"] + 18 * m["ffn_hidden"] / h + 12 * s / h + 6 * v / (l * h)
        return b * s * l * h**2 * (12 + ratios)
    if formula is not None:
        raise ValueError(f"{run['id']}: unknown flops_formula {formula!r}; known: {SC21_FLOPS}, nemo-llama, "
                         f"{MEGATRON_MOE_FLOPS}")
    return 72 * b * s * l * h**2 * (1 + s / (6 * h)) + 6 * b * s * h * v  # model FLOPs: forward and backward only


_BEYOND_MEGATRON_MOE_COUNT = frozenset({
    "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace", "mlp_only_layers",
    "decoder_sparse_step", "num_nextn_predict_layers", "q_lora_rank", "kv_lora_rank",
})
"""Hugging Face config fields of what :func:`megatron_moe_flops_per_token` does not count (shared experts, dense
layers among the MoE ones, multi-token prediction, latent attention)."""


def megatron_moe_flops_per_token(model: dict) -> float:
    """Model FLOPs per token of a GQA/SwiGLU decoder with routed experts, counted as Megatron-LM's
    ``num_floating_point_operations`` counts them: the attention projections, the causal core (half the s x s
    product), each token's routed experts, forward and backward (x3), and the logits (6 h V); not the router.
    For Qwen3-30B-A3B at 4096 tokens it gives 23.006 GFLOP, which reproduces Megatron-Bridge's own 244.039 TFLOP/s
    at 24.7138 s per step of 1024 x 4096 tokens on 16 GPUs (its perf-moe-comm-overlap skill at 7ded17dae)."""
    c, s = model["config"], model["seq_len"]
    beyond = sorted(key for key in c if key in _BEYOND_MEGATRON_MOE_COUNT)
    if beyond:
        raise ValueError(f"flops_formula megatron-moe counts routed experts in every layer, GQA attention and no "
                         f"multi-token prediction; the config sets {', '.join(beyond)}: give the step time instead")
    h, heads, groups = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    qkv = heads * c["head_dim"]
    projections = 2 * (h * qkv + 2 * h * groups * c["head_dim"] + qkv * h)
    core = 2 * s * qkv
    experts = 2 * 3 * h * c["moe_intermediate_size"] * c["num_experts_per_tok"]
    return 3 * model["layers"] * (projections + core + experts) + 6 * h * c["vocab_size"]


def pins(run: dict) -> dict[str, object]:
    """What the source states about the run's strategy, as Strategy fields."""
    return _megatron_pins(run) if run["file"] == MEGATRON_FIELDS_FILE else _stated_pins(run)


def _stated_pins(run: dict) -> dict[str, object]:
    """A row of ``fsdp_fp8_runs.yaml``: its ``parallel`` fields are written as Strategy fields already."""
    par, training = run["parallel"], run["training"]
    fixed: dict[str, object] = {"tp": par["tp"], "pp": par["pp"], "dp": par["dp"], "cp": par.get("cp") or 1,
                                "ep": par.get("ep") or 1}
    if par.get("zero_stage") is not None:
        fixed["zero"] = par["zero_stage"]
    if training.get("micro_batch"):
        fixed["micro_batch"] = training["micro_batch"]
    recompute = par.get("recompute")
    layers = run["model"]["layers"] + mtp_modules(run)  # a multi-token-prediction module is a block
    if recompute == "layer":  # every other block fully recomputed (torchtitan's selective layer, frequency 2)
        fixed["block_recompute"] = tuple("full" if i % 2 == 0 else "none" for i in range(layers))
    elif par.get("offload_blocks"):  # Megatron-Core's cpu_offloading_num_layers: the first blocks' activations to host
        offloaded = par["offload_blocks"]
        fixed["block_recompute"] = ("offload",) * offloaded + (recompute or "none",) * (layers - offloaded)
    elif recompute:
        fixed["recompute"] = recompute
    if isinstance(par.get("tp_overlap"), bool):
        fixed["tp_overlap"] = par["tp_overlap"]
    if par.get("expert_tp"):  # Megatron-Core's expert_tensor_parallel_size
        fixed["etp"] = par["expert_tp"]
    if isinstance(par.get("sequence_parallel"), bool):
        fixed["sp"] = par["sequence_parallel"]
    if par.get("schedule"):
        fixed["schedule"] = par["schedule"]
    if par.get("virtual_pipeline"):
        fixed["schedule"], fixed["virtual_stages"] = "interleaved", par["virtual_pipeline"]
    if par.get("recompute_modules"):  # Megatron-Core's --recompute-modules beyond core_attn
        fixed["recompute_modules"] = tuple(par["recompute_modules"])
    if par.get("pipeline_passes"):  # schedule calls a step runs its micro-batches in (gradient accumulation over them)
        fixed["pipeline_passes"] = par["pipeline_passes"]
    if par.get("chunk_blocks"):  # the blocks of each pipeline chunk, in order, as the row's framework splits them
        fixed["chunk_blocks"] = tuple(par["chunk_blocks"])
    elif par.get("pipeline_split") == "embedding-and-loss":
        fixed["chunk_blocks"] = split_counting_embedding_and_loss(run)
    elif par.get("pipeline_split") is not None:
        raise ValueError(f"{run['id']}: pipeline_split {par['pipeline_split']!r} is not 'embedding-and-loss'")
    # by name: a row's config may vary its fields
    if framework_profile(run).name in (MEGATRON.name, NEMO_2024.name, MEGATRON_BRIDGE.name):
        fixed["sp_regather"] = True  # Megatron-Core's sequence parallelism, should the planner turn it on
        if par["pp"] > 1 and "schedule" not in fixed:
            fixed["schedule"] = "1f1b"  # what Megatron-Core runs without a virtual pipeline size
    keeps_gathered = (TORCHTITAN_2024.name, AUTOMODEL_MOE.name)
    if framework_profile(run).name in keeps_gathered and par["pp"] > 1 and fixed.get("zero") == 3:
        # torchtitan 9dec370 (parallelisms/parallelize_llama.py, apply_fsdp): "For PP, do not reshard after
        # forward to avoid per-microbatch all-gathers"; AutoModel's MoE parallelizer likewise
        # (reshard_after_forward=not pp_enabled): every block keeps its gathered weights
        fixed["block_reshard"] = (False,) * run["model"]["layers"]
    return fixed


def split_counting_embedding_and_loss(run: dict) -> tuple[int, ...]:
    """Blocks per pipeline chunk where the embedding and the loss each count as a layer of the split (Megatron-Core's
    ``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split``): the first chunk holds
    the embedding and one block fewer, the last the loss and one block fewer."""
    par, layers = run["parallel"], run["model"]["layers"]
    chunks = par["pp"] * (par.get("virtual_pipeline") or 1)
    sizes = even_split(layers, chunks, embedding=True, loss=True) if chunks >= 2 else None
    if sizes is None:
        raise ValueError(f"{run['id']}: {layers} blocks with the embedding and the loss do not split evenly into "
                         f"{chunks} pipeline chunks of two or more")
    return tuple(sizes)


def _megatron_pins(run: dict) -> dict[str, object]:
    """A row of ``published_runs.yaml`` (Megatron-LM, its own field names)."""
    par, training = run["parallel"], run["training"]
    fixed: dict[str, object] = {"tp": par["tp"], "pp": par["pp"], "dp": par["dp"]}
    if par.get("zero_stage") is not None or run["framework"].startswith("Megatron-LM 2021"):
        fixed["zero"] = par.get("zero_stage") or 0  # 2021 Megatron-LM had no distributed optimizer
    if training.get("micro_batch"):
        fixed["micro_batch"] = training["micro_batch"]
    if isinstance(par.get("sequence_parallel"), bool):
        fixed["sp"] = par["sequence_parallel"]
    # Every run here trained with Megatron-LM, whose sequence parallelism keeps the input shards and
    # all-gathers them again in the backward: its activation memory, not Tessera's runtime's.
    fixed["sp_regather"] = True
    if "--tp-comm-overlap" in str(run.get("notes", "")):  # the source says it overlapped TP communication
        fixed["tp_overlap"] = True
    recompute = str(par.get("recompute") or "")
    if run["reported"].get("flops_formula") == SC21_FLOPS or recompute.startswith("full"):
        fixed["recompute"] = "full"  # SC'21 ran (and counted FLOPs, eq. 3) with full recomputation
    elif recompute.startswith("selective"):
        fixed["recompute"] = "selective"
    virtual = par.get("virtual_pipeline")
    if par["pp"] > 1:  # Megatron's default schedule is 1F1B unless the paper says interleaved
        fixed["schedule"] = "interleaved" if virtual else "1f1b"
        if isinstance(virtual, int):
            fixed["virtual_stages"] = virtual
    return fixed


def runtime_only(strategy: Strategy) -> Strategy:
    """``strategy`` with only what Tessera's runtime can also do (no TP overlap, its own sequence parallelism, one
    schedule call a step, no recomputation of named pieces)."""
    return strategy.model_copy(update={"tp_overlap": False, "sp_regather": False, "pipeline_passes": 1,
                                       "recompute_modules": ()})
