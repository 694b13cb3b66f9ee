"""Shared test configuration.

* Statistical tests run in float64 (the default dtype here); tests that need float32 ask for it.
* Pyro's parameter store is cleared and validation is on before every test; every test starts from seed 0
  unless it is marked ``@pytest.mark.init(rng_seed=...)``.
* torch uses one thread per test worker.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pyro
import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
# The suite runs as `pytest -n 2` on 2 cores: one torch thread per worker. Two threads per worker make the small
# tensors of these tests fight for the cores (measured 5-20x slower).
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "init(rng_seed): the seed applied before the test (default 0)")


@pytest.fixture(autouse=True)
def _pyro_state(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("init")
    seed = marker.kwargs.get("rng_seed", 0) if marker else 0
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(seed)
    yield
    torch.set_default_dtype(old_dtype)
    pyro.clear_param_store()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first (with ``--dist worksteal`` the two CI workers then finish together instead of one running
    a long test alone at the end); the CUDA tests skipped without a GPU."""
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: the collection order otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_sync_errors():
    """CUDA's sync-debug mode at "error" for one test (an operation that synchronises with the host raises), restored
    to what it was after the test, whatever happens in it. torch announces the mode as a prototype with a warning,
    which this fixture silences (the suite turns warnings into errors)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype feature")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.fixture
def script() -> Callable[[str], ModuleType]:
    """Imports one of the repository's ``scripts/`` by name (they are not a package)."""

    def load(name: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
