"""Reading a framework's configuration into a ``Strategy`` (issue 20): what is read, what is listed as not read,
and every bad value refused in one line naming the flag or field."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tessera.cost_models.types import Strategy
from tessera.cost_models.profiles import PROFILES
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.frameworks import import_config
from tessera.planner.frameworks.common import canonical, pin_string
from tessera.planner.frameworks.megatron_import import PRICED_MODULES, RECOMPUTE_MODULES, from_megatron
from tessera.planner.frameworks.megatron_layout import parse_layout

_TITAN = importlib.util.find_spec("torchtitan")
# torchtitan's own config file, wherever it is installed (read as a syntax tree: the package need not import)
TORCHTITAN_LLAMA3 = (Path(_TITAN.submodule_search_locations[0]) / "models/llama3/config_registry.py") if _TITAN else None

# Korthikanti et al. 2022 (arXiv 2205.05198) Table 3, 175B "full recompute": t=8, p=8, 3 chunks per stage, 64 GPUs,
# global batch 64, micro-batch 1; written as the Megatron-LM flags that run it.
KORTHIKANTI_175B = (
    "python pretrain_gpt.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--max-position-embeddings 2048 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
    "--num-layers-per-virtual-pipeline-stage 4 --micro-batch-size 1 --global-batch-size 64 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --fp16 --lr 6.0e-5"
)


def test_a_published_megatron_command_line_reads_as_its_hand_written_strategy():
    config = from_megatron(KORTHIKANTI_175B, world_size=64)
    assert config.strategy == canonical(Strategy.parse("dp=1,tp=8,pp=8,zero=0,mbs=1,recompute=full,schedule=interleaved:3"))
    assert (config.global_batch, config.seq_len, config.precision) == (64, 2048, "fp16")
    # Model-shape and optimizer flags are listed, not silently dropped.
    assert config.unread == ("--hidden-size 12288", "--num-attention-heads 96", "--max-position-embeddings 2048",
                             "--lr 6.0e-5")


def test_megatron_features_map_to_strategy_fields():
    text = ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --context-parallel-size 2 "
            "--expert-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --num-layers 8 --micro-batch-size 2 "
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --use-distributed-optimizer "
            "--overlap-grad-reduce "
            "--pipeline-model-parallel-layout Et*3|t*5L --recompute-granularity selective --bf16")
    s = from_megatron(text, world_size=64).strategy
    assert (s.dp, s.tp, s.pp, s.cp, s.ep, s.zero, s.micro_batch) == (4, 4, 2, 2, 2, 2, 2)
    assert s.sp and s.sp_regather and s.tp_overlap and s.recompute == "selective" and s.chunk_blocks == (3, 5)


def test_megatron_block_recompute_and_uneven_first_last_stages():
    text = ("--pipeline-model-parallel-size 3 --num-layers 10 --decoder-first-pipeline-num-layers 2 "
            "--decoder-last-pipeline-num-layers 2 --micro-batch-size 1 --recompute-granularity full "
            "--recompute-method block --recompute-num-layers 1")
    s = from_megatron(text, world_size=6).strategy
    assert s.chunk_blocks == (2, 6, 2)
    assert s.block_recompute == ("full", "none", "full", *("none",) * 5, "full", "none")


@pytest.mark.parametrize("text, message", [
    ("--tensor-model-parallel-size 0 --micro-batch-size 1", "argument --tensor-model-parallel-size: expected a whole"),
    ("--tensor-model-parallel-size abc --micro-batch-size 1", "--tensor-model-parallel-size: expected a whole number"),
    ("--tensor-model-parallel-size 3 --micro-batch-size 1", "does not divide the cluster's 8 devices"),
    ("--tensor-model-parallel-size 2", "--micro-batch-size is required"),
    ("--tensor-model-paralel-size 2 --micro-batch-size 1", "did you mean --tensor-model-parallel-size"),
    ("--micro-batch-size 1 --recompute-granularity everything", "argument --recompute-granularity: invalid choice"),
    ("--micro-batch-size 1 --recompute-granularity full", "needs --recompute-method"),
    ("--micro-batch-size 1 --recompute-granularity full --recompute-method block --recompute-num-layers 2",
     "needs --num-layers"),
    ("--pipeline-model-parallel-size 2 --num-layers 7 --micro-batch-size 1", "over pp x virtual stages = 2 is not divisible"),
    ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 3 --micro-batch-size 1",
     "not a multiple of --num-layers-per-virtual-pipeline-stage 3"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|txL --micro-batch-size 1",
     "has ['x'] (Tessera reads E, t, m, L)"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tmL --micro-batch-size 1",
     "places 1 multi-token-prediction layers (m) but --mtp-num-layers is 0"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*2|t*2L --num-layers 5 --micro-batch-size 1",
     "places 4 layers but --num-layers is 5"),
    ("--micro-batch-size 1 --lr '1e-4", "check the quotes"),
])
def test_bad_megatron_values_are_one_line_naming_the_flag(text, message):
    with pytest.raises(ConfigError) as error:
        from_megatron(text, world_size=8)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_megatron_what_the_cost_model_has_no_term_for_is_refused():
    with pytest.raises(NotModelledError, match="does not divide the data-parallel size 2"):
        from_megatron("--tensor-model-parallel-size 4 --expert-model-parallel-size 4 --micro-batch-size 1", world_size=8)
    with pytest.raises(NotModelledError, match="--expert-tensor-parallel-size 3 does not divide"):
        from_megatron("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 3 --micro-batch-size 1", world_size=8)
    with pytest.raises(NotModelledError, match="does not divide dp x tp / expert tp = 2x4/2"):
        from_megatron("--tensor-model-parallel-size 4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 8 "
                      "--micro-batch-size 1", world_size=8)


def test_megatron_expert_tensor_parallel_size_is_read_as_etp():
    # Megatron's "MoE parallel folding": experts on etp=1 over ep=8, which takes the tp=2 ranks of dp=4 too.
    folded = from_megatron("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 8 "
                           "--micro-batch-size 1", world_size=8)
    assert (folded.strategy.etp, folded.strategy.ep, folded.strategy.expert_dp) == (1, 8, 1)
    same = from_megatron("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 --micro-batch-size 1", world_size=8)
    assert same.strategy.etp is None  # the default (etp = tp), one form per meaning


def test_megatron_expert_dispatch_and_overlap_pick_the_profile_that_prices_them():
    """DeepEP under the flex dispatcher sends a token once per node, ``--overlap-moe-expert-parallel-comm`` runs the
    all-to-alls beside another micro-batch: each selects Megatron-Core's variant for it; the default allgather
    dispatcher is priced as alltoall and says so; flex without DeepEP is one line."""
    from tessera.cost_models.profiles import profile

    base = "--expert-model-parallel-size 8 --micro-batch-size 1 --overlap-grad-reduce"
    both = from_megatron(f"{base} --moe-token-dispatcher-type flex --moe-enable-deepep "
                         "--overlap-moe-expert-parallel-comm", world_size=16)
    assert both.profile == "megatron-deepep-ep-overlap"
    assert profile(both.profile).ep_dispatch == "per-node" and profile(both.profile).ep_overlap
    assert from_megatron(f"{base} --moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm",
                         world_size=16).profile == "megatron-ep-overlap"
    plain = from_megatron(f"{base} --moe-token-dispatcher-type alltoall", world_size=16)
    assert plain.profile == "megatron" and not plain.notes
    default = from_megatron(base, world_size=16)
    assert default.profile == "megatron" and any("allgather" in note for note in default.notes)
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type flex needs --moe-enable-deepep"):
        from_megatron(f"{base} --moe-token-dispatcher-type flex", world_size=16)
    dense = from_megatron("--micro-batch-size 1 --overlap-grad-reduce --overlap-moe-expert-parallel-comm", world_size=16)
    assert dense.profile == "megatron"  # no experts: nothing to exchange


def test_megatron_cpu_offloading_is_read_as_offload_of_the_first_blocks():
    config = from_megatron("--num-layers 8 --cpu-offloading --cpu-offloading-num-layers 3 --micro-batch-size 1",
                           world_size=8)
    assert config.strategy.block_recompute == ("offload",) * 3 + ("none",) * 5
    assert config.unread == ()
    for words, message in [("--num-layers 8 --cpu-offloading-num-layers 8", "must be below --num-layers 8"),
                           ("--num-layers 8 --cpu-offloading-num-layers 2 --recompute-granularity selective",
                            "together with pipelining or recomputation"),
                           ("--cpu-offloading-num-layers 2", "--cpu-offloading needs --num-layers")]:
        with pytest.raises(ConfigError, match=message):
            from_megatron(f"--cpu-offloading {words} --micro-batch-size 1", world_size=8)


def test_multi_token_prediction_layers_join_the_last_chunk_and_must_agree_with_the_layout():
    """DeepSeek-V3's layout on 8 pipeline ranks x 2 chunks (Megatron-Bridge's B200 recipe): its MTP layer ``m`` runs in
    the last chunk after its block, which Tessera counts as one more block there."""
    words = ("--pipeline-model-parallel-size 8 --expert-model-parallel-size 32 --num-layers 61 --micro-batch-size 1 "
             "--pipeline-model-parallel-layout 'Et*4|(t*4|)*14tmL' --mtp-num-layers 1")
    config = from_megatron(words, world_size=256)
    assert config.mtp_layers == 1 and config.strategy.chunk_blocks == (4,) * 15 + (2,) and config.unread == ()
    even = from_megatron("--pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 1 --mtp-num-layers 1",
                         world_size=2)
    assert (even.mtp_layers, even.strategy.chunk_blocks) == (1, (2, 3))
    with pytest.raises(ConfigError, match="places 1 multi-token-prediction layers .m. but --mtp-num-layers is 0"):
        from_megatron(words.replace(" --mtp-num-layers 1", ""), world_size=256)
    with pytest.raises(NotModelledError, match="before the last chunk"):
        parse_layout("Etm|t*2L", pp=2)


def test_layout_expansion_is_bounded():
    assert parse_layout("E(t|)*3,tL", pp=2) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="expands past"):
        parse_layout("E" + "(t*999999)*999999" + "L", pp=1)


# ----------------------------------------------------------------------------------------- torchtitan


@pytest.mark.skipif(TORCHTITAN_LLAMA3 is None, reason="torchtitan is not installed (pip install --no-deps -r requirements-torchtitan.txt)")
def test_torchtitans_own_llama3_70b_config_is_read_without_running_it():
    config = import_config("torchtitan", f"{TORCHTITAN_LLAMA3}:llama3_70b", world_size=64)
    s = config.strategy
    assert (s.dp, s.tp, s.zero, s.micro_batch, s.recompute, s.sp) == (8, 8, 3, 8, "full", True)
    assert (config.global_batch, config.seq_len, config.precision) == (64, 8192, "bf16")
    assert any("model_spec = model_registry('70B')" in line for line in config.unread)
    assert "training.steps=1000" in config.unread


def test_a_derived_torchtitan_config_follows_its_base_function(tmp_path):
    path = tmp_path / "my_registry.py"
    path.write_text(
        "from torchtitan.config import ParallelismConfig\n"
        "import os\n"
        "def base():\n    return Trainer.Config(parallelism=ParallelismConfig(tensor_parallel_degree=2),\n"
        "                          activation_checkpoint=None)\n"
        "def mine():\n    config = base()\n    config.parallelism.pipeline_parallel_degree = 2\n"
        "    config.parallelism.pipeline_parallel_microbatch_size = 2\n"
        "    config.parallelism.module_fqns_per_model_part = [['tok', 'layers.0', 'layers.1'], ['layers.2', 'norm']]\n"
        "    config.training.local_batch_size = 8\n    os.system('echo never runs')\n    return config\n")
    s = import_config("torchtitan", f"{path}:mine", world_size=8).strategy
    assert (s.dp, s.tp, s.pp, s.micro_batch, s.recompute, s.chunk_blocks) == (2, 2, 2, 2, "none", (2, 1))


@pytest.mark.parametrize("body, message", [
    ("config.parallelism.tensor_parallel_degree = 0", "parallelism.tensor_parallel_degree 0: expected a whole number"),
    ("config.parallelism.tensor_parallel_degree = 3", "ranks, not the cluster's 8 devices"),
    ("config.parallelism.tensor_parallel_degree = int('8')", "is not a literal"),
    ("config.activation_checkpoint = make_ac()", "Tessera reads FullAC.Config(), SelectiveAC.Config() or None"),
    ("config.parallelism.pipeline_parallel_degree = 2\n    config.parallelism.pipeline_parallel_schedule = 'DualPipeV'",
     "Tessera models GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble"),
    ("config.training.enable_cpu_offload = True", "no CPU offload"),
    ("config.training.mixed_precision_param = 'float16'", "use bfloat16 or float32"),
    ("config.compile.components = 'loss'", "compile.components 'loss': use a list of names"),
])
def test_bad_torchtitan_values_are_one_line_naming_the_field(body, message, tmp_path):
    path = tmp_path / "config.py"
    path.write_text(f"def apply(config):\n    {body}\n    return config\n")
    with pytest.raises((ConfigError, NotModelledError)) as error:
        import_config("torchtitan", str(path), world_size=8)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_torchtitan_file_needs_one_named_function(tmp_path):
    path = tmp_path / "two.py"
    path.write_text("def a():\n    pass\ndef b():\n    pass\n")
    with pytest.raises(ConfigError, match="defines 2 functions"):
        import_config("torchtitan", str(path), world_size=8)
    with pytest.raises(ConfigError, match="has no function 'c'"):
        import_config("torchtitan", f"{path}:c", world_size=8)


def test_torchtitan_json_dump_and_toml(tmp_path):
    dump = {"parallelism": {"data_parallel_shard_degree": 4, "tensor_parallel_degree": 2,
                            "enable_fsdp_symm_mem": False},
            "training": {"local_batch_size": 2, "seq_len": 4096}, "activation_checkpoint": {"preserve_rng_state": True}}
    (tmp_path / "job.json").write_text(json.dumps(dump))
    config = import_config("torchtitan", str(tmp_path / "job.json"), world_size=8)
    assert config.strategy.to_string() == "dp=4,tp=2,zero=3,mbs=2,recompute=full,sp=true"
    assert config.unread == ("parallelism.enable_fsdp_symm_mem=False",)
    (tmp_path / "old.toml").write_text("[parallelism]\ndata_parallel_replicate_degree = 8\ndata_parallel_shard_degree = 1\n"
                                       "[activation_checkpoint]\nmode = 'selective'\n")
    assert import_config("torchtitan", str(tmp_path / "old.toml"), world_size=8).strategy.to_string() == \
        "dp=8,zero=0,mbs=8,recompute=selective"
    (tmp_path / "model.toml").write_text("[model]\nname = 'llama3'\nflavor = '70B'\n[training]\nsteps = 100\n")
    assert import_config("torchtitan", str(tmp_path / "model.toml"), world_size=8).unread == (
        "model.name='llama3'", "model.flavor='70B'", "training.steps=100")  # the model is the one Tessera is given


def test_torchtitan_gradient_accumulation_under_pipelining_runs_one_schedule_per_local_batch(tmp_path):
    dump = {"parallelism": {"data_parallel_shard_degree": 4, "pipeline_parallel_degree": 2,
                            "pipeline_parallel_microbatch_size": 1},
            "training": {"local_batch_size": 4, "global_batch_size": 32, "seq_len": 4096}}
    (tmp_path / "job.json").write_text(json.dumps(dump))
    config = import_config("torchtitan", str(tmp_path / "job.json"), world_size=8)
    assert config.strategy.pipeline_passes == 2 and config.strategy.micro_batch == 1  # 32 / (4 x 4): two schedules
    assert Strategy.parse(pin_string(config.strategy)) == config.strategy  # evaluated as read
    dump["training"]["global_batch_size"] = 16
    (tmp_path / "job.json").write_text(json.dumps(dump))
    assert import_config("torchtitan", str(tmp_path / "job.json"), world_size=8).strategy.pipeline_passes == 1


def test_a_torchtitan_config_that_compiles_its_loss_is_priced_with_the_fused_loss(tmp_path):
    """torchtitan compiles the loss with ``compile.enable`` and ``loss`` among ``compile.components`` (its default):
    its profile is ``torchtitan-compiled`` (one fused cross-entropy kernel), else ``torchtitan``."""
    def profile_of(lines):
        path = tmp_path / "config.py"
        path.write_text("def apply(config):\n" + "".join(f"    {line}\n" for line in lines) + "    return config\n")
        return import_config("torchtitan", str(path), world_size=8).profile
    assert profile_of(["config.compile.enable = True"]) == "torchtitan-compiled"
    assert profile_of(["config.compile.enable = True", "config.compile.components = ['model']"]) == "torchtitan"
    assert profile_of(["config.training.local_batch_size = 2"]) == "torchtitan"
    assert PROFILES["torchtitan-compiled"].cross_entropy == "compiled"


# ----------------------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_config_reads_batch_zero_and_precision(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 256, "gradient_accumulation_steps": 4,
                                "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2,
                                "overlap_comm": True}, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}}))
    config = import_config("deepspeed", str(path), world_size=8)
    assert config.strategy.to_string() == "dp=8,zero=2,mbs=8,recompute=none"
    assert (config.global_batch, config.precision) == (256, "bf16")
    assert config.unread == ('optimizer={"type": "AdamW"}', "zero_optimization.overlap_comm")
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    stage3 = import_config("deepspeed", str(path), world_size=8)
    assert stage3.profile == "deepspeed" and PROFILES[stage3.profile].zero3_by_parameter is not None  # as its note says
    assert any("cost_models.profiles.DEEPSPEED" in note for note in stage3.notes)


@pytest.mark.parametrize("config, message", [
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 5}}, "zero_optimization.stage 5"),
    ({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size 100 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 2 x 8 devices"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu 0"),
    ({"zero_optimization": {"stage": 3}}, "give train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "no offloading"),
    ({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 4}}, "autotp_size 4"),
    ([1, 2], "holds list"),
])
def test_bad_deepspeed_values_are_one_line_naming_the_key(config, message, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises((ConfigError, NotModelledError)) as error:
        import_config("deepspeed", str(path), world_size=8)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_missing_or_huge_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        import_config("deepspeed", str(tmp_path / "nope.json"), world_size=8)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (5 * 2**20))
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        import_config("deepspeed", str(big), world_size=8)


def test_megatron_recompute_modules_price_the_attention_core_and_every_named_piece():
    """``--recompute-modules`` (Megatron-Core's default: core_attn, Tessera's ``selective``): every other module it
    takes is a ``Strategy.recompute_modules`` piece, never silently read as the attention core."""
    assert set(RECOMPUTE_MODULES) == {"core_attn", *PRICED_MODULES}
    base = "--micro-batch-size 1 --recompute-granularity selective"
    default = from_megatron(base, world_size=8)
    assert default.strategy.recompute == "selective" and not default.notes and default.unread == ()
    assert default.strategy.recompute_modules == ()
    assert from_megatron(f"{base} --recompute-modules core_attn", world_size=8).notes == ()
    mixed = from_megatron(f"{base} --multi-latent-attention --recompute-modules core_attn mla_up_proj", world_size=8)
    assert mixed.strategy.recompute == "selective" and mixed.unread == () and mixed.notes == ()
    assert mixed.strategy.recompute_modules == ("mla_up_proj",)
    pieces = from_megatron(f"{base} --multi-latent-attention --recompute-modules mla_up_proj mlp", world_size=8)
    assert pieces.strategy.recompute == "none" and pieces.strategy.recompute_modules == ("mla_up_proj", "mlp")
    assert pieces.notes == ()
    moe = from_megatron(f"{base} --moe-grouped-gemm --recompute-modules moe moe_act shared_experts layernorm",
                        world_size=8)
    assert moe.strategy.recompute_modules == ("layernorm", "shared_experts", "moe_act", "moe") and moe.notes == ()
    nothing = from_megatron(f"{base} --recompute-modules", world_size=8)
    assert nothing.strategy.recompute == "none" and any("recomputes nothing" in n for n in nothing.notes)
    layer = from_megatron("--micro-batch-size 1 --moe-layer-recompute", world_size=8)
    assert layer.strategy.recompute == "selective" and layer.strategy.recompute_modules == ("moe",)
    ignored = from_megatron("--micro-batch-size 1 --recompute-modules mlp", world_size=8)
    assert ignored.strategy.recompute == "none" and any("no effect" in note for note in ignored.notes)
    assert ignored.strategy.recompute_modules == ()
    with pytest.raises(ConfigError, match="argument --recompute-modules: invalid choice: 'attention'"):
        from_megatron(f"{base} --recompute-modules attention", world_size=8)
    for flags, refused in (("--recompute-modules moe_act", "moe_act needs --moe-grouped-gemm"),
                           ("--recompute-modules mla_up_proj", "mla_up_proj needs --multi-latent-attention"),
                           ("--moe-shared-expert-overlap --recompute-modules shared_experts",
                            "shared_experts cannot run with --moe-shared-expert-overlap"),
                           ("--fp8-format hybrid --recompute-modules layernorm",
                            "layernorm cannot run under FP8 delayed scaling")):
        with pytest.raises(ConfigError, match=refused):
            from_megatron(f"{base} {flags}", world_size=8)


def test_megatron_flags_that_configure_the_framework_adjust_its_profile():
    """Megatron-LM's defaults are not Megatron-Core's tuned recipes: data-parallel overlap is off unless asked for,
    bf16 gradients are reduced in fp32, the precision-aware optimizer may keep bf16 moments. Each is read into the
    profile the run is priced with (``megatron:field=value``), and the export asks for what the profile prices."""
    from tessera.cost_models.profiles import profile

    def imported(flags: str, world_size: int = 8):
        return from_megatron(f"--micro-batch-size 1 --bf16 {flags}", world_size=world_size)

    assert imported("--overlap-grad-reduce").profile == "megatron"
    assert imported("").profile == "megatron:dp_overlap=false"
    halfway = imported("--use-distributed-optimizer --overlap-grad-reduce")
    assert halfway.profile == "megatron:dp_overlap=false" and any("--overlap-param-gather" in n for n in halfway.notes)
    assert imported("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather").profile == "megatron"
    optimizer = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
    tuned = imported(f"{optimizer} --grad-reduce-in-bf16 --use-precision-aware-optimizer "
                     "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
    # bf16 weights: the precision-aware optimizer keeps 16-bit remainders of the fp32 masters (store_param_remainders)
    assert tuned.profile == "megatron:gradient_bytes=2,master_bytes=2,moment_bytes=2" and tuned.unread == ()
    assert (profile(tuned.profile).gradient_bytes, profile(tuned.profile).moment_bytes) == (2, 2)
    assert imported(f"{optimizer} --use-precision-aware-optimizer --main-grads-dtype bf16").profile == \
        "megatron:gradient_bytes=2,master_bytes=2"
    fp8_masters = imported(f"{optimizer} --use-precision-aware-optimizer --fp8-format e4m3 --fp8-recipe tensorwise")
    assert fp8_masters.profile == "megatron"  # under FP8 other than delayed scaling it keeps fp32 masters
    fp8_moments = imported(f"{optimizer} --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8")
    assert "moment_bytes=2" in fp8_moments.profile and any("priced at 2 bytes" in n for n in fp8_moments.notes)
    profile(fp8_moments.profile)  # a profile the cost model takes
    fp8 = imported(f"{optimizer} --fp8-format e4m3 --fp8-param-gather --expert-model-parallel-size 8 "
                   "--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm", world_size=16)
    assert fp8.profile == "megatron-ep-overlap:fp8_params=true,fp8_all_gather=true"
    fsdp2 = from_megatron("--micro-batch-size 1 --bf16 --use-torch-fsdp2 --fp8-format e4m3 --fp8-param-gather",
                          world_size=8)
    assert "fp8_params" not in fsdp2.profile and any("turns it off" in note for note in fsdp2.notes)
    assert from_megatron("--micro-batch-size 1 --fp16 --overlap-grad-reduce", world_size=8).profile == \
        "megatron:gradient_bytes=2"  # fp16's gradients stay fp16 unless --accumulate-allreduce-grads-in-fp32
    assert from_megatron("--micro-batch-size 1 --fp16 --fp8-format hybrid --overlap-grad-reduce",
                         world_size=8).profile == "megatron:gradient_bytes=2"
    assert from_megatron("--micro-batch-size 1 --fp8-format hybrid --grad-reduce-in-bf16 --overlap-grad-reduce",
                         world_size=8).profile == "megatron"  # fp32 weights: no bf16 gradients to reduce
    fsdp = "--use-distributed-optimizer --use-megatron-fsdp --data-parallel-sharding-strategy"
    assert "dp_overlap" not in imported(f"{fsdp} optim_grads_params").profile  # FSDP overlaps its own
    for flags, message in [("--exp-avg-dtype bf16", "needs --use-precision-aware-optimizer"),
                           ("--overlap-param-gather", "needs --overlap-grad-reduce"),
                           ("--use-precision-aware-optimizer", "needs --use-distributed-optimizer"),
                           ("--accumulate-allreduce-grads-in-fp32 --use-distributed-optimizer "
                            "--use-precision-aware-optimizer --main-grads-dtype bf16", "needs --main-grads-dtype fp32"),
                           ("--fp8-format e4m3 --fp8-param-gather", "needs --use-distributed-optimizer or an FSDP"),
                           (f"{fsdp} optim_grads", "optim_grads sharding needs --overlap-grad-reduce"),
                           ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                            "--moe-layer-recompute", "Megatron-LM refuses it")]:
        with pytest.raises(ConfigError, match=message):
            imported(flags)


def test_megatron_counts_the_embedding_and_the_loss_in_the_pipeline_split_where_asked():
    """``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split`` (Megatron-Core's
    ``get_num_layers_to_build``): the split is of the blocks plus those layers, the first chunk one block short, the
    last one short. Llama 3.1 405B as Megatron-Bridge's recipe runs it: 126 blocks over PP 8 x VP 8, 1 + 62 x 2 + 1."""
    both = "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    llama = from_megatron(f"--pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 8 --num-layers 126 "
                          f"--micro-batch-size 1 {both}", world_size=64)
    assert llama.strategy.chunk_blocks == (1, *[2] * 62, 1) and llama.unread == ()
    plain = from_megatron("--pipeline-model-parallel-size 4 --num-layers 31 --micro-batch-size 1 "
                          "--account-for-embedding-in-pipeline-split", world_size=8)
    assert plain.strategy.chunk_blocks == (7, 8, 8, 8)
    per_stage = from_megatron(f"--pipeline-model-parallel-size 2 --num-layers 6 --num-layers-per-virtual-pipeline-stage 2 "
                              f"--micro-batch-size 1 {both}", world_size=8)
    assert per_stage.strategy.chunk_blocks == (1, 2, 2, 1) and per_stage.strategy.virtual_stages == 2
    assert from_megatron("--pipeline-model-parallel-size 4 --num-layers 31 --micro-batch-size 1 "
                         "--account-for-loss-in-pipeline-split", world_size=8).strategy.chunk_blocks == (8, 8, 8, 7)
    assert from_megatron(f"--num-layers 6 --micro-batch-size 1 {both}", world_size=8).strategy.chunk_blocks == ()
    for flags, message in [(f"--pipeline-model-parallel-size 4 --num-layers 30 {both.split()[0]}", "not divisible"),
                           (f"--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 4 --num-layers 14 "
                            f"{both}", "leaves the first or last chunk without a block"),
                           (f"--pipeline-model-parallel-size 2 --num-layers 8 --decoder-first-pipeline-num-layers 3 "
                            f"{both}", "Megatron-LM refuses both")]:
        with pytest.raises(ConfigError, match=message):
            from_megatron(f"{flags} --micro-batch-size 1", world_size=8)


