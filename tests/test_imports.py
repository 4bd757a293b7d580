"""The project's modules import each other without a cycle: a module's imports, deferred ones inside
functions included, form a graph that can be ordered. A cycle is how a shared fact ends up reached
through the wrong module (as LINKED_ATTRIBUTES once was, through the CLI)."""

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "datamodules", "experiments", "benchmarks")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages (a package is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that the module ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from experiments import guards` imports the module experiments.guards
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_the_project_imports():
    graph = import_graph()
    assert {"models.attention", "experiments.cli", "experiments.links", "benchmarks.run"} <= graph.keys()
    assert "experiments.links" in graph["experiments.trainer_cli"]
    assert "experiments.links" in graph["experiments.tracking"]
    assert "experiments.tracking" in graph["experiments.trainer_cli"]  # `from experiments import guards, tracking`
    assert "experiments.trainer_cli" in graph["experiments.cli"]  # imported inside main()
    assert "experiments.guards" in graph["experiments.tracking"]  # imported inside default_callbacks()
    assert "models.attention" in graph["models.transformer"]


def test_no_import_cycle_among_project_modules():
    order = list(graphlib.TopologicalSorter(import_graph()).static_order())  # CycleError names the cycle
    assert order.index("experiments.links") < order.index("experiments.trainer_cli")
