"""The exports checked by the frameworks' own rules, not by string matching (issue 20, item 4).

- torchtitan: the export's ``apply_tessera_plan`` runs on the installed torchtitan's own config dataclasses
  (``ParallelismConfig``, ``TrainingConfig``, ``CompileConfig``, the activation-checkpointing union; slotted, so a
  misspelt field fails), the result goes through torchtitan's command-line machinery (tyro with
  ``ConfigManager``'s registry, as ``ConfigManager.parse_args`` builds a ``Trainer.Config``; a value of the wrong
  type is an error here), ``ParallelDims`` checks the degrees against the world size, and ``Trainer.Config``'s
  pipeline micro-batch rule is applied. ``Trainer.Config`` itself is not built: importing ``torchtitan.trainer``
  needs ``torchdata``, which is not installed (torchtitan was installed with ``--no-deps``).
- Megatron-LM: every word of the export parses with ``megatron_parser`` (Megatron-LM ``core_v0.14.0``'s names
  and types) with nothing left over, and the release's own cross-argument rules hold (``validate_args``).
"""

import dataclasses
import shlex
import warnings

import pytest

from tessera.cost_models.types import Strategy
from tessera.planner.frameworks import export_plan
from tessera.planner.frameworks.megatron_import import megatron_parser
from test_frameworks_roundtrip import CASES, plan_like  # pytest puts this folder on sys.path

EXPORTABLE = [name for name, case in CASES.items() if case[3]["torchtitan"] != "refused"]


@pytest.fixture(scope="module")
def torchtitan():
    """torchtitan's config machinery, or a skip saying why it cannot be imported."""
    try:
        import tyro
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.config.manager import ConfigManager, custom_registry
        from torchtitan.distributed import activation_checkpoint as ac
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"torchtitan's config machinery does not import here: {exc}")
    ConfigManager()  # registers torchtitan's tyro rules on custom_registry

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Sections:
        """The ``Trainer.Config`` fields the export sets, with their torchtitan types and defaults."""

        training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
        parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
        compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
        activation_checkpoint: ac.ActivationCheckpointingConfig = dataclasses.field(default_factory=ac.SelectiveAC.Config)

    return dict(tyro=tyro, registry=custom_registry, Sections=Sections, ParallelDims=ParallelDims, ac=ac)


def apply_export(text: str, config, ac_module):
    """Run the export (Tessera's own generated text, not a user's file) on ``config``."""
    namespace = {"FullAC": ac_module.FullAC, "SelectiveAC": ac_module.SelectiveAC}
    body = "\n".join(line for line in text.splitlines() if not line.startswith("from torchtitan"))
    exec(compile(body, "<tessera torchtitan export>", "exec"), namespace)  # noqa: S102 - our own output
    return namespace["apply_tessera_plan"](config)


@pytest.mark.parametrize("name", EXPORTABLE)
def test_torchtitan_export_loads_with_torchtitans_config_machinery(name, torchtitan):
    strategy, blocks, batch, _ = CASES[name]
    plan = plan_like(strategy, blocks=blocks, global_batch=batch)
    export = export_plan(plan, "torchtitan")
    config = apply_export(export.text, torchtitan["Sections"](), torchtitan["ac"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tyro warns (here: fails) when a value does not have its field's type
        parsed = torchtitan["tyro"].cli(torchtitan["Sections"], args=[], default=config, registry=torchtitan["registry"])
    par, runs = parsed.parallelism, export.strategy
    dims = torchtitan["ParallelDims"].from_config(dataclasses.replace(par), world_size=runs.world_size)
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep) == (runs.dp, runs.tp, runs.pp, runs.cp, runs.ep)
    if par.pipeline_parallel_degree > 1:  # Trainer.Config.__post_init__'s rule
        assert parsed.training.local_batch_size % par.pipeline_parallel_microbatch_size == 0
        assert len(par.module_fqns_per_model_part) == runs.pp * runs.virtual_stages
    want = {"full": torchtitan["ac"].FullAC.Config, "selective": torchtitan["ac"].SelectiveAC.Config}.get(runs.recompute)
    assert (parsed.activation_checkpoint is None) if want is None else isinstance(parsed.activation_checkpoint, want)


def test_a_misspelt_torchtitan_field_fails_on_the_real_dataclass(torchtitan):
    plan = plan_like("dp=8,zero=3,mbs=1,recompute=full", blocks=8, global_batch=64)
    text = export_plan(plan, "torchtitan").text.replace("tensor_parallel_degree", "tensor_paralel_degree")
    with pytest.raises(AttributeError, match="tensor_paralel_degree"):
        apply_export(text, torchtitan["Sections"](), torchtitan["ac"])


def test_a_value_of_the_wrong_type_fails_torchtitans_parsing(torchtitan):
    plan = plan_like("dp=8,zero=2,mbs=1,recompute=full", blocks=8, global_batch=64)
    text = export_plan(plan, "torchtitan").text.replace("'never'", "'sometimes'")
    config = apply_export(text, torchtitan["Sections"](), torchtitan["ac"])
    with warnings.catch_warnings(), pytest.raises(UserWarning, match="fsdp-reshard-after-forward"):
        warnings.simplefilter("error")
        torchtitan["tyro"].cli(torchtitan["Sections"], args=[], default=config, registry=torchtitan["registry"])


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_export_parses_with_megatrons_argument_names(name):
    strategy, blocks, batch, _ = CASES[name]
    export = export_plan(plan_like(strategy, blocks=blocks, global_batch=batch), "megatron")
    words = shlex.split(export.text.replace("\\\n", " "), comments=True)
    args = megatron_parser().parse_args(words)  # strict: a word the release does not know fails here
    runs: Strategy = export.strategy
    # validate_args of core_v0.14.0: at most one of the virtual-pipeline arguments; selective takes no method;
    # Megatron-FSDP uses the fsdp_dtensor checkpoint format; the world is divisible by tp x pp x cp.
    assert sum(x is not None for x in (args.num_layers_per_virtual_pipeline_stage,
                                       args.num_virtual_stages_per_pipeline_rank,
                                       args.pipeline_model_parallel_layout)) <= 1
    assert args.recompute_granularity != "selective" or args.recompute_method is None
    assert not args.use_megatron_fsdp or args.ckpt_format == "fsdp_dtensor"
    assert runs.world_size % (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                              * args.context_parallel_size) == 0
    assert args.global_batch_size % (args.micro_batch_size * runs.dp) == 0
