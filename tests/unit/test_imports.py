"""The import directions of docs/design/code-layout.md ("Code layout and import rules"), read from the source
with `ast`: every import counts, under `TYPE_CHECKING` and inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "models", "data", "parallelism")
JOB_MODULES = ("engine.describe", "engine.session", "engine.trainer", "engine.loop", "engine.cli", "engine.main")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in it (`from a.b import c` counts a.b.c when
    that is a module, else a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name if name in modules else node.module for name in names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(graph: dict[str, set[str]], importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if within(name, importer)
        for target in targets
        if any(within(target, package) for package in forbidden)
    ]


def test_models_and_data_never_import_the_engine():
    graph = import_graph()
    assert violations(graph, "models", ("engine",)) == []
    assert violations(graph, "data", ("engine",)) == []


def test_parallelism_imports_no_other_package():
    assert violations(import_graph(), "parallelism", ("engine", "models", "data")) == []


def test_config_imports_neither_observability_nor_backends_nor_the_job():
    assert violations(import_graph(), "engine.config", ("engine.observability", "engine.backends", *JOB_MODULES)) == []


def test_observability_never_imports_backends():
    assert violations(import_graph(), "engine.observability", ("engine.backends", *JOB_MODULES)) == []


def test_only_the_job_imports_the_job():
    graph = import_graph()
    packages = ("engine.backends", "engine.checkpoints", "engine.parallel", "engine.plan", "engine.launch")
    found = [line for package in (*packages, "engine.failures") for line in violations(graph, package, JOB_MODULES)]
    assert found == []


def test_no_import_cycles():
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert cycles == []


def package_of(module: str) -> str:
    """engine.<package> for the engine's packages and job modules; models and data whole."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else parts[0]


def test_no_cycles_between_packages():
    edges: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        edges.setdefault(package_of(name), set()).update(package_of(target) for target in targets)
    for package, targets in edges.items():
        targets.discard(package)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for target in edges.get(start, ()):
            if target == goal or (target not in seen and reaches(target, goal, seen | {target})):
                return True
        return False

    assert [package for package in sorted(edges) if reaches(package, package, set())] == []
