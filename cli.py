"""``tessera`` command line: plan, evaluate, compare, resume, export, launch, profile, presets.

Every value is checked where it enters, before any long work:

- numbers and paths by the argparse ``type=`` functions of ``tessera.cli_args``; a bad one ends in
  argparse's own line ``tessera VERB: error: argument --NAME: ...`` after the usage, exit 2. Sizes are
  bounded (``cli_args.MAX_GLOBAL_BATCH``, ``MAX_SEQ_LEN``...), so an absurd one is refused at once instead of searching
  for hours;
- paths to write (``--json``, ``--out``) must name a file, or for a report a folder, that can be created
  there, and every file is written whole or not at all (``tessera.files``);
- user text (model, cluster and strategy strings, paths) is printed literally, never read as rich markup or emoji.

Errors Tessera raises on purpose (``TesseraError``) print as one line ``error: ...`` and exit 2. Anything else
is a bug: one line ``error: internal error (...)``, exit 1. Ctrl-C exits 130 quietly. ``--debug``, before or
after the verb, shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from tessera.cli_args import MAX_GLOBAL_BATCH
from tessera.topology.validation import printable
from tessera.cli_frameworks import FRAMEWORK_FORMATS, from_sources, import_configs, training_from
from tessera.cli_parser import DEFAULT_SEQ_LEN, build_parser

INTERNAL_ERROR_CHARS = 200
"""How much of an unexpected exception's message the one-line internal error shows."""


# ----------------------------------------------------------------------------------------- running a verb


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script: the verb's exit status (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad argument (2): argparse has printed the usage and one line
        return stop.code if isinstance(stop.code, int) else 2
    debug = args.debug or args.debug_before_verb
    try:
        return _run(args, Console(emoji=False))
    except KeyboardInterrupt:
        if debug:
            raise
        return 130
    except Exception as exc:
        if debug:
            raise
        return _report_error(exc)


def _report_error(exc: Exception) -> int:
    """Print ``exc`` as one ``error:`` line on stderr; 2 for an error Tessera raised on purpose, 1 for a bug."""
    from tessera.errors import TesseraError

    message = printable(" ".join(str(exc).split()))
    if not isinstance(exc, TesseraError):
        if len(message) > INTERNAL_ERROR_CHARS:
            message = message[: INTERNAL_ERROR_CHARS - 3] + "..."
        message = f"internal error ({type(exc).__name__}: {message}); rerun with --debug for the traceback"
    # Text, not a markup string: the message quotes user input ('foo[/bar]', 'hf:llama:'), shown as typed.
    Console(stderr=True, emoji=False, highlight=False).print(Text.assemble(("error:", "red"), " ", message),
                                                             soft_wrap=True)
    return 2 if isinstance(exc, TesseraError) else 1


def _run(args: argparse.Namespace, console: Console) -> int:
    verbs = {"plan": _plan, "evaluate": _evaluate, "compare": _compare, "resume": _resume, "export": _export,
             "launch": _launch, "presets": _print_presets, "profile": _profile}
    return verbs[args.verb](args, console)


def _say(console: Console, text: str) -> None:
    """Print a line that may hold user text (paths, names) exactly as it is."""
    console.print(printable(text), markup=False, highlight=False, soft_wrap=True)



def _workload(args: argparse.Namespace, *strategies: str | None, imported: Sequence = ()) -> dict:
    """The model, cluster and training arguments shared by plan, evaluate and compare; the global batch, sequence
    length and precision not given as options come from the ``imported`` framework configs (which must agree).

    The cluster, a built-in model spec and the ``strategies`` strings are checked here, before ``tessera.api``
    (and torch, seconds to import) is loaded, so a bad one fails at once."""
    from tessera.cost_models import Strategy
    from tessera.errors import ConfigError
    from tessera.topology import load_cluster

    cluster = load_cluster(args.cluster)
    positions = _check_model_spec(args.model)
    for text in filter(None, strategies):
        Strategy.parse_fields(text)
    given = training_from(args, imported)
    global_batch = 8 * cluster.num_devices if given["global_batch"] is None else given["global_batch"]
    if global_batch > MAX_GLOBAL_BATCH:
        raise ConfigError(f"the default global batch (8 per device) on {cluster.num_devices:,} devices is "
                          f"{global_batch:,} sequences, past Tessera's bound of {MAX_GLOBAL_BATCH:,}; pass --global-batch")
    seq_len = given["seq_len"] or min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN)
    unstated = [f"{what} {value}" for what, value, key in (("global batch", global_batch, "global_batch"),
                                                           ("sequence length", seq_len, "seq_len"))
                if given[key] is None]
    if imported and unstated:  # a config that does not state them (DeepSpeed's has no sequence length)
        _say(Console(stderr=True), f"  not in the config: {', '.join(unstated)} taken as Tessera's default "
                                   "(pass --global-batch / --seq-len to set them)")
    return dict(
        model=args.model, cluster=cluster, global_batch=global_batch, seq_len=seq_len,
        precision=given["precision"], expert_capacity_factor=args.expert_capacity, fp8_scaling=given["fp8_scaling"],
    )



