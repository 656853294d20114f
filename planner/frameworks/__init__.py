"""Plans in and out of the frameworks people train with: Megatron-LM, torchtitan, DeepSpeed.

Export (:func:`export_plan`): each framework's renderer turns a plan into that framework's configuration, with a
comment for every choice it cannot express exactly, and the strategy the framework would actually run (the
nearest it can express, with its implementation behaviours), which Tessera evaluates too. Import
(:func:`import_config`): a configuration read back into a ``Strategy``; flags or fields Tessera does not read are
listed, never silently dropped. Export then import gives the same strategy (``common.canonical``) for every plan
the framework can express. Nothing imported is executed: a torchtitan Python config is read as a syntax tree.

The renderers read a plan through ``common.PlanLike`` and never import ``tessera.planner.plan``.
"""

from __future__ import annotations

from tessera.errors import ConfigError
from tessera.planner.frameworks.common import FRAMEWORKS, FrameworkExport, ImportedConfig, PlanLike


def export_plan(plan: PlanLike, framework: str) -> FrameworkExport:
    """``plan`` rendered for ``framework`` (``megatron``, ``torchtitan`` or ``deepspeed``)."""
    if framework == "megatron":
        from tessera.planner.frameworks.megatron import to_megatron_args

        return to_megatron_args(plan)
    if framework == "torchtitan":
        from tessera.planner.frameworks.torchtitan import to_torchtitan

        return to_torchtitan(plan)
    if framework == "deepspeed":
        from tessera.planner.frameworks.deepspeed import to_deepspeed

        return to_deepspeed(plan)
    raise ConfigError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}")


def import_config(framework: str, source: str, *, world_size: int) -> ImportedConfig:
    """A ``framework`` configuration read for a run on ``world_size`` devices: Megatron-LM arguments (the text),
    a torchtitan file (``FILE.py[:function]``, ``.json``, ``.toml``) or a DeepSpeed JSON file."""
    if framework == "megatron":
        from tessera.planner.frameworks.megatron_import import from_megatron

        return from_megatron(source, world_size=world_size)
    if framework == "torchtitan":
        from tessera.planner.frameworks.torchtitan import from_torchtitan

        return from_torchtitan(source, world_size=world_size)
    if framework == "deepspeed":
        from tessera.planner.frameworks.deepspeed import from_deepspeed

        return from_deepspeed(source, world_size=world_size)
    raise ConfigError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}")


__all__ = ["FRAMEWORKS", "FrameworkExport", "ImportedConfig", "export_plan", "import_config"]
