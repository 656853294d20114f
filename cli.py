"""``tessera`` command line: plan, evaluate, presets.

Errors Tessera raises on purpose print as one line and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

DEFAULT_MODEL = "llama3-8b"
DEFAULT_CLUSTER = "dgx-h100:nodes=1"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every verb."""
    parser = argparse.ArgumentParser(prog="tessera", description="Automatic parallelism planner for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    verbs = parser.add_subparsers(dest="verb", required=True)
    plan = verbs.add_parser("plan", help="search for the fastest strategy that fits and print it")
    _add_planning_args(plan, formats=("table", "json", "md", "html"))
    plan.add_argument("--out", metavar="DIR", help="with --format md|html: folder for the report, its charts and "
                      "plan.json (default tessera-report)")
    plan.add_argument("--fix", metavar="STR", help="pin strategy fields and search the rest, e.g. tp=8,pp=4")
    plan.add_argument("--top", type=int, default=5, help="runners-up to show (default 5)")
    plan.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    _add_reliability_args(plan)
    evaluate = verbs.add_parser("evaluate", help="predict one strategy; fields left out are filled by the planner")
    _add_planning_args(evaluate)
    evaluate.add_argument("--strategy", required=True, help="e.g. tp=8,pp=8,dp=16,mbs=1,schedule=interleaved:2")
    compare = verbs.add_parser("compare", help="Tessera's plan next to hand-tuned strategies on the same cost model")
    _add_planning_args(compare)
    compare.add_argument("--baseline", action="append", required=True, metavar="STR",
                         help="a hand-tuned strategy, e.g. tp=8,pp=8,dp=16,mbs=1 (repeat for more; fields left out "
                         "are filled by the planner)")
    resume = verbs.add_parser("resume", help="re-plan a checkpointed run for the devices now available; print how "
                              "to relaunch it")
    resume.add_argument("checkpoint", help="checkpoint folder (the root given to ParallelModel.save, or a step-*)")
    resume.add_argument("--cluster", required=True, help="the devices now available, e.g. dgx-h100:nodes=3")
    resume.add_argument("--script", default="train.py", help="training script each rank runs (default train.py)")
    resume.add_argument("--json", metavar="PATH", help="also write the new plan as JSON")
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
    launch = verbs.add_parser("launch", help="print the torchrun (or SLURM) command lines that run a plan")
    launch.add_argument("plan", help="plan JSON written by 'tessera plan --json PATH'")
    launch.add_argument("--script", default="train.py", help="training script each rank runs (default train.py)")
    launch.add_argument("--scheduler", choices=("torchrun", "slurm"), default="torchrun")
    launch.add_argument("--nodes", type=int, default=None, help="default: the plan's cluster")
    launch.add_argument("--procs-per-node", type=int, default=None, help="default: the plan's cluster")
    launch.add_argument("--debug", action="store_true", help="show tracebacks")
    presets = verbs.add_parser("presets", help="list model and cluster presets")
    presets.add_argument("--debug", action="store_true", help="show tracebacks")
    profile = verbs.add_parser("profile", help="measure this machine's fabric and devices; write a cluster file")
    profile.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2; NCCL if that many GPUs)")
    profile.add_argument("--out", default="cluster.yaml", help="cluster file to write (default cluster.yaml)")
    profile.add_argument("--quick", action="store_true", help="reduced size sweep (seconds; for smoke tests)")
    profile.add_argument("--trials", type=int, default=None, help="trials per measured point (default 7)")
    profile.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _add_planning_args(parser: argparse.ArgumentParser, *, formats: Sequence[str] = ("table", "json")) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model preset (default {DEFAULT_MODEL}); see 'tessera presets'")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, help=f"cluster preset or YAML file (default {DEFAULT_CLUSTER})")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 8 per device)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 on GPUs, fp32 on CPU")
    parser.add_argument("--expert-capacity", type=float, default=None, metavar="F",
                        help="MoE load factor: each expert is planned for top_k * tokens / experts * F token slots "
                        "(routing imbalance headroom; default: the model's capacity_factor, 1.0)")
    parser.add_argument("--format", choices=formats, default="table", help=f"output format: {', '.join(formats)} (default table)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script."""
    args = build_parser().parse_args(argv)
    console = Console()
    from tessera.errors import TesseraError  # after parsing, so --help stays fast

    try:
        return _run(args, console)
    except TesseraError as exc:
        if args.debug:
            raise
        Console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.verb == "resume":
        return _resume(args, console)
    if args.verb == "export":
        return _export(args, console)
    if args.verb == "launch":
        return _launch(args)
    if args.verb == "presets":
        return _print_presets(console)
    if args.verb == "profile":
        return _profile(args, console)
    if args.verb == "evaluate":
        return _evaluate(args, console)
    if args.verb == "compare":
        return _compare(args, console)
    return _plan(args, console)


def _workload(args: argparse.Namespace) -> dict:
    """The model, cluster and training arguments shared by plan and evaluate."""
    from tessera.topology import load_cluster

    cluster = load_cluster(args.cluster)
    return dict(
        model=args.model, cluster=cluster, global_batch=args.global_batch or 8 * cluster.num_devices,
        seq_len=args.seq_len, precision=args.precision, expert_capacity_factor=args.expert_capacity,
    )


def _search_with_progress(args: argparse.Namespace, console: Console):
    """``tessera.plan`` with a progress bar over the candidate strategies (transient: gone when done)."""
    import tessera
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"capturing {args.model}", total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, description="estimating strategies", completed=done, total=total)

        return tessera.plan(**_workload(args), strategy=args.fix, top=args.top, progress=advance)