def _imported(args: argparse.Namespace, sources: Sequence[tuple[str, str]]) -> list:
    """The framework configs ``sources`` name, read for ``--cluster``'s devices (before any capture)."""
    from tessera.topology import load_cluster

    return import_configs(sources, world_size=load_cluster(args.cluster).num_devices) if sources else []


def _check_model_spec(spec: str) -> int | None:
    """A built-in spec (preset, family, overrides) or a plain unknown name fails here, without torch; Hugging Face
    and factory specs are checked when they are built (``tessera.planner.model_source``). Returns a built-in
    model's sequence length (its position table's, for a default ``--seq-len`` it covers)."""
    from tessera.models import is_builtin_spec, model_config

    text = spec.strip()
    if is_builtin_spec(text) or ":" not in text:
        return model_config(text).seq_len
    return None


def _search_with_progress(args: argparse.Namespace):
    """``tessera.plan`` with a progress bar on stderr over the candidate strategies (transient: gone when done)."""
    import tessera
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    workload = _workload(args, args.fix)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    progress_console = Console(stderr=True, emoji=False)  # stdout holds only the result (a plan, a config, JSON)
    with Progress(*columns, console=progress_console, transient=True) as bar:
        task = bar.add_task(f"capturing {escape(args.model)}", total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, description="estimating strategies", completed=done, total=total)

        return tessera.plan(**workload, strategy=args.fix, top=args.top, progress=advance)


def _plan(args: argparse.Namespace, console: Console) -> int:
    from tessera.files import write_text_atomically

    _check_plan_options(args)
    plan = _search_with_progress(args)
    from tessera.report import print_plan  # imports the charts: only once there is a plan
    if args.format == "json":
        print(plan.to_json())
    elif args.format in FRAMEWORK_FORMATS:
        import tessera
        from tessera.cli_frameworks import print_export

        print_export(plan, args.format, console=console,
                     evaluate=lambda strategy, runs_on: tessera.evaluate(**_workload(args), strategy=strategy,
                                                                         runs_on=runs_on))
    else:
        print_plan(plan, console, launch=_launch_line(plan, args))
        if args.mtbf_hours is not None:
            _print_reliability(plan, args, console)
    if args.json:
        write_text_atomically(args.json, plan.to_json(), what="plan file")
        machine_readable = args.format in ("json", *FRAMEWORK_FORMATS)  # stdout stays parseable
        _say(Console(stderr=True, emoji=False) if machine_readable else console, f"plan written to {args.json}")
    if args.format in ("md", "html"):
        _write_report(plan, args.format, out=args.out or "tessera-report", console=console)
    return 0


def _launch_line(plan, args: argparse.Namespace) -> str:
    """The table's torchrun line, reading the plan's JSON where this run writes it (``--json``, or the report
    folder's ``plan.json``), else saying how to write it."""
    from tessera.planner.plan_facts import cluster_layout, launch_command

    layout = cluster_layout(plan)
    written = args.json or (str(Path(args.out or "tessera-report") / "plan.json") if args.format in ("md", "html") else None)
    line = launch_command(nodes=layout.hosts, devices_per_node=layout.per_host, plan_path=written or "plan.json")
    return line if written else f"{line} (write plan.json with --json plan.json)"


