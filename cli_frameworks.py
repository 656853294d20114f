"""The ``tessera`` command line's side of ``tessera.planner.frameworks``: ``plan --format megatron|torchtitan|
deepspeed``, ``evaluate --from-FRAMEWORK`` and ``compare --baseline-from FRAMEWORK SOURCE``.

An imported configuration is read (and its values checked) before anything is captured or searched; what it
states about the workload (global batch, sequence length, precision) fills the options not given, and a config
that disagrees with an option is refused in one line. What was read, and what was not, is said on stderr, so
``--format json`` output stays one document.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from rich.console import Console

FRAMEWORK_FORMATS = ("megatron", "torchtitan", "deepspeed")
"""``plan --format`` values that print the plan as that framework's configuration."""
FROM_HELP = {
    "megatron": "a Megatron-LM command line as one quoted argument (the words after the last *.py; names and rules "
                "of Megatron-LM core_v0.14.0)",
    "torchtitan": "a torchtitan 0.3 config: FILE.py[:function] (a config_registry function, read as a syntax tree, "
                  "never run; values must be literals), or a .json dump (debug.save_config_file) / .toml file",
    "deepspeed": "a DeepSpeed JSON config (ZeRO data parallelism)",
}
TRAINING_OPTIONS = {"global_batch": "--global-batch", "seq_len": "--seq-len", "precision": "--precision",
                    "fp8_scaling": "--fp8-scaling"}
"""Workload fields an imported config may state -> the option that sets them."""


def _say(console: Console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def add_from_options(group: argparse._MutuallyExclusiveGroup) -> None:
    """``--from-megatron ARGS``, ``--from-torchtitan FILE``, ``--from-deepspeed FILE`` (evaluate)."""
    for framework, text in FROM_HELP.items():
        group.add_argument(f"--from-{framework}", metavar="ARGS" if framework == "megatron" else "FILE",
                           help=text + "; its global batch, sequence length and precision fill the options not given")


def from_sources(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ``(framework, source)`` pairs ``evaluate --from-*`` names."""
    return [(name, getattr(args, f"from_{name}")) for name in FRAMEWORK_FORMATS
            if getattr(args, f"from_{name}", None) is not None]


def training_from(args: argparse.Namespace, imported: Sequence) -> dict:
    """Global batch, sequence length, precision and FP8 scaling: the options given, else what the imported configs
    state; a config that disagrees with an option or with another config is refused (one workload is compared)."""
    from tessera.errors import ConfigError
    from tessera.planner.frameworks.common import FRAMEWORK_NAMES

    values = {key: getattr(args, key, None) for key in TRAINING_OPTIONS}
    for config in imported:
        for key, option in TRAINING_OPTIONS.items():
            theirs = getattr(config, key)
            if theirs is not None and values[key] is not None and theirs != values[key]:
                raise ConfigError(f"the {FRAMEWORK_NAMES[config.framework]} config says {key.replace('_', ' ')} "
                                  f"{theirs}, but {values[key]} is asked for ({option} or another config); make them agree")
            values[key] = values[key] if theirs is None else theirs
    return values


def import_configs(sources: Sequence[tuple[str, str]], *, world_size: int) -> list:
    """Each ``(framework, source)`` read for ``world_size`` devices, and said on stderr: what was read, what not."""
    from tessera.errors import ConfigError
    from tessera.planner.frameworks import import_config
    from tessera.planner.frameworks.common import FRAMEWORK_NAMES

    console, configs = Console(stderr=True, emoji=False), []
    for framework, source in sources:
        if framework not in FRAMEWORK_NAMES:
            raise ConfigError(f"--baseline-from {framework!r}: the framework is one of {', '.join(FRAMEWORK_NAMES)}")
        config = import_config(framework, source, world_size=world_size)
        configs.append(config)
        stated = ", ".join(f"{k.replace('_', ' ')} {getattr(config, k)}" for k in TRAINING_OPTIONS
                           if getattr(config, k) is not None)
        _say(console, f"from {FRAMEWORK_NAMES[framework]}: {config.strategy.to_string()}" + f" ({stated})" * bool(stated))
        if config.unread:
            _say(console, "  not read by Tessera (listed, not evaluated): " + "; ".join(config.unread))
        for note in config.notes:
            _say(console, f"  note: {note}")
    return configs


def print_export(plan, framework: str, *, evaluate: Callable[[str, str], tuple], console: Console) -> None:
    """The plan as ``framework``'s configuration on stdout, and ``evaluate(strategy, runs_on)``'s estimate of what the
    framework runs (the nearest strategy it can express, as its own implementation runs it: its memory differs from
    Tessera's runtime's even for the same strategy) next to the plan's: a comment for Megatron-LM and torchtitan, on
    stderr for DeepSpeed's JSON (which has no comments), as are DeepSpeed's notes."""
    from tessera.planner.frameworks import export_plan
    from tessera.planner.frameworks.common import FRAMEWORK_NAMES, pin_string

    export = export_plan(plan, framework)
    lines = [f"# {note}" for note in export.notes] if framework == "deepspeed" else []
    with console.status(f"estimating what {FRAMEWORK_NAMES[framework]} runs..."):
        _, runs = evaluate(pin_string(export.strategy), export.profile)  # every field pinned: what the framework runs
    lines.append(nearest_line(FRAMEWORK_NAMES[framework], export.strategy.to_string(), runs, plan.estimate))
    print(export.text.rstrip("\n"))
    if framework == "deepspeed":
        for line in lines:
            _say(Console(stderr=True, emoji=False), line)
    elif lines:
        print("\n".join(lines))


def nearest_line(name: str, strategy: str, runs, planned) -> str:
    """``# Tessera's estimate of what Megatron-LM runs (...): 12.300 s per step, ...; the plan: ...``."""
    gib = 2**30
    fits = "" if runs.fits else " (does NOT fit)"
    return (f"# Tessera's estimate of what {name} runs ({strategy}): {runs.step_time_s:.3f} s per step, "
            f"{runs.peak_memory_bytes / gib:.1f} of {runs.memory_budget_bytes / gib:.4g} GiB per device{fits}; "
            f"the plan: {planned.step_time_s:.3f} s, {planned.peak_memory_bytes / gib:.1f} GiB")