@pytest.mark.skipif(TORCHTITAN_LLAMA3 is None, reason="torchtitan is not installed")
def test_torchtitan_fp8_converters_set_the_precision_and_scaling():
    """torchtitan 0.3 trains FP8 through the model spec's converters: ``Float8LinearConverter`` (rowwise),
    ``MXFP8LinearConverter`` (MX); read from its own config_registry file, never run."""
    def read(function: str):
        return import_config("torchtitan", f"{TORCHTITAN_LLAMA3}:{function}", world_size=8)

    rowwise, mx, plain = read("llama3_debugmodel_float8"), read("llama3_8b_mxfp8"), read("llama3_8b")
    assert (rowwise.precision, rowwise.fp8_scaling) == ("fp8", "rowwise")
    assert (mx.precision, mx.fp8_scaling) == ("fp8", "mx")
    assert (plain.precision, plain.fp8_scaling) == ("bf16", None)
    emulated = read("llama3_debugmodel_float8_emulate_lora")
    assert emulated.precision == "bf16" and any("emulation" in note for note in emulated.notes)
    assert "model_spec converter LoRAConverter" in emulated.unread
    with pytest.raises(NotModelledError, match="not NVFP4"):
        read("llama3_debugmodel_nvfp4")


def test_an_mxfp8_megatron_run_on_hopper_is_refused_through_the_cli(capsys):
    """The imported recipe reaches the workload (``cli._workload``), where the H100's catalog entry refuses MXFP8."""
    from tessera.cli import main

    flags = "--micro-batch-size 1 --global-batch-size 8 --seq-length 32 --bf16 --fp8-format hybrid --fp8-recipe mxfp8"
    assert main(["evaluate", "--model", "gpt-tiny", "--cluster", "dgx-h100:nodes=1", "--from-megatron", flags]) == 2
    err = capsys.readouterr().err
    assert "fp8_scaling=mx: H100-SXM-80GB runs delayed, current, rowwise, block (MXFP8 needs Blackwell" in err