def _check_plan_options(args: argparse.Namespace) -> None:
    """Options that only mean something together, refused before the search rather than ignored after it."""
    from tessera.errors import ConfigError
    from tessera.files import check_writable_file

    if args.out and args.format not in ("md", "html"):
        raise ConfigError("--out DIR writes a report: add --format md or --format html")
    reliability = {"--checkpoint-every": args.checkpoint_every, "--checkpoint-gbps": args.checkpoint_gbps,
                   "--restart-minutes": args.restart_minutes, "--async-checkpoint": args.async_checkpoint or None}
    given = [name for name, value in reliability.items() if value is not None]
    if given and args.mtbf_hours is None:
        raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to the reliability "
                          "estimate: add --mtbf-hours H")
    if args.mtbf_hours is not None and args.format in ("json", *FRAMEWORK_FORMATS):
        raise ConfigError(f"--mtbf-hours prints a reliability table, which --format {args.format} leaves out: use "
                          "--format table, md or html")
    if args.format in ("md", "html") and (folder := Path(args.out or "tessera-report")).is_dir():
        from tessera.files import written_by_tessera_beside
        from tessera.planner.explain import REPORT_CHARTS
        from tessera.planner.explain_plots import REPORT_MD

        for name in ("plan.json", f"report.{args.format}"):
            check_writable_file(folder / name, what="report file")
        for chart in (REPORT_CHARTS if args.format == "md" else ()):  # an earlier version's charts carry no mark
            path = folder / f"{chart}.png"
            check_writable_file(path, what="report file", replace_any=written_by_tessera_beside(path, folder / REPORT_MD))


def _write_report(plan, kind: str, *, out: str, console: Console) -> None:
    """Write ``report.md`` (with PNG charts) or a self-contained ``report.html``, and ``plan.json``, into ``out``.

    Only those files are written, each renamed into place whole; nothing else in ``out`` is touched.
    """
    from tessera.errors import ConfigError
    from tessera.files import write_text_atomically
    from tessera.planner.explain import write_html, write_markdown

    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create report folder {out}: {error.strerror or error}; choose another --out") from None
    plan_path = write_text_atomically(folder / "plan.json", plan.to_json(), what="plan file")
    report = (write_markdown if kind == "md" else write_html)(plan, folder / f"report.{kind}", plan_path=str(plan_path))
    _say(console, f"report written to {report} (plan: {plan_path})")


def _compare(args: argparse.Namespace, console: Console) -> int:
    import tessera
    from tessera.planner.frameworks.common import pin_string

    from tessera.errors import ConfigError

    if not args.baseline and not args.baseline_from:
        raise ConfigError("compare needs a baseline: --baseline STR or --baseline-from FRAMEWORK SOURCE")
    imported = _imported(args, [tuple(pair) for pair in args.baseline_from])
    if any(config.mtp_layers for config in imported):
        from tessera.errors import NotModelledError

        raise NotModelledError("a --baseline-from configuration trains multi-token-prediction modules, which Tessera's "
                               "plan beside it would not; evaluate it alone: tessera evaluate --from-megatron ...")
    workload = _workload(args, *args.baseline, imported=imported)
    from tessera.runtime.float8 import runtime_scaling

    scaling = workload["fp8_scaling"]
    if workload["precision"] == "fp8" and scaling is not None and runtime_scaling(scaling) != scaling:
        _say(Console(stderr=True, emoji=False), "note: Tessera's plan is priced at current FP8 scaling, which its "
             f"runtime runs; the baselines at {scaling} scaling, as their framework runs it")
    baselines = [*args.baseline, *(pin_string(config.strategy) for config in imported)]  # every field, as stated
    with console.status(f"capturing {escape(args.model)}, searching and evaluating {len(baselines)} baseline(s)..."):
        comparison = tessera.compare(**workload, baselines=baselines, baselines_run_on=[
            *(["tessera"] * len(args.baseline)), *(config.profile for config in imported)])
    from tessera.report import print_comparison  # imports the search and charts: only once there is a result
    if args.format == "json":
        print(comparison.model_dump_json(indent=2))
    else:
        print_comparison(comparison, console)
    return 0


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    import json

    import tessera
    from tessera.planner.frameworks.common import pin_string

    imported = _imported(args, from_sources(args))
    workload = _workload(args, args.strategy, imported=imported)
    requested = args.strategy or pin_string(imported[0].strategy)  # every field pinned, as the config states it
    runs_on = args.runs_on if args.runs_on is not None else (imported[0].profile if imported else "tessera")
    mtp_layers = args.mtp_layers or (imported[0].mtp_layers if imported else 0)
    from tessera.cost_models.profiles import profile

    profile(runs_on)  # an unknown framework fails here, before torch is imported
    if mtp_layers and runs_on == "tessera":
        from tessera.errors import NotModelledError

        raise NotModelledError(f"{mtp_layers} multi-token-prediction modules: Tessera's runtime trains none; price a "
                               "framework that does with --runs-on (e.g. --runs-on megatron)")
    with console.status(f"capturing {escape(args.model)} and estimating..."):
        evaluation = tessera.evaluate(**workload, strategy=requested, runs_on=runs_on, mtp_layers=mtp_layers,
                                      blocks=imported[0].layers if imported else None)
    (strategy, estimate), band = evaluation, evaluation.band
    from tessera.report import estimate_json, print_estimate  # imports the search and charts: once there is a result
    if args.format == "json":
        print(json.dumps({**estimate_json(strategy, estimate, band=band), "runs_on": runs_on, "mtp_layers": mtp_layers},
                         indent=2))
    else:
        print_estimate(strategy, estimate, console, band=band)
        if runs_on != "tessera":
            modules = f", with {mtp_layers} multi-token-prediction module(s) after the blocks" if mtp_layers else ""
            console.print(f"priced as {runs_on} runs it (cost_models/profiles.py){modules}, not as Tessera's runtime "
                          "would", highlight=False)
    return 0


