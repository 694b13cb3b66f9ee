"""The package's import arrows, read with ``ast`` from its files: every ``import`` and ``from ... import`` anywhere in a
file (inside functions and under ``TYPE_CHECKING`` too), resolved to the pyro_flat module it names.

* The package's parts (its subpackages and top-level modules, the *units*) stand in the layers of :data:`LAYERS`, and
  a unit imports only units of lower layers: no arrow sideways or upwards, so no circle between units. The runtime
  layer (replay, random states, BatchNorm, capture) is under everything that uses it; the harness (``bench``, and
  ``__main__``, the command line) is on top, and no library unit imports it.
* No module of the package imports itself back through others, at module level or lazily inside a function: the
  modules' graph has no circle (a lazy import hides a circle from Python, not from the design).
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

LAYERS: list[frozenset[str]] = [
    frozenset({"_validation", "_internals"}),  # argument checks; the one door to Pyro's and torch's private APIs
    frozenset({"ops", "runtime"}),  # pure tensor maths; running Pyro programs again, random states, capture
    frozenset({"distributed"}),
    frozenset({"data", "nn", "metrics", "testing", "transforms"}),
    frozenset({"infer"}),  # objectives, kernels, guides: on the model transforms, networks and metrics
    frozenset({"optim"}),  # closure optimizers (bSAM's posterior is an infer guide)
    frozenset({"__init__"}),
    frozenset({"bench"}),
    frozenset({"__main__"}),
]
"""The units, lowest first: a unit may import the units of the layers below its own."""

LAYER = {name: level for level, layer in enumerate(LAYERS) for name in layer}

ALLOWED: Mapping[str, frozenset[str]] = {
    name: frozenset(other for other in UNITS if LAYER[other] < LAYER[name]) for name in LAYER
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


def test_the_layers_place_every_part_of_the_package_once():
    assert sorted(LAYER) == sorted(UNITS) and sum(map(len, LAYERS)) == len(UNITS)
    assert {"bench", "infer", "transforms", "optim", "ops", "nn", "runtime"} <= UNITS


def test_the_runtime_layer_is_under_transforms_infer_optim_and_bench():
    assert all(LAYER["runtime"] < LAYER[name] for name in ("transforms", "infer", "optim", "bench"))
    used_by = {unit(module) for module in MODULES for target, _ in imports(module) if unit(target) == "runtime"}
    assert {"transforms", "infer", "optim", "bench"} <= used_by


def test_no_circle_between_the_parts_of_the_package():
    graph = {name: set() for name in UNITS}
    for module in MODULES:
        graph[unit(module)] |= {unit(target) for target, _ in imports(module)} - {unit(module)}
    assert circles(graph) == []


def test_no_part_of_the_package_imports_against_the_table():
    assert forbidden_arrows(ALLOWED) == []


def test_the_library_never_imports_the_harness():
    """The rule of the table, checked on the table itself and on the imports."""
    assert all("bench" not in ALLOWED[name] for name in LIBRARY)
    assert any(unit(target) != "bench" for target, _ in imports("pyro_flat.bench.problem"))  # the harness does


def test_the_checks_see_a_forbidden_arrow_and_a_circle():
    """The checks themselves: a table that forbids the harness the library reports its imports (with file and
    line), a table that puts transforms under the runtime layer reports their imports of it, and a made-up circle
    is found."""
    strict = {**ALLOWED, "bench": frozenset({"__init__"})}
    reported = forbidden_arrows(strict)
    assert any(line.startswith("pyro_flat/bench/problem.py:") and "bench -> infer" in line for line in reported)
    upside_down = {**ALLOWED, "transforms": ALLOWED["transforms"] - {"runtime"}}
    assert any("transforms -> runtime (pyro_flat.runtime.replay)" in line for line in forbidden_arrows(upside_down))
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}}) == [["a"]] and circles({"a": {"b"}, "b": set()}) == []


def module_graph(modules: list[str]) -> dict[str, set[str]]:
    """The import arrows between ``modules`` (a module's arrow to itself left out)."""
    return {module: {target for target, _ in imports(module) if target in modules and target != module}
            for module in modules}


def test_no_module_imports_itself_back():
    graph = module_graph(list(MODULES))
    assert circles(graph) == []
    # the collector builds its guide, the guide does not know the collector's module
    assert "pyro_flat.infer.autoguide.swag" in graph["pyro_flat.infer.autoguide.swag_collector"]
    assert "pyro_flat.infer.autoguide.swag_collector" not in graph["pyro_flat.infer.autoguide.swag"]


def test_the_harness_has_no_circle():
    harness = [module for module in MODULES if unit(module) == "bench"]
    graph = {module: {target for target, _ in imports(module) if unit(target) == "bench" and target != module}
             for module in harness}
    assert circles(graph) == []
    assert {"pyro_flat.bench.loop", "pyro_flat.bench.session"} <= set(graph)
    assert "pyro_flat.bench.problem" not in graph["pyro_flat.bench.loop"]
    assert "pyro_flat.bench.cli" not in graph["pyro_flat.bench.recipes"]
