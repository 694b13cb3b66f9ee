"""Registries of the comparison harness: methods, datasets and model builders.

A method issue adds its methods here with :func:`register_method` (in its own module, imported by
:mod:`pyro_flat.bench.methods`) without touching the runner. A method is a function ``fit(problem) -> Posterior``:
it trains on ``problem.data`` with the hyperparameters of ``problem.config`` and returns what the BMA needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..data import ClassificationData, load_digits, load_mnist1d
from ..nn import BayesianClassifier, BayesianCNN, BayesianMLP


@dataclass(frozen=True)
class MethodSpec:
    """A registered method.

    :param name: the CLI name (``"vi"``, ``"f_vi"``, ...).
    :param fit: ``fit(problem) -> Posterior``.
    :param description: one line for ``--list`` and the report.
    :param baseline: the name of the non-flat method this one is compared with (``None`` for baselines).
    :param reference: the paper the method comes from.
    """

    name: str
    fit: Callable
    description: str
    baseline: str | None = None
    reference: str = ""


METHODS: dict[str, MethodSpec] = {}
DATASETS: dict[str, Callable[..., ClassificationData]] = {
    "digits": load_digits,
    "mnist1d": load_mnist1d,
}


def register_method(
    name: str, *, description: str, baseline: str | None = None, reference: str = ""
) -> Callable[[Callable], Callable]:
    """Decorator registering ``fit(problem) -> Posterior`` under ``name``."""

    def decorator(fit: Callable) -> Callable:
        if name in METHODS:
            raise ValueError(f"method {name!r} is already registered")
        METHODS[name] = MethodSpec(name, fit, description, baseline, reference)
        return fit

    return decorator


def build_mlp(data: ClassificationData, *, hidden: tuple[int, ...], prior_scale: float, dropout: float) -> BayesianMLP:
    """A :class:`~pyro_flat.nn.BayesianMLP` for ``data`` (inputs flattened)."""
    in_features = 1
    for s in data.input_shape:
        in_features *= s
    return BayesianMLP(in_features, data.num_classes, hidden, prior_scale=prior_scale, dropout=dropout)


def build_cnn(data: ClassificationData, *, hidden: tuple[int, ...], prior_scale: float, dropout: float) -> BayesianCNN:
    """A :class:`~pyro_flat.nn.BayesianCNN` for ``data`` (``hidden`` gives the conv channels)."""
    return BayesianCNN(tuple(data.input_shape), data.num_classes, hidden, prior_scale=prior_scale, dropout=dropout)


MODELS: dict[str, Callable[..., BayesianClassifier]] = {"mlp": build_mlp, "cnn": build_cnn}
"""Model builders ``build(data, *, hidden, prior_scale, dropout)``; ``"cnn"`` needs unflattened inputs."""


def lookup(registry: dict, kind: str, name: str) -> object:
    """``registry[name]`` with an error listing the known names."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(registry))}")
    return registry[name]
