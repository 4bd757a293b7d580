"""The project's modules import each other without a cycle: a module's imports, deferred ones inside
functions included, form a graph that can be ordered. A cycle is how a shared fact ends up reached
through the wrong module (as LINKED_ATTRIBUTES once was, through the CLI)."""

import ast
import graphlib
from pathlib import Path

import pytest

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
            # `from experiments import guards` imports the module experiments.callbacks.guards
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_the_project_imports():
    graph = import_graph()
    assert {"models.core.attention", "experiments.cli", "experiments.links", "benchmarks.run"} <= graph.keys()
    assert "experiments.links" in graph["experiments.trainer_cli"]
    assert "experiments.links" in graph["experiments.tracking"]
    assert "experiments.tracking" in graph["experiments.trainer_cli"]  # `from experiments import guards, tracking`
    assert "experiments.trainer_cli" in graph["experiments.cli"]  # imported inside main()
    assert "experiments.callbacks.guards" in graph["experiments.tracking"]  # imported inside default_callbacks()
    assert "models.core.attention" in graph["models.core.transformer"]


def test_no_import_cycle_among_project_modules():
    order = list(graphlib.TopologicalSorter(import_graph()).static_order())  # CycleError names the cycle
    assert order.index("experiments.links") < order.index("experiments.trainer_cli")


MODALITIES = ("text", "vision", "detection")


def room(module: str) -> str:
    """``models.text.lm`` -> "models.text"; the core is "models.core"; a shared file (``models.optim``) is its
    package ("models"), as is a top-level package's own file; benchmarks and experiments are one room each."""
    parts = module.split(".")
    if parts[0] in ("models", "datamodules") and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0]


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """Each import that breaks the house rules (shared/DESIGN.md): the floors benchmarks -> experiments -> models, with
    datamodules apart (models and datamodules never import each other); the core imports no modality; a modality's
    room imports no other modality's room."""
    floors = {"benchmarks": 3, "experiments": 2, "models": 1, "datamodules": 1}
    broken = []
    for module, imports in graph.items():
        for imported in imports:
            (a, b), (ra, rb) = (module.split(".")[0], imported.split(".")[0]), (room(module), room(imported))
            if floors[b] > floors[a] or {a, b} == {"models", "datamodules"}:
                broken.append(
                    f"{module} -> {imported}: a lower floor imports a higher one, or models and datamodules meet"
                )
            elif ra == "models.core" and rb.startswith("models.") and rb != ra:
                broken.append(f"{module} -> {imported}: the core imports a modality")
            elif ra != rb and ra.split(".")[-1] in MODALITIES and rb.split(".")[-1] in MODALITIES:
                broken.append(f"{module} -> {imported}: one modality's room imports another's")
    return sorted(broken)


def test_the_rooms_keep_the_house_rules():
    graph = import_graph()
    assert {"models.core", "models.text", "models.vision", "models.detection"} <= {room(m) for m in graph}
    assert {"datamodules.text", "datamodules.vision", "datamodules.detection"} <= {room(m) for m in graph}
    assert broken_rules(graph) == []


@pytest.mark.parametrize(
    "module, imported",
    [
        ("models.text.lm", "models.vision.vit"),  # a modality reaches into another
        ("datamodules.detection.coco", "datamodules.text.sources"),
        ("models.core.attention", "models.text.decoding"),  # the core knows a modality
        ("models.vision.module", "datamodules.vision.classification"),  # models and datamodules meet
        ("datamodules.text.corpus", "models.core.attention"),
        ("models.core.attend", "experiments.links"),  # a floor imports the one above
        ("experiments.cli", "benchmarks.run"),
    ],
)
def test_each_rule_is_caught_when_broken(module, imported):
    graph = import_graph()
    graph[module] = graph[module] | {imported}
    assert len(broken_rules(graph)) == 1 and broken_rules(graph)[0].startswith(f"{module} -> {imported}")
