"""The package's import arrows, read with ``ast`` from its files: every ``import`` and ``from ... import`` anywhere in a
file (inside functions and under ``TYPE_CHECKING`` too), resolved to the pyro_flat module it names.

* Between the package's parts (its subpackages and top-level modules, the *units*), only the arrows of
  :data:`ALLOWED` exist: the harness (``bench``, and ``__main__``, the command line) may import the library, no
  library unit may import the harness.
* Inside the harness, no module imports itself back through others: its modules' graph has no circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_flat"


def module_name(path: Path) -> str:
    """``pyro_flat/bench/loop.py`` -> ``pyro_flat.bench.loop``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
"""Every module of the package, by name."""


def _resolve(name: str) -> str:
    """The module ``name`` denotes: itself, or the package or module it is an attribute of."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(module: str) -> Iterator[tuple[str, int]]:
    """``(imported pyro_flat module, line)`` for every import statement of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in `base`
        else:
            continue
        for target in targets:
            if target == "pyro_flat" or target.startswith("pyro_flat."):
                yield _resolve(target), node.lineno


def unit(module: str) -> str:
    """The part of the package a module belongs to: ``pyro_flat.bench.loop`` -> ``bench``, ``pyro_flat`` ->
    ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


UNITS = frozenset(unit(module) for module in MODULES)
HARNESS = frozenset({"bench", "__main__"})
LIBRARY = UNITS - HARNESS

ALLOWED: Mapping[str, frozenset[str]] = {
    **{name: LIBRARY for name in LIBRARY},  # the library's own layers: narrowed unit by unit by a later change
    "bench": UNITS,
    "__main__": UNITS,
}
"""The units each unit may import (besides itself)."""


def forbidden_arrows(allowed: Mapping[str, frozenset[str]]) -> list[str]:
    """Every import from one unit into another that ``allowed`` does not list, as ``file:line: a -> b``."""
    found = []
    for module, path in MODULES.items():
        for target, line in imports(module):
            source, destination = unit(module), unit(target)
            if source != destination and destination not in allowed[source]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} -> {destination} ({target})")
    return found


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (or with a self-arrow) of ``graph``: each is a set
    of modules that import one another, directly or through others (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_table_places_every_part_of_the_package():
    assert set(ALLOWED) == UNITS
    assert {"bench", "infer", "transforms", "optim", "ops", "nn"} <= UNITS


def test_no_part_of_the_package_imports_against_the_table():
    assert forbidden_arrows(ALLOWED) == []


def test_the_library_never_imports_the_harness():
    """The rule of the table, checked on the table itself and on the imports."""
    assert all("bench" not in ALLOWED[name] for name in LIBRARY)
    assert any(unit(target) != "bench" for target, _ in imports("pyro_flat.bench.problem"))  # the harness does


def test_the_checks_see_a_forbidden_arrow_and_a_circle():
    """The checks themselves: a table that forbids the harness the library reports its imports (with file and
    line), and a made-up circle is found."""
    strict = {**ALLOWED, "bench": frozenset({"__init__"})}
    reported = forbidden_arrows(strict)
    assert any(line.startswith("pyro_flat/bench/problem.py:") and "bench -> infer" in line for line in reported)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}}) == [["a"]] and circles({"a": {"b"}, "b": set()}) == []


def test_the_harness_has_no_circle():
    harness = [module for module in MODULES if unit(module) == "bench"]
    graph = {module: {target for target, _ in imports(module) if unit(target) == "bench" and target != module}
             for module in harness}
    assert circles(graph) == []
    assert {"pyro_flat.bench.loop", "pyro_flat.bench.session"} <= set(graph)
    assert "pyro_flat.bench.problem" not in graph["pyro_flat.bench.loop"]
    assert "pyro_flat.bench.cli" not in graph["pyro_flat.bench.recipes"]
