"""Docstrings a user can read in help(): every public class and function has one of at most 50 lines, each paper is
cited once per module, and nothing points to files outside this repository."""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import pyro_flat

MODULES = [m.name for m in pkgutil.walk_packages(pyro_flat.__path__, "pyro_flat.")]
LIBRARY = [m for m in MODULES if ".bench" not in m and "._" not in m]  # the harness documents its methods by name
MAX_LINES = 50


def _public_objects(module):
    for name, obj in vars(module).items():
        if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield name, obj


@pytest.mark.parametrize("name", MODULES)
def test_public_docstrings_are_present_and_short(name):
    module = importlib.import_module(name)
    assert inspect.getdoc(module), f"{name} has no module docstring"
    for obj_name, obj in _public_objects(module):
        doc = inspect.getdoc(obj) or ""
        assert doc or name not in LIBRARY, f"{name}.{obj_name} has no docstring"
        assert len(doc.splitlines()) <= MAX_LINES, f"{name}.{obj_name}: {len(doc.splitlines())} lines"


@pytest.mark.parametrize("name", MODULES)
def test_each_paper_is_cited_once_per_module(name):
    text = Path(importlib.import_module(name).__file__).read_text()
    docstrings = re.findall(r'r?"""(.*?)"""', text, flags=re.S)
    ids = re.findall(r"arXiv:(\d{4}\.\d{4,5})", "\n".join(docstrings))
    assert not [i for i in set(ids) if ids.count(i) > 1], name


def test_nothing_points_outside_the_repository():
    root = Path(pyro_flat.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for outside in ("ALGORITHMS", "TESTING", "DESIGN.md", "STYLE.md", "/work/"):
            assert outside not in text, (path, outside)


def test_the_library_does_not_point_to_the_harness():
    root = Path(pyro_flat.__file__).parent
    for path in root.rglob("*.py"):
        if "bench" in path.relative_to(root).parts or path.name == "__main__.py":
            continue
        text = path.read_text()
        assert "pyro_flat.bench" not in text and "from .bench" not in text and "benchmarks/" not in text, path
