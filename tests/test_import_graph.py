"""kvpilot's modules import each other without a cycle at import time.

The graph is read from the source: every import a module runs when it is imported (module
level, class bodies, ``try`` and ``if`` blocks; not ``if TYPE_CHECKING:`` blocks nor imports
inside functions, which run later). Importing ``a.b.c`` also runs the packages ``a.b`` and
``a`` (their ``__init__``) unless the importer lives inside them already.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvpilot

ROOT = Path(kvpilot.__file__).resolve().parent
LAYERS = {
    # The torch-free core never imports the layers built on it.
    "kvpilot.memory": ("kvpilot.engine", "kvpilot.model", "kvpilot.server", "kvpilot.sim"),
    "kvpilot.policy": ("kvpilot.engine", "kvpilot.model", "kvpilot.server", "kvpilot.sim"),
    "kvpilot.store": ("kvpilot.engine", "kvpilot.model", "kvpilot.server", "kvpilot.sim"),
    "kvpilot.engine": ("kvpilot.model", "kvpilot.server", "kvpilot.sim", "kvpilot.cli"),
}


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_imports(
    tree: ast.Module, module: str, is_package: bool, *, type_checking: bool = False
) -> list[str]:
    """Absolute names of the modules imported when ``module`` runs (``type_checking``: and
    those a type checker follows)."""
    found: list[str] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                found.append(base)
                found.extend(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if type_checking or not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With | ast.ClassDef):
                visit(node.body)

    visit(tree.body)
    return found


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        own = set(_ancestors(name)) | {name}
        is_package = path.name == "__init__.py"
        for target in import_time_imports(tree, name, is_package, type_checking=type_checking):
            if target not in files:
                continue  # a name imported from a module, or not kvpilot
            for dep in [*_ancestors(target), target]:
                if dep in files and dep not in own:
                    graph[name].add(dep)
    return graph


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules in import order, first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state:
                cycle = walk(dep)
                if cycle is not None:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle is not None:
                return cycle
    return None


def test_no_import_cycle_between_kvpilot_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_core_has_no_cycle_even_for_the_type_checker() -> None:
    """Inside memory/, policy/, store/ and engine/, not even annotations import in a loop: a
    component reads what it needs of another through a Protocol it declares."""
    core = ("kvpilot.memory", "kvpilot.policy", "kvpilot.store", "kvpilot.engine")
    graph = import_graph(type_checking=True)
    inside = {m: {d for d in deps if d.startswith(core)} for m, deps in graph.items()}
    cycle = find_cycle({m: deps for m, deps in inside.items() if m.startswith(core)})
    assert cycle is None, "import cycle (with TYPE_CHECKING imports): " + " -> ".join(cycle or [])


def test_the_core_does_not_import_the_layers_above_it() -> None:
    graph = import_graph()
    wrong = [
        f"{module} imports {dep}"
        for module, deps in graph.items()
        for low, above in LAYERS.items()
        if module == low or module.startswith(low + ".")
        for dep in deps
        if dep.startswith(above)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_type_checking_and_function_imports_are_not_import_time() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import kvpilot.errors\n"
        "if TYPE_CHECKING:\n    from kvpilot.engine import Engine\n"
        "def f():\n    import kvpilot.model\n"
        "try:\n    from kvpilot.memory import tiers\nexcept ImportError:\n    pass\n"
    )
    found = import_time_imports(tree, "kvpilot.x", is_package=False)
    assert "kvpilot.errors" in found and "kvpilot.memory.tiers" in found
    assert not any(n.startswith(("kvpilot.engine", "kvpilot.model")) for n in found)
