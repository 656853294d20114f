"""Read a torchtitan configuration file into its sections' fields, without running any of it.

torchtitan 0.3 configures a run in Python: a ``config_registry`` function returns a ``Trainer.Config``. Tessera
never imports or executes that file; it reads it with ``ast``. In the chosen function (``FILE:function``, or the
file's only function) it follows, in order:

- ``config = other()`` where ``other`` is a function of the same file (its fields are read first), or any call
  with the keywords ``training=``, ``parallelism=``, ``compile=``, ``activation_checkpoint=`` (``Trainer.Config``);
  each of those keywords' values is a call whose keywords are the section's fields (``ParallelismConfig(...)``);
- ``config.parallelism.tensor_parallel_degree = 8`` and ``config.parallelism = ParallelismConfig(...)``;
- ``config.activation_checkpoint = FullAC.Config()`` / ``SelectiveAC.Config()`` / ``None``;
- ``config.model_spec = model_registry(flavor, converters=[Float8LinearConverter.Config(...), ...])``: the
  converters (the FP8 recipe), not the flavor (the model is ``--model``'s);
- ``return`` of such a call.

Every value read must be a literal (``ast.literal_eval``): a field set from an expression is refused by name.
Other statements are not read (listed). A JSON file (torchtitan's own ``debug.save_config_file`` dump, or the
sections alone) and a TOML file (the pre-0.3 format) are read as data; there ``activation_checkpoint.mode`` names
the policy (``full``/``selective``/``none``), or, in a dump, the fields present do.
"""

from __future__ import annotations

import ast
import json
import tomllib
from pathlib import Path

from tessera.errors import ConfigError
from tessera.planner.frameworks.common import read_config_file
from tessera.topology.validation import quoted, short

SECTIONS = ("parallelism", "training", "compile", "activation_checkpoint")
"""The ``Trainer.Config`` fields Tessera reads."""
AC_CLASSES = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory-budget"}
"""torchtitan's activation-checkpointing policies (``torchtitan.distributed.activation_checkpoint``)."""
CONVERTER_FIELDS = ("recipe_name", "emulate", "fqns", "filter_fqns")
"""The fields of a model spec's converter Tessera reads: the FP8 recipe, whether it runs in emulation, and which
linears it converts (``fqns``) or leaves (``filter_fqns``)."""
MAX_CALL_DEPTH = 8
"""How many ``config = other()`` hops are followed (a cycle stops here)."""

Sections = dict[str, object]
"""Section name -> its fields (``dict``), or for ``activation_checkpoint`` the policy name."""


def read_torchtitan(source: str) -> tuple[Sections, list[str]]:
    """``(sections, unread)`` of a torchtitan configuration: ``FILE.py[:function]``, ``FILE.json`` or ``FILE.toml``."""
    path, _, function = source.partition(":") if source.rpartition(":")[0].endswith(".py") else (source, "", "")
    text = read_config_file(path, framework="torchtitan")
    suffix = Path(path).suffix.lower()
    if suffix == ".py":
        return _PythonConfig(text, where=path).read(function or None)
    if suffix in (".json", ".toml"):
        data = _parse_data(text, suffix, where=path)
        sections = _data_sections(data, where=path)
        converters = _listed_converters(data)
        if converters:
            sections["converters"] = converters
        return sections, _other_sections(data, read={("model", "converters"), ("float8", "recipe_name")})
    raise ConfigError(f"torchtitan config {path}: expected a .py config_registry file, a .json dump or a .toml file")


# ----------------------------------------------------------------------------------------- JSON / TOML


def _parse_data(text: str, suffix: str, *, where: str) -> dict:
    try:
        data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"torchtitan config {where} is not valid {suffix[1:].upper()} "
                          f"({short(str(exc), limit=100)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"torchtitan config {where} holds {type(data).__name__}, not a table of sections")
    return data


def _data_sections(data: dict, *, where: str) -> Sections:
    sections: Sections = {}
    for name in SECTIONS:
        value = data.get(name, {} if name != "activation_checkpoint" else "default")
        if name == "activation_checkpoint":
            sections[name] = _policy_of_dump(value, where=where)
        elif not isinstance(value, dict):
            raise ConfigError(f"torchtitan config {where}: {name} must be a table of fields, got {quoted(value)}")
        else:
            sections[name] = dict(value)
    return sections