def test_a_torchtitan_model_spec_set_again_replaces_its_converters(tmp_path):
    """A later ``model_spec`` replaces the earlier one, converters included; one given as ``Trainer.Config``'s keyword
    is read too; a partial conversion is said; torchao's tensorwise recipe is current scaling; an unknown one refused."""
    path = tmp_path / "config_registry.py"
    path.write_text(
        "def base():\n"
        "    config = Trainer.Config(training=TrainingConfig(local_batch_size=1))\n"
        "    config.model_spec = model_registry('8B', converters=[Float8LinearConverter.Config(model_compile_enabled=x)])\n"
        "    return config\n\n"
        "def replaced():\n"
        "    config = base()\n"
        "    config.model_spec = model_registry('8B')\n"
        "    return config\n\n"
        "def keyword():\n"
        "    return Trainer.Config(training=TrainingConfig(local_batch_size=1), loss=Loss.Config(),\n"
        "                          model_spec=model_registry('8B', converters=[MXFP8LinearConverter.Config(fqns=['mlp'])]))\n\n"
        "def tensorwise():\n"
        "    config = base()\n"
        "    config.model_spec = model_registry('8B', converters=[Float8LinearConverter.Config(recipe_name='tensorwise')])\n"
        "    return config\n\n"
        "def unknown():\n"
        "    config = base()\n"
        "    config.model_spec = model_registry('8B', converters=[Float8LinearConverter.Config(recipe_name='blockwise')])\n"
        "    return config\n")

    def read(function: str):
        return import_config("torchtitan", f"{path}:{function}", world_size=8)

    assert (read("base").precision, read("base").fp8_scaling) == ("fp8", "rowwise")
    assert (read("replaced").precision, read("replaced").fp8_scaling) == ("bf16", None)
    keyword = read("keyword")
    assert (keyword.precision, keyword.fp8_scaling) == ("fp8", "mx") and any("only some linears" in n for n in keyword.notes)
    assert "line 12: loss=Loss.Config()" in keyword.unread
    assert read("tensorwise").fp8_scaling == "current"
    with pytest.raises(ConfigError, match="recipe_name 'blockwise': Tessera reads rowwise"):
        read("unknown")


def test_an_older_torchtitan_toml_trains_float8_through_its_model_converters(tmp_path):
    """torchtitan's TOML files name ``[model] converters = ["float8"]`` and the recipe in ``[float8]`` (torchao's
    tensorwise when unset): read, not listed as unread, and priced as FP8."""
    (tmp_path / "f8.toml").write_text("[model]\nconverters = ['float8']\n[float8]\nrecipe_name = 'rowwise'\n"
                                      "[training]\nlocal_batch_size = 2\nseq_len = 4096\n")
    config = import_config("torchtitan", str(tmp_path / "f8.toml"), world_size=8)
    assert (config.precision, config.fp8_scaling, config.unread) == ("fp8", "rowwise", ())
    (tmp_path / "tw.toml").write_text("[model]\nconverters = ['float8']\n")
    assert import_config("torchtitan", str(tmp_path / "tw.toml"), world_size=8).fp8_scaling == "current"
