"""The comparison harness: registries of methods, datasets and models; runs over seeds; tables, JSON and plots."""

from .config import PRESETS, RunConfig
from .problem import Posterior, Problem, run_svi
from .registry import DATASETS, METHODS, MODELS, MethodSpec, register_method

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
