"""The comparison harness: registries of methods, datasets and models; runs over seeds; tables, JSON and plots.

Its names are imported on first use (PEP 562), so that the command line (:mod:`pyro_flat.bench.cli`) parses its
arguments and prints its help without importing torch and Pyro.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "DATASETS",
    "METHODS",
    "MODELS",
    "PRESETS",
    "MethodSpec",
    "Posterior",
    "Problem",
    "RunConfig",
    "register_method",
    "run_svi",
]

_HOMES = {"PRESETS": "config", "RunConfig": "config", "Posterior": "problem", "Problem": "problem",
          "run_svi": "problem", "DATASETS": "registry", "METHODS": "registry", "MODELS": "registry",
          "MethodSpec": "registry", "register_method": "registry"}

if TYPE_CHECKING:
    from .config import PRESETS, RunConfig
    from .problem import Posterior, Problem, run_svi
    from .registry import DATASETS, METHODS, MODELS, MethodSpec, register_method


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