def _plan(args: argparse.Namespace, console: Console) -> int:
    import tessera
    from tessera.errors import ConfigError
    from tessera.report import print_plan

    if args.out and args.format not in ("md", "html"):
        raise ConfigError("--out DIR writes a report: add --format md or --format html")
    plan = _search_with_progress(args, console)
    if args.format == "json":
        print(plan.to_json())
    else:
        print_plan(plan, console)
        if args.mtbf_hours is not None:
            _print_reliability(plan, args, console)
    if args.json:
        plan.to_json(args.json)
        console.print(f"plan written to {args.json}")
    if args.format in ("md", "html"):
        _write_report(plan, args.format, out=args.out or "tessera-report", console=console)
    return 0


def _write_report(plan, kind: str, *, out: str, console: Console) -> None:
    """Write ``report.md`` (with PNG charts) or a self-contained ``report.html``, and ``plan.json``, to ``out``."""
    from pathlib import Path

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "plan.json"
    plan.to_json(plan_path)
    report = folder / f"report.{kind}"
    render = plan.to_markdown if kind == "md" else plan.to_html
    render(report, plan_path=str(plan_path))
    console.print(f"report written to {report} (plan: {plan_path})")


def _compare(args: argparse.Namespace, console: Console) -> int:
    import tessera
    from tessera.report import print_comparison

    with console.status(f"capturing {args.model}, searching and evaluating {len(args.baseline)} baseline(s)..."):
        comparison = tessera.compare(**_workload(args), baselines=args.baseline)
    if args.format == "json":
        print(comparison.model_dump_json(indent=2))
    else:
        print_comparison(comparison, console)
    return 0


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    import json

    import tessera
    from tessera.report import estimate_json, print_estimate

    with console.status(f"capturing {args.model} and estimating..."):
        strategy, estimate = tessera.evaluate(**_workload(args), strategy=args.strategy)
    if args.format == "json":
        print(json.dumps(estimate_json(strategy, estimate), indent=2))
    else:
        print_estimate(strategy, estimate, console)
    return 0


def _add_reliability_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reliability (opt-in: printed when --mtbf-hours is given)")
    group.add_argument("--mtbf-hours", type=float, default=None, help="mean time between failures of the whole job")
    group.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                       help="checkpoint interval in steps (default: the Young/Daly optimum)")
    group.add_argument("--checkpoint-gbps", type=float, default=None, metavar="GB/S",
                       help="checkpoint write bandwidth per device (default 0.12: Llama 3's 2 TB/s for 16K GPUs)")
    group.add_argument("--async-checkpoint", action="store_true", help="asynchronous saves (dcp.async_save)")
    group.add_argument("--restart-minutes", type=float, default=0.0,
                       help="relaunch time after a failure, on top of reading the checkpoint back (default 0)")