def _listed_converters(data: dict) -> list[dict]:
    """An older torchtitan file's ``[model] converters = ["float8"]`` (``[float8] recipe_name``, torchao's
    tensorwise by default) or ``["mx"]``, as the converters a 0.3 model spec names; others by their own name."""
    model = data.get("model")
    names = model.get("converters") if isinstance(model, dict) else None
    if not isinstance(names, list):
        return []
    float8 = data.get("float8") if isinstance(data.get("float8"), dict) else {}
    known = {"float8": {"class": "Float8LinearConverter", "recipe_name": float8.get("recipe_name") or "tensorwise"},
             "mx": {"class": "MXFP8LinearConverter"}}
    return [known.get(name, {"class": str(name)}) for name in names]


def _other_sections(data: dict, *, read: set[tuple[str, str]]) -> list[str]:
    """The fields of the sections Tessera does not read but for those ``read`` names (``model``: the model
    evaluated is the one Tessera is given, whatever name and flavor the file states), as ``unread`` lists them,
    each value cut short."""
    unread = []
    for name, value in data.items():
        if name not in SECTIONS:
            fields = value.items() if isinstance(value, dict) else [(None, value)]
            unread += [f"{name}.{key}={short(repr(field), limit=60)}" if key is not None
                       else f"{name}={short(repr(field), limit=60)}" for key, field in fields if (name, key) not in read]
    return unread


def _policy_of_dump(value: object, *, where: str) -> str:
    """The activation-checkpointing policy a dumped section names (``mode``) or implies (the fields it holds)."""
    if value is None or value == "default":
        return "none" if value is None else "selective"  # Trainer.Config's default is SelectiveAC
    if not isinstance(value, dict):
        raise ConfigError(f"torchtitan config {where}: activation_checkpoint must be a table, got {quoted(value)}")
    if "mode" in value:
        mode = value["mode"]
        if mode not in ("full", "selective", "none", "memory-budget"):
            raise ConfigError(f"torchtitan config {where}: activation_checkpoint.mode {quoted(mode)}; use full, "
                              "selective or none")
        return str(mode)
    if "memory_budget" in value:
        return "memory-budget"
    return "selective" if "force_recompute_mm_shapes_by_fqns" in value else "full"


# ----------------------------------------------------------------------------------------- Python