def _print_reliability(plan, args: argparse.Namespace, console: Console) -> None:
    """Checkpoint cost, the Young/Daly interval and the expected time lost to failures (cost_models.reliability),
    then the same with in-memory snapshots (runtime.snapshots) and disk as the second line.

    The options are validated where they are parsed (positive, finite, bounded)."""
    from tessera.cost_models import reliability as r
    from tessera.topology import load_cluster

    bandwidth = args.checkpoint_gbps * 1e9 if args.checkpoint_gbps is not None else r.LLAMA3_STORAGE_BYTES_PER_S_PER_GPU
    step_s = plan.estimate.step_time_s
    cluster = load_cluster(args.cluster)
    disk_only, with_snapshots = r.snapshot_plan(
        plan.param_count, num_devices=plan.strategy.world_size, devices_per_node=cluster.host_size,
        step_time_s=step_s, mtbf_s=args.mtbf_hours * 3600, write_bytes_per_s_per_device=bandwidth,
        asynchronous=args.async_checkpoint, disk_interval_s=args.checkpoint_every * step_s if args.checkpoint_every else None,
        relaunch_s=(args.restart_minutes or 0.0) * 60, host_rate=r.host_snapshot_rate(cluster.device))
    if disk_only.waste_fraction >= 1:  # the tables would print shares past 100%: say what it means instead
        interval = f"a checkpoint every {disk_only.interval_s / step_s:,.0f} steps" if args.checkpoint_every else "checkpoints"
        fix = "checkpoint more often (--checkpoint-every) or check" if args.checkpoint_every else "check"
        console.print(f"Reliability: no progress. At --mtbf-hours {args.mtbf_hours:g} the job fails every "
                      f"{args.mtbf_hours * 3600:,.0f} s on average, while a step takes {step_s:,.1f} s and {interval} "
                      f"with the restart cost more than that; {fix} --mtbf-hours (the whole job's mean time between "
                      "failures)", highlight=False, soft_wrap=True)
        return
    console.print(disk_only.summary(step_time_s=step_s), highlight=False, soft_wrap=True)
    console.print(with_snapshots.summary(), highlight=False, soft_wrap=True)


