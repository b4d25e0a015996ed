"""The house's shape, read from the source: no import cycle in the control plane nor in the data
plane, a core that imports only models, a catalog that knows nothing of the fleet or the data
plane, no wiring by module probing, no module over 500 lines.

The data plane (``serving/pipeline``) and its host (``serving/runtime.py``) are held to their own
cycle check (``tests/test_lint.py`` keeps the pipeline free of Django), the whole project to one
across both planes, and to the same no-probing and 500-line rules; so is the engine simulator
(``enginesim``), which the tests and benchmarks run as the fleet. An import under ``TYPE_CHECKING`` is an edge like any other: a circle of types is a
circle of concepts.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA_PLANE = ("serving/pipeline/", "serving/runtime.py")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _control_plane() -> dict[str, Path]:
    found = {}
    for package in ("catalog", "fleet", "serving", "motorsite"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/migrations/" in rel or rel.startswith(DATA_PLANE):
                continue
            found[_module_name(path)] = path
    return found


MODULES = _control_plane()
# The control plane and the data plane with its host: the rules every module of the project keeps.
EVERY_MODULE = {
    **MODULES,
    **{_module_name(p): p for p in sorted((ROOT / "serving" / "pipeline").rglob("*.py"))},
    "serving.runtime": ROOT / "serving" / "runtime.py",
    **{_module_name(p): p for p in sorted((ROOT / "enginesim").rglob("*.py"))},
}


def _imports(path: Path, universe: Mapping[str, Path] | None = None) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (a cycle is one either way).

    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module, not ``pkg``:
    a package's ``__init__`` runs for any of its submodules and is not an edge of its own.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(subs & (MODULES if universe is None else universe).keys() or {node.module})
    return found


def _graph(modules: Mapping[str, Path] = MODULES) -> dict[str, set[str]]:
    return {name: {m for m in _imports(path, modules) if m in modules and m != name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_it_finds_a_cycle_when_there_is_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_it_finds_no_import_cycle_in_the_control_plane() -> None:
    assert len(MODULES) > 30  # the walk found the tree
    assert _cycles(_graph()) == []


def test_it_finds_no_import_cycle_in_the_data_plane() -> None:
    data_plane = {name: path for name, path in EVERY_MODULE.items() if name.startswith(("serving.pipeline", "serving.runtime"))}
    assert len(data_plane) > 50 and "serving.pipeline.placement.scheduler" in data_plane
    assert _cycles(_graph(data_plane)) == []


def test_it_finds_no_import_cycle_across_the_planes() -> None:
    """The two checks above each see one side: a circle through the data plane's host and the
    control plane (``serving.runtime`` -> ``serving.stream_reports`` -> back) is in neither."""
    assert _cycles(_graph(EVERY_MODULE)) == []


def test_the_core_imports_only_the_apps_models() -> None:
    ours = {m for m in _imports(MODULES["motorsite.core"]) if m.split(".")[0] in ("catalog", "fleet", "serving", "motorsite")}
    assert ours == {"fleet.models", "catalog.models"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "catalog"))
def test_the_catalog_knows_nothing_of_the_fleet_or_the_data_plane(module: str) -> None:
    assert not {m for m in _imports(MODULES[module]) if m.split(".")[0] in ("fleet", "serving")}


def test_nothing_is_wired_by_probing_a_module() -> None:
    """No ``importlib.import_module`` and no ``getattr(<module>, "<name>", <default>)``: an import
    that fails loudly when a name moves, instead of a feature silently turning off."""
    probes = []
    for name, path in EVERY_MODULE.items():
        tree = ast.parse(path.read_text())
        modules = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
            if isinstance(node, ast.Import) or f"{node.module}.{alias.name}" in EVERY_MODULE
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
                continue
            called = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if called == "import_module":
                probes.append(f"{name}:{node.lineno} import_module")
            elif called == "getattr" and len(node.args) == 3 and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in modules:
                probes.append(f"{name}:{node.lineno} getattr({node.args[0].id}, ...)")
    assert probes == []


def test_no_module_is_over_500_lines() -> None:
    assert "enginesim.generate" in EVERY_MODULE and "serving.pipeline.service" in EVERY_MODULE
    long = {name: n for name, path in EVERY_MODULE.items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}
