"""Imports run one way: topology <- cost_models <- planner <- runtime <- api/cli (DESIGN.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANK = {"errors": -1, "files": -1, "topology": 0, "cost_models": 1, "planner": 2, "runtime": 3, "api": 4, "cli": 4, "cli_args": 4, "cli_frameworks": 4, "report": 4}


def tessera_imports(path: Path) -> set[str]:
    """Dotted ``tessera.*`` modules imported anywhere in ``path`` (function-level imports included);
    ``from tessera.pkg import submodule`` counts as the submodule."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("tessera.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tessera."):
            folder = ROOT.joinpath(*node.module.split(".")[1:])
            submodules = {f"{node.module}.{a.name}" for a in node.names if (folder / f"{a.name}.py").exists()}
            found |= submodules or {node.module}
    return found


def package_of(module: str) -> str:
    return module.split(".")[1]


def test_lower_layers_never_import_higher_ones():
    violations = []
    for package, rank in RANK.items():
        for path in (ROOT / package).rglob("*.py") if (ROOT / package).is_dir() else [ROOT / f"{package}.py"]:
            for module in tessera_imports(path):
                target = package_of(module)
                if target in RANK and RANK[target] > rank:
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "\n".join(violations)


def test_runtime_imports_only_the_plan_data_model_from_planner():
    uses = {m for p in (ROOT / "runtime").rglob("*.py") for m in tessera_imports(p) if package_of(m) == "planner"}
    assert uses <= {"tessera.planner.plan"}, uses


def test_the_plan_is_data_it_imports_no_other_planner_module():
    # The plan does not render itself: planner.explain imports planner.plan, never the other way (issue 17).
    # Its framework exports delegate to renderers that read it as data and never import it (issue 20).
    renderers = {f"tessera.planner.frameworks.{m}" for m in ("megatron", "torchtitan", "deepspeed")}
    uses = {m for m in tessera_imports(ROOT / "planner" / "plan.py") if package_of(m) == "planner"}
    assert uses <= {"tessera.planner.plan"} | renderers, uses


def test_models_import_nothing_from_tessera_but_errors():
    uses = {m for p in (ROOT / "models").rglob("*.py") for m in tessera_imports(p)}
    assert {package_of(m) for m in uses} <= {"errors", "models"}, uses


def test_the_check_sees_a_violation(tmp_path):
    # Guard against a vacuous pass: the parser must find imports in a file like ours.
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from tessera.runtime.apply import apply_plan\nimport tessera.planner.search\n")
    assert tessera_imports(sample) == {"tessera.runtime.apply", "tessera.planner.search"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("tessera", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_no_two_modules_import_each_other():
    # Issue 17 ("plan stays data"): plan <-> explain and checkpoint <-> parallel_model imported each other, even if
    # only inside functions or under TYPE_CHECKING. Every import, at any depth, counts; a package's __init__
    # re-exporting its modules is not a module of its own.
    import networkx as nx

    graph = nx.DiGraph()
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py" and not {"tests", "benchmarks", ".venv", "build"} & set(path.relative_to(ROOT).parts):
            graph.add_edges_from((module_name(path), target) for target in tessera_imports(path))
    assert not list(nx.simple_cycles(graph))
