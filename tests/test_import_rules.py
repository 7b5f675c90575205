"""The package's import rules (the table at the top of src/flextensor/__init__.py), checked from the source.

Every import of a flextensor module is collected with ast: top-level, function-local and under
``TYPE_CHECKING`` alike (a lazy import is still a dependency, and the next move must respect it). Each
package may import only the packages before it in ``LAYERS``, itself, and ``flextensor.errors``; the
package root (``flextensor/__init__.py``) may import anything. Today's exceptions are listed in
``KNOWN_VIOLATIONS`` and ``KNOWN_CYCLES``: the tests fail when a new one appears and when a listed one
is gone, so the lists only shrink and stay true.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "flextensor"

LAYERS = (
    "common",
    "codec",
    "config",
    "plan",
    "device",
    "host",
    "store",
    "weights",
    "phases",
    "hooks",
    "engine",
    "profiles",
    "pipelines",
    "api",
    "observe",
    "vllm",
    "cli",
)
"""The packages in import order: each may import those before it (flextensor/__init__.py's table)."""

ANYWHERE = {f"{ROOT}.errors"}
"""Importable from every layer: the error tree imports nothing of flextensor."""

SAME_LAYER = {"__main__": "cli"}
"""Top-level modules that belong to a package's layer."""

NO_TORCH = ("plan",)
"""Packages whose modules, and every flextensor module they import, never import torch."""

# Today's exceptions, listed when the modules moved into packages (issue 46): remove each once fixed.
KNOWN_VIOLATIONS: set[tuple[str, str]] = {
    ("flextensor.pipelines.pipeline", "flextensor.api"),
    ("flextensor.weights.edits", "flextensor.api"),
    ("flextensor.weights.edits", "flextensor.engine.controller"),
    ("flextensor.weights.edits", "flextensor.engine.edit_session"),
    ("flextensor.weights.edits", "flextensor.pipelines.pipeline"),
    ("flextensor.weights.structure_guard", "flextensor.engine.controller"),
}
KNOWN_CYCLES: list[tuple[str, ...]] = [
    (
        "flextensor.api",
        "flextensor.engine.budgets",
        "flextensor.engine.controller",
        "flextensor.engine.edit_session",
        "flextensor.engine.forward_ends",
        "flextensor.engine.plan_states",
        "flextensor.engine.status",
        "flextensor.hooks.model_hooks",
        "flextensor.pipelines.methods",
        "flextensor.pipelines.pipeline",
        "flextensor.profiles.reuse",
        "flextensor.weights.access",
        "flextensor.weights.edits",
        "flextensor.weights.structure_guard",
    ),
    (
        "flextensor.host.shared.coded",
        "flextensor.host.shared.store",
        "flextensor.host.shared.unpack",
    ),
    (
        "flextensor.store.device_store",
        "flextensor.store.host_budget",
        "flextensor.store.nesting",
        "flextensor.store.stream_order",
    ),
]
# End of the exceptions.


def module_paths() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, not ``.__init__``)."""
    paths = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        paths[".".join(parts)] = path
    return paths


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(tree: ast.AST, importer: str, is_package: bool, modules: set[str]) -> Iterator[str]:
    """Every name an import statement anywhere in ``tree`` brings in, as the module it imports: for
    ``from a import b``, ``a.b`` when that is one of ``modules``, else ``a``. The packages passed on the
    way to a submodule (``a`` for ``import a.b``) do not count: their ``__init__`` files are light."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node)
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)


def flextensor_imports(tree: ast.AST, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The flextensor modules ``importer`` imports, itself left out."""
    names = imported_names(tree, importer, is_package, modules)
    return {name for name in names if name in modules and name != importer}


def import_graph() -> dict[str, set[str]]:
    """Each module -> the flextensor modules it imports."""
    paths = module_paths()
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = flextensor_imports(tree, name, path.name == "__init__.py", modules)
    return graph


def layer_of(module: str) -> int:
    """The index of ``module``'s package in ``LAYERS``; the package root is above them all, ``ANYWHERE``
    below."""
    if module == ROOT:
        return len(LAYERS)
    if module in ANYWHERE:
        return -1
    head = module.split(".")[1]
    head = SAME_LAYER.get(head, head)
    if head not in LAYERS:
        raise AssertionError(
            f"{module} is in no layer: put it in one of the packages of LAYERS (tests/test_import_rules.py)"
        )
    return LAYERS.index(head)


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where a module imports a later layer than its own."""
    return {
        (importer, imported)
        for importer, imports in graph.items()
        if importer not in ANYWHERE
        for imported in imports
        if imported not in ANYWHERE and layer_of(imported) > layer_of(importer)
    }


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def torch_importers(graph: dict[str, set[str]]) -> set[str]:
    """Modules of the ``NO_TORCH`` packages, or flextensor modules they import, that import torch."""
    paths = module_paths()
    todo = [m for m in graph if m.split(".")[1:2] and m.split(".")[1] in NO_TORCH]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    offenders = set()
    for module in seen:
        path = paths[module]
        tree = ast.parse(path.read_text())
        names = imported_names(tree, module, path.name == "__init__.py", set(paths))
        if any(name.split(".")[0] == "torch" for name in names):
            offenders.add(module)
    return offenders


def test_no_import_goes_against_the_layer_order_but_the_known_ones() -> None:
    found = layer_violations(import_graph())
    new = sorted(found - KNOWN_VIOLATIONS)
    gone = sorted(KNOWN_VIOLATIONS - found)
    assert not new, (
        f"imports against the layer order of flextensor/__init__.py (importer, imported): {new}; "
        "import only from the packages before yours, or move the code to where it belongs"
    )
    assert not gone, f"no longer imported, well done: remove {gone} from KNOWN_VIOLATIONS"


def test_import_cycles_are_the_known_ones() -> None:
    found = cycles(import_graph())
    new = sorted(set(found) - set(KNOWN_CYCLES))
    gone = sorted(set(KNOWN_CYCLES) - set(found))
    assert not new, f"import cycles (modules that import each other, directly or not) not known before: {new}"
    assert not gone, f"these cycles changed or are gone: update KNOWN_CYCLES (remove {gone}, add {new})"


def test_plan_never_imports_torch() -> None:
    assert not torch_importers(import_graph())


def test_every_module_is_in_a_layer() -> None:
    for module in import_graph():
        layer_of(module)  # raises for a module outside every package of LAYERS


def test_the_collector_sees_every_kind_of_import() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import flextensor.common.sizes\n"
        "from ..store import units\n"
        "from ..plan.layout import ring_layout\n"
        "if TYPE_CHECKING:\n"
        "    from ..engine.controller import OffloadEngine\n"
        "def f():\n"
        "    from flextensor import api\n"
        "    from . import packs\n"
    )
    modules = {
        "flextensor", "flextensor.api", "flextensor.common", "flextensor.common.sizes",
        "flextensor.store", "flextensor.store.units", "flextensor.plan", "flextensor.plan.layout",
        "flextensor.engine", "flextensor.engine.controller", "flextensor.host", "flextensor.host.packs",
        "flextensor.host.disk",
    }  # fmt: skip
    found = flextensor_imports(ast.parse(source), "flextensor.host.disk", False, modules)
    assert found == {
        "flextensor.common.sizes",
        "flextensor.store.units",
        "flextensor.plan.layout",
        "flextensor.engine.controller",
        "flextensor.api",
        "flextensor.host.packs",
    }