def _print_reliability(plan, args: argparse.Namespace, console: Console) -> None:
    """Checkpoint cost, the Young/Daly interval and the expected time lost to failures (cost_models.reliability)."""
    from tessera.cost_models import reliability as r
    from tessera.errors import ConfigError

    if args.mtbf_hours <= 0 or (args.checkpoint_every is not None and args.checkpoint_every < 1):
        raise ConfigError("--mtbf-hours must be positive and --checkpoint-every at least 1 step")
    bandwidth = args.checkpoint_gbps * 1e9 if args.checkpoint_gbps else r.LLAMA3_STORAGE_BYTES_PER_S_PER_GPU
    cost = r.checkpoint_cost(plan.param_count, num_devices=plan.strategy.world_size,
                             write_bytes_per_s_per_device=bandwidth, asynchronous=args.async_checkpoint)
    step_s = plan.estimate.step_time_s
    interval = args.checkpoint_every * step_s if args.checkpoint_every else None
    estimate = r.reliability_estimate(cost, mtbf_s=args.mtbf_hours * 3600, interval_s=interval,
                                      restart_s=cost.write_time_s + args.restart_minutes * 60)
    console.print(estimate.summary(step_time_s=step_s), highlight=False, soft_wrap=True)


def _resume(args: argparse.Namespace, console: Console) -> int:
    """Re-plan the checkpoint's model and training for ``--cluster``; print the plan and the relaunch lines."""
    import tessera
    from tessera.api import checkpoint_model
    from tessera.report import print_plan
    from tessera.runtime.elastic import saved_plan
    from tessera.runtime.launch import launch_commands

    saved = saved_plan(args.checkpoint)
    model = checkpoint_model(saved, args.checkpoint, model=args.model, trust_model_factory=args.trust_model_factory)
    training = saved.training
    plan = tessera.plan(model, args.cluster, global_batch=training.global_batch, seq_len=training.seq_len,
                        precision=training.precision)
    console.print(f"saved under {saved.strategy.to_string()} on {saved.strategy.world_size} devices; "
                  f"re-planned for {plan.cluster}:", highlight=False, soft_wrap=True, markup=False)
    print_plan(plan, console)
    if args.json:
        plan.to_json(args.json)
    print("\n".join(launch_commands(plan, args.script, script_args=["--resume-from", args.checkpoint])))
    return 0


def _export(args: argparse.Namespace, console: Console) -> int:
    from tessera.runtime.checkpoint import export_model_state_dict

    out = export_model_state_dict(args.checkpoint, args.out, overwrite=args.overwrite)
    console.print(f"model weights written to {out}", markup=False, highlight=False)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tessera.errors import ConfigError
    from tessera.planner.plan import Plan
    from tessera.runtime.launch import launch_commands

    if not Path(args.plan).exists():
        raise ConfigError(f"plan file {args.plan} does not exist; write one with 'tessera plan ... --json {args.plan}'")
    plan = Plan.from_json(Path(args.plan))
    lines = launch_commands(plan, args.script, nodes=args.nodes, procs_per_node=args.procs_per_node,
                            scheduler=args.scheduler, script_args=["--plan", args.plan])
    print("\n".join(lines))
    return 0


def _print_presets(console: Console) -> int:
    from tessera.models import list_presets
    from tessera.topology import preset_names

    console.print("models:   " + ", ".join(list_presets()))
    console.print("clusters: " + ", ".join(f"{name}:{'ranks' if name == 'cpu' else 'nodes'}=N" for name in preset_names()))
    return 0


def _profile(args: argparse.Namespace, console: Console) -> int:
    """Spawn ``--nproc`` local ranks, measure collectives and the device, fit, write ``--out``."""
    import time

    from tessera.errors import ClusterSpecError
    from tessera.topology.profiler import ProfileSweep, profile_local

    if not args.out.endswith((".yaml", ".yml")):
        raise ClusterSpecError(f"--out must end in .yaml or .yml so load_cluster can read it, got {args.out!r}")
    sweep = ProfileSweep.quick() if args.quick else ProfileSweep()
    if args.trials is not None:
        sweep = sweep.model_copy(update={"trials": args.trials})
    started = time.perf_counter()
    result = profile_local(args.nproc, sweep=sweep, out=args.out)
    for level in result.cluster.levels:
        console.print(f"{level.name}: {level.group_size} ranks, latency {level.latency_s * 1e6:.0f} us, "
                      f"bandwidth {level.bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank (best collective)")
    device = result.cluster.device
    console.print(f"device {device.name}: fp32 {device.peak_flops('fp32') / 1e9:.1f} GFLOP/s, memory "
                  f"{device.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s per rank")
    console.print(f"cluster file written to {args.out} in {time.perf_counter() - started:.1f} s; "
                  f"use it with --cluster {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
