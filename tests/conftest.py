"""Shared test configuration.

* Statistical tests run in float64 (the default dtype here); tests that need float32 ask for it.
* Pyro's parameter store is cleared and validation is on before every test; every test starts from seed 0
  unless it is marked ``@pytest.mark.init(rng_seed=...)``.
* torch uses one thread per test worker.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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
def no_host_sync() -> Callable[[str], AbstractContextManager]:
    """``no_host_sync(device)``: a context manager inside which an operation that synchronises with the host fails the
    test. On CUDA, sync-debug mode "error" (the operation raises; torch's prototype warning silenced, the suite turns
    warnings into errors); on another device (``meta``, the CPU twin), a :class:`~pyro_flat.testing.HostSyncCounter`
    that must stay empty. Enter it after the test's set-up: copying the data to the device synchronises by design.
    The sync-debug mode is restored on exit and after the test, whatever happens in it."""
    previous: list[int] = []  # CUDA's mode before the test (asked only on CUDA: without a driver, asking fails)

    @contextlib.contextmanager
    def inside(device: str) -> Iterator[None]:
        if torch.device(device).type != "cuda":
            from pyro_flat.testing import HostSyncCounter

            with HostSyncCounter() as syncs:
                yield
            assert syncs.count == 0, f"on {device}: {syncs.report()}"
            return
        previous[:] = previous or [torch.cuda.get_sync_debug_mode()]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype feature")
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous[0])

    try:
        yield inside
    finally:
        if previous:
            torch.cuda.set_sync_debug_mode(previous[0])


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
