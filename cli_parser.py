"""The ``tessera`` command line's argument parser: every verb and its options, each value checked by the
``type=`` functions of ``tessera.cli_args`` as it is parsed (``tessera.cli`` runs the verbs)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from tessera.cli_args import (
    MAX_CAPACITY_FACTOR, MAX_COUNT, MAX_GLOBAL_BATCH, MAX_LOCAL_RANKS, MAX_NODES, MAX_SEQ_LEN, cluster_file_to_write,
    file_to_write, finite_number, plan_file_to_read, report_folder, script_name, whole_number,
)
from tessera.cli_frameworks import FRAMEWORK_FORMATS, add_from_options

DEFAULT_MODEL = "llama3-8b"
DEFAULT_CLUSTER = "dgx-h100:nodes=1"
DEFAULT_SEQ_LEN = 4096



def _version() -> str:
    """The installed distribution's version (a source tree that was never installed says so)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("tessera")
    except PackageNotFoundError:
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (the value and the fix) and point at ``--help``, instead of a
    usage block of every option above it; its verbs' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every verb."""
    parser = _Parser(prog="tessera", description="Automatic parallelism planner for PyTorch training.")
    # Its own dest: a verb's --debug (default False) would otherwise overwrite this one (main ORs the two).
    parser.add_argument("--debug", dest="debug_before_verb", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=f"tessera {_version()}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    _add_plan(verbs)
    _add_evaluate(verbs)
    _add_compare(verbs)
    resume = verbs.add_parser("resume", help="re-plan a checkpointed run for the devices now available; print how "
                              "to relaunch it")
    resume.add_argument("checkpoint", help="checkpoint folder (the root given to ParallelModel.save, or a step-*)")
    resume.add_argument("--cluster", required=True, help="the devices now available, e.g. dgx-h100:nodes=3")
    resume.add_argument("--script", default="train.py", type=script_name,
                        help="training script each rank runs (default train.py)")
    resume.add_argument("--json", metavar="PATH", type=file_to_write("plan file"), help="also write the new plan as JSON")
    resume.add_argument("--model", default=None, help="the model to re-plan (default: the one the checkpoint names; a "
                        "factory named there, file.py:fn or module:fn, runs only if given here or trusted)")
    resume.add_argument("--trust-model-factory", action="store_true",
                        help="import and run the model factory the checkpoint's plan.json names (only for "
                        "checkpoints you or someone you trust wrote)")
    resume.add_argument("--debug", action="store_true", help="show tracebacks")
    export = verbs.add_parser("export", help="write a checkpoint's model weights as one plain torch.save state dict")
    export.add_argument("checkpoint", help="checkpoint folder (a root: its newest intact checkpoint)")
    export.add_argument("out", help="file to write, e.g. model.pt (loads with model.load_state_dict(torch.load(out)))")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.add_argument("--debug", action="store_true", help="show tracebacks")
    _add_launch(verbs)
    _add_presets(verbs)
    _add_profile(verbs)
    return parser


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def _add_plan(verbs: argparse._SubParsersAction) -> None:
    plan = verbs.add_parser("plan", help="search for the fastest strategy that fits and print it")
    _add_planning_args(plan, formats=("table", "json", "md", "html", *FRAMEWORK_FORMATS))
    plan.add_argument("--out", metavar="DIR", type=report_folder, help="with --format md|html: folder for the report, "
                      "its charts and plan.json (default tessera-report); other files in it are left alone, and a file of "
                      "one of those names that Tessera did not write is refused")
    plan.add_argument("--fix", metavar="STR", help="pin strategy fields and search the rest, e.g. tp=8,pp=4")
    plan.add_argument("--top", type=whole_number(unit="runners-up", at_least=0, at_most=MAX_COUNT), default=5,
                      help="runners-up to show (default 5; 0 for none)")
    plan.add_argument("--json", metavar="PATH", type=file_to_write("plan file"), help="also write the plan as JSON")
    _add_reliability_args(plan)


def _add_evaluate(verbs: argparse._SubParsersAction) -> None:
    evaluate = verbs.add_parser("evaluate", help="predict one strategy; fields left out are filled by the planner")
    _add_planning_args(evaluate)
    source = evaluate.add_mutually_exclusive_group(required=True)
    source.add_argument("--strategy", help="e.g. tp=8,pp=8,dp=16,mbs=1,schedule=interleaved:2")
    add_from_options(source)
    evaluate.add_argument("--mtp-layers", metavar="N", type=whole_number(unit="modules", at_least=0, at_most=MAX_COUNT),
                          default=0, help="multi-token-prediction modules the framework trains after the blocks "
                          "(DeepSeek-V3: 1); needs --runs-on a framework that trains them")
    evaluate.add_argument("--runs-on", metavar="FRAMEWORK", default=None,
                          help="price it as this framework runs it (torchtitan, megatron, deepspeed, ...: "
                          "cost_models/profiles.py), adjusted as its configuration sets it where it does "
                          "(megatron:dp_overlap=false,moment_bytes=2); default: the --from-* config's framework, "
                          "else Tessera's runtime")


def _add_compare(verbs: argparse._SubParsersAction) -> None:
    compare = verbs.add_parser("compare", help="Tessera's plan next to hand-tuned strategies on the same cost model")
    _add_planning_args(compare)
    compare.add_argument("--baseline", action="append", default=[], metavar="STR",
                         help="a hand-tuned strategy, e.g. tp=8,pp=8,dp=16,mbs=1 (repeat for more; fields left out "
                         "are filled by the planner)")
    compare.add_argument("--baseline-from", action="append", nargs=2, default=[], metavar=("FRAMEWORK", "SOURCE"),
                         help="a baseline read from a framework's configuration: megatron ARGS, torchtitan FILE or "
                         "deepspeed FILE (as evaluate's --from-*; repeat for more)")


def _add_launch(verbs: argparse._SubParsersAction) -> None:
    launch = verbs.add_parser("launch", help="print the torchrun (or SLURM) command lines that run a plan")
    launch.add_argument("plan", type=plan_file_to_read, help="plan JSON written by 'tessera plan --json PATH'")
    launch.add_argument("--script", default="train.py", type=script_name,
                        help="training script each rank runs (default train.py)")
    launch.add_argument("--scheduler", choices=("torchrun", "slurm"), default="torchrun")
    launch.add_argument("--nodes", type=whole_number(unit="nodes", at_most=MAX_NODES), default=None,
                        help="default: the plan's cluster")
    launch.add_argument("--procs-per-node", type=whole_number(unit="processes", at_most=MAX_NODES), default=None,
                        help="default: the plan's cluster")
    _add_debug(launch)


def _add_presets(verbs: argparse._SubParsersAction) -> None:
    _add_debug(verbs.add_parser("presets", help="list model and cluster presets"))


def _add_profile(verbs: argparse._SubParsersAction) -> None:
    profile = verbs.add_parser("profile", help="measure this machine's fabric and devices; write a cluster file")
    profile.add_argument("--nproc", type=whole_number(unit="ranks", at_least=2, at_most=MAX_LOCAL_RANKS), default=2,
                         help="local ranks to spawn (default 2; NCCL if that many GPUs)")
    profile.add_argument("--out", type=cluster_file_to_write, default="cluster.yaml",
                         help="cluster file to write (default cluster.yaml)")
    profile.add_argument("--quick", action="store_true", help="reduced size sweep (seconds; for smoke tests)")
    profile.add_argument("--trials", type=whole_number(unit="trials", at_most=MAX_COUNT), default=None,
                         help="trials per measured point (default 7)")
    _add_debug(profile)


def _add_planning_args(parser: argparse.ArgumentParser, *, formats: Sequence[str] = ("table", "json")) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model preset (default {DEFAULT_MODEL}); see 'tessera presets'")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, help=f"cluster preset or YAML file (default {DEFAULT_CLUSTER})")
    parser.add_argument("--global-batch", type=whole_number(unit="sequences", at_most=MAX_GLOBAL_BATCH), default=None,
                        help="sequences per step (default: 8 per device)")
    parser.add_argument("--seq-len", type=whole_number(unit="tokens", at_most=MAX_SEQ_LEN), default=None,
                        help=f"tokens per sequence (default: an imported config's, else {DEFAULT_SEQ_LEN} or a built-in "
                        "model's own length where shorter)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"), default=None,
                        help="default bf16 on GPUs, fp32 on CPU; fp8: the blocks' linears on FP8 units "
                             "(torchao's float8 linears at run time)")
    parser.add_argument("--fp8-scaling", choices=("delayed", "current", "rowwise", "block", "mx"), default=None,
                        help="how FP8 tensors are scaled (with --precision fp8; default current)")
    capacity = finite_number(noun="a load factor", above=0, at_most=MAX_CAPACITY_FACTOR)
    parser.add_argument("--expert-capacity", type=capacity, default=None, metavar="F",
                        help="MoE load factor: each expert is planned for top_k * tokens / experts * F token slots "
                        "(routing imbalance headroom; default: the model's capacity_factor, 1.0)")
    parser.add_argument("--format", choices=formats, default="table", help=f"output format: {', '.join(formats)} (default table)")
    _add_debug(parser)


def _add_reliability_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reliability (opt-in: printed when --mtbf-hours is given)")
    group.add_argument("--mtbf-hours", type=finite_number(noun="a number of hours", above=0, at_most=1e9),
                       default=None, help="mean time between failures of the whole job")
    group.add_argument("--checkpoint-every", type=whole_number(unit="steps", at_most=MAX_COUNT), default=None,
                       metavar="STEPS", help="checkpoint interval in steps (default: the Young/Daly optimum)")
    group.add_argument("--checkpoint-gbps", type=finite_number(noun="a bandwidth in GB/s", above=0, at_most=1e6),
                       default=None, metavar="GB/S",
                       help="checkpoint write bandwidth per device (default 0.12: Llama 3's 2 TB/s for 16K GPUs)")
    group.add_argument("--async-checkpoint", action="store_true", help="asynchronous saves (dcp.async_save)")
    group.add_argument("--restart-minutes", type=finite_number(noun="a number of minutes", at_least=0, at_most=1e6),
                       default=None, help="relaunch time after a failure, on top of reading the checkpoint back (default 0)")
