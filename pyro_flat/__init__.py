"""pyro_flat: flat-posterior Bayesian deep learning for Pyro.

Subpackages: :mod:`pyro_flat.data` (bundled and toy data), :mod:`pyro_flat.nn` (Bayesian networks as Pyro models),
:mod:`pyro_flat.infer` (flat objectives, kernels, guides, averaging, BMA prediction), :mod:`pyro_flat.transforms`
(model transforms such as :func:`local_entropy`), :mod:`pyro_flat.optim` (closure-based optimizers: SAM, Bayesian
SAM), :mod:`pyro_flat.metrics` (uncertainty and flatness metrics) and :mod:`pyro_flat.ops` (pure tensor maths). The
comparison harness behind ``python -m pyro_flat`` is a separate client of the library.
"""

from . import data, infer, metrics, nn, ops, optim, transforms
from .transforms import local_entropy, sharpness_aware

__version__ = "0.1.0"

__all__ = [
    "data", "infer", "metrics", "nn", "ops", "optim", "transforms", "local_entropy", "sharpness_aware", "__version__"
]
