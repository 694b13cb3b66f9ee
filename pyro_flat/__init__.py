"""pyro_flat: flat-posterior Bayesian deep learning for Pyro.

Subpackages: :mod:`pyro_flat.data` (bundled and toy data), :mod:`pyro_flat.nn` (Bayesian networks as Pyro models),
:mod:`pyro_flat.infer` (flat objectives, kernels, guides, averaging, BMA prediction), :mod:`pyro_flat.transforms`
(model transforms such as :func:`local_entropy`), :mod:`pyro_flat.optim` (closure-based optimizers: SAM, Bayesian
SAM), :mod:`pyro_flat.metrics` (uncertainty and flatness metrics) and :mod:`pyro_flat.ops` (pure tensor maths). The
comparison harness behind ``python -m pyro_flat`` is a separate client of the library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "data", "infer", "metrics", "nn", "ops", "optim", "transforms", "local_entropy", "sharpness_aware", "__version__"
]

_SUBPACKAGES = ("data", "infer", "metrics", "nn", "ops", "optim", "transforms")
_FROM_TRANSFORMS = ("local_entropy", "sharpness_aware")

if TYPE_CHECKING:
    from . import data, infer, metrics, nn, ops, optim, transforms
    from .transforms import local_entropy, sharpness_aware


def __getattr__(name: str) -> object:
    """The subpackages and their names, imported on first use (PEP 562): ``python -m pyro_flat --help`` and the
    command line's argument errors then answer without importing torch and Pyro."""
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _FROM_TRANSFORMS:
        return getattr(importlib.import_module(f"{__name__}.transforms"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