def _resume(args: argparse.Namespace, console: Console) -> int:
    """Re-plan the checkpoint's model and training for ``--cluster``; print the plan and the relaunch lines."""
    from tessera.runtime.saved_plans import saved_plan

    saved = saved_plan(args.checkpoint)  # before the planner and runtime are imported: a bad folder fails fast
    import tessera
    from tessera.api import checkpoint_model
    from tessera.planner.model_source import absolute_spec, runs_user_code
    from tessera.report import print_plan
    from tessera.runtime.launch import launch_commands

    model = checkpoint_model(saved, args.checkpoint, model=args.model, trust_model_factory=args.trust_model_factory)
    training = saved.training
    plan = tessera.plan(model, args.cluster, global_batch=training.global_batch, seq_len=training.seq_len,
                        precision=training.precision)
    console.print(f"saved under {saved.strategy.to_string()} on {saved.strategy.world_size} devices; "
                  f"re-planned for {plan.cluster}:", highlight=False, soft_wrap=True, markup=False)
    plan_file = args.json or "plan.json"  # the script reads the new plan, and the model spec a factory needs
    script_args = ["--plan", str(plan_file), "--resume-from", args.checkpoint]
    spec = args.model if isinstance(args.model, str) else model if isinstance(model, str) and runs_user_code(model) else None
    script_args += ["--model", absolute_spec(spec)] if spec else []  # a factory the user named or trusted: any folder
    relaunch = launch_commands(plan, args.script, script_args=script_args)
    print_plan(plan, console, launch="the relaunch line(s) below, which resume from the checkpoint")
    if args.json:
        plan.to_json(args.json)
    print("\n".join(relaunch))
    if not args.json:
        print(f"# the lines read {plan_file}: rerun with --json {plan_file} to write it")
    return 0


def _export(args: argparse.Namespace, console: Console) -> int:
    from tessera.runtime.checkpoint import export_model_state_dict

    out = export_model_state_dict(args.checkpoint, args.out, overwrite=args.overwrite)
    console.print(f"model weights written to {out}", markup=False, highlight=False)
    return 0


def _launch(args: argparse.Namespace, console: Console) -> int:
    from tessera.planner.plan import Plan

    plan = Plan.from_json(Path(args.plan))  # the path was checked when parsed (plan_file_to_read)
    from tessera.runtime.launch import launch_commands  # after reading the plan: the runtime takes seconds to import

    lines = launch_commands(plan, args.script, nodes=args.nodes, procs_per_node=args.procs_per_node,
                            scheduler=args.scheduler, script_args=["--plan", args.plan])
    print("\n".join(lines))
    return 0


def _print_presets(args: argparse.Namespace, console: Console) -> int:
    from tessera.models import list_presets
    from tessera.topology import preset_names

    console.print("models:   " + ", ".join(list_presets()))
    console.print("clusters: " + ", ".join(f"{name}:{'ranks' if name == 'cpu' else 'nodes'}=N" for name in preset_names()))
    return 0


def _profile(args: argparse.Namespace, console: Console) -> int:
    """Spawn ``--nproc`` local ranks, measure collectives and the device, fit, write ``--out`` (checked when parsed)."""
    import time

    from tessera.topology.hardware import LOCAL_CPU
    from tessera.topology.profiler import ProfileSweep, profile_local

    sweep = ProfileSweep.quick() if args.quick else ProfileSweep()
    if args.trials is not None:
        sweep = sweep.model_copy(update={"trials": args.trials})
    started = time.perf_counter()
    result = profile_local(args.nproc, sweep=sweep, out=args.out)
    for level in result.cluster.levels:
        _say(console, f"{level.name}: {level.group_size} ranks, latency {level.latency_s * 1e6:.0f} us, "
                      f"bandwidth {level.bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank (best collective)")
    device = result.cluster.device
    _say(console, f"device {device.name}: fp32 {device.peak_flops('fp32') / 1e9:.1f} GFLOP/s, memory "
                  f"{device.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s per rank")
    if device.snapshot_bytes_per_s is not None:
        swap = device.snapshot_swap_bytes_per_s
        _say(console, f"snapshot work per rank (all ranks at once): {device.snapshot_fixed_s * 1e3:.1f} ms + "
                      f"{device.snapshot_bytes_per_s / 1e9:.2f} GB/s of state"
                      + (f", swap with a buddy {swap / 1e9:.2f} GB/s" if swap else "")
                      + " (what an in-memory snapshot costs training on these cores)")
    elif device.name == LOCAL_CPU:
        _say(console, "snapshot work not measured: no room for its files in /dev/shm or the temporary folder; "
                      "snapshots will be priced from the memory bandwidth")
    _say(console, f"cluster file written to {args.out} in {time.perf_counter() - started:.1f} s; "
                  f"use it with --cluster {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