class _PythonConfig:
    """The sections a ``config_registry`` file's function builds, read from its syntax tree."""

    def __init__(self, text: str, *, where: str) -> None:
        try:
            self.tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError) as exc:
            raise ConfigError(f"torchtitan config {where} is not valid Python ({short(str(exc), limit=100)})") from None
        self.where = where
        self.functions = {node.name: node for node in self.tree.body if isinstance(node, ast.FunctionDef)}
        self.unread: list[str] = []

    def read(self, function: str | None) -> tuple[Sections, list[str]]:
        if function is None and len(self.functions) != 1:
            names = ", ".join(sorted(self.functions)) or "none"
            raise ConfigError(f"torchtitan config {self.where} defines {len(self.functions)} functions ({short(names)}); "
                              f"name one: {self.where}:FUNCTION")
        name = function or next(iter(self.functions))
        if name not in self.functions:
            raise ConfigError(f"torchtitan config {self.where} has no function {quoted(name)}; functions: "
                              f"{short(', '.join(sorted(self.functions)))}")
        sections = self._function(name, depth=0)
        return sections, self.unread

    def _function(self, name: str, *, depth: int) -> Sections:
        if depth > MAX_CALL_DEPTH:
            raise ConfigError(f"torchtitan config {self.where}: functions call each other more than {MAX_CALL_DEPTH} "
                              "deep; write the config function out")
        sections: Sections = {}
        for statement in self.functions[name].body:
            self._statement(statement, sections, depth=depth)
        return sections

    def _statement(self, node: ast.stmt, sections: Sections, *, depth: int) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and self._builds(node.value):
            return self._call(node.value, sections, depth=depth)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
            return
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = _attribute_path(node.targets[0])
            if target is not None and len(target) == 1 and isinstance(node.value, ast.Call) and self._builds(node.value):
                return self._call(node.value, sections, depth=depth)
            if target is not None and len(target) in (2, 3) and target[1] in SECTIONS:
                return self._assign(target[1:], node.value, sections, line=node.lineno)
            if target is not None and target[1:] == ("model_spec",) and isinstance(node.value, ast.Call):
                return self._model_spec(node.value, sections, line=node.lineno)
        self.unread.append(f"line {node.lineno}: {short(ast.unparse(node), limit=80)}")

    def _model_spec(self, call: ast.Call, sections: Sections, *, line: int) -> None:
        """``config.model_spec = model_registry(flavor, converters=[...])``: the converters (``Float8LinearConverter
        .Config(...)``: their class and ``CONVERTER_FIELDS``); the flavor is not read (the model is ``--model``'s)."""
        self.unread.append(f"line {line}: model_spec flavor {short(ast.unparse(call.args[0]) if call.args else '', limit=30)} "
                           "(the model is --model's)")
        sections["converters"] = []  # a model spec set again replaces the one before, converters and all
        for keyword in call.keywords:
            if keyword.arg != "converters":
                continue
            if not isinstance(keyword.value, ast.List):
                raise ConfigError(f"torchtitan config {self.where} line {line}: model_spec converters = "
                                  f"{short(ast.unparse(keyword.value), limit=60)}; Tessera reads a list of X.Config(...)")
            sections["converters"] = [self._converter(item, line=line) for item in keyword.value.elts]

    def _converter(self, item: ast.expr, *, line: int) -> dict[str, object]:
        func = item.func if isinstance(item, ast.Call) else None
        owner = func.value if isinstance(func, ast.Attribute) and func.attr == "Config" else None
        if not isinstance(owner, ast.Name):
            raise ConfigError(f"torchtitan config {self.where} line {line}: converter {short(ast.unparse(item), limit=60)}"
                              "; Tessera reads X.Config(field=literal, ...)")
        return {"class": owner.id, **{k.arg: self._literal(k.value, name=f"{owner.id}.{k.arg}", line=line)
                                      for k in item.keywords if k.arg in CONVERTER_FIELDS}}

    def _builds(self, call: ast.Call) -> bool:
        """Whether ``call`` builds a config: a function of this file, or a call with section keywords."""
        own = isinstance(call.func, ast.Name) and call.func.id in self.functions
        return own or any(keyword.arg in SECTIONS for keyword in call.keywords)

    def _call(self, call: ast.Call, sections: Sections, *, depth: int) -> None:
        """``other()`` of this file, or a ``Trainer.Config(...)``-like call with section keywords."""
        if isinstance(call.func, ast.Name) and call.func.id in self.functions:
            sections.update(self._function(call.func.id, depth=depth + 1))
            return
        for keyword in call.keywords:
            if keyword.arg in SECTIONS:
                self._assign((keyword.arg,), keyword.value, sections, line=call.lineno)
            elif keyword.arg == "model_spec" and isinstance(keyword.value, ast.Call):
                self._model_spec(keyword.value, sections, line=call.lineno)
            else:
                self.unread.append(f"line {call.lineno}: {keyword.arg}={short(ast.unparse(keyword.value), limit=60)}")

    def _assign(self, target: tuple[str, ...], value: ast.expr, sections: Sections, *, line: int) -> None:
        section = target[0]
        if section == "activation_checkpoint":
            if len(target) > 1:
                self.unread.append(f"line {line}: activation_checkpoint.{target[1]}")
                return
            sections[section] = self._policy(value, line=line)
        elif len(target) == 2:
            fields = sections.setdefault(section, {})
            fields[target[1]] = self._literal(value, name=f"{section}.{target[1]}", line=line)
        elif isinstance(value, ast.Call):
            sections[section] = {k.arg: self._literal(k.value, name=f"{section}.{k.arg}", line=line)
                                 for k in value.keywords if k.arg is not None}
        else:
            raise ConfigError(f"torchtitan config {self.where} line {line}: {section} is set from "
                              f"{short(ast.unparse(value), limit=60)}; Tessera reads a constructor call with literal fields")

    def _policy(self, value: ast.expr, *, line: int) -> str:
        if isinstance(value, ast.Constant) and value.value is None:
            return "none"
        func = value.func if isinstance(value, ast.Call) else None
        owner = func.value if isinstance(func, ast.Attribute) and func.attr == "Config" else None
        if isinstance(owner, ast.Name) and owner.id in AC_CLASSES:
            return AC_CLASSES[owner.id]
        raise ConfigError(f"torchtitan config {self.where} line {line}: activation_checkpoint = "
                          f"{short(ast.unparse(value), limit=60)}; Tessera reads FullAC.Config(), SelectiveAC.Config() or None")

    def _literal(self, value: ast.expr, *, name: str, line: int) -> object:
        try:
            return ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            raise ConfigError(f"torchtitan config {self.where} line {line}: {name} = {short(ast.unparse(value), limit=60)} "
                              "is not a literal; write the value itself") from None


def _attribute_path(node: ast.expr) -> tuple[str, ...] | None:
    """``config.parallelism.tp`` -> ``("config", "parallelism", "tp")``; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return (node.id, *reversed(parts))
