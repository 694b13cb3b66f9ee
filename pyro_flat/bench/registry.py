"""Registries of the comparison harness: methods and datasets (the model builders are in
:mod:`pyro_flat.bench.models`).

A method issue adds its methods here with :func:`register_method` (in its own module, imported by
:mod:`pyro_flat.bench.methods`) without touching the runner. A method is a function ``fit(problem) -> Posterior``:
it trains on ``problem.data`` with the hyperparameters of ``problem.config`` and returns what the BMA needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..data import VISION_DATASETS, ClassificationData, load_digits, load_mnist1d
from ..data.images import load_vision_data
from . import models
from .config import RunConfig
from .models import *  # noqa: F403 (the model builders' home; importable from here too, where they were)

__all__ = [
    "DATASETS",
    "METHODS",
    "MethodSpec",
    "check_method_options",
    "dataset_names",
    "load_data",
    "lookup",
    "register_method",
    *models.__all__,
]


@dataclass(frozen=True)
class MethodSpec:
    """A registered method.

    :param name: the CLI name (``"vi"``, ``"f_vi"``, ...).
    :param fit: ``fit(problem) -> Posterior``.
    :param description: one line for ``--list`` and the report.
    :param baseline: the name of the non-flat method this one is compared with (``None`` for baselines).
    :param reference: the paper the method comes from.
    :param options: the per-method hyperparameters ``fit`` reads with :meth:`~pyro_flat.bench.problem.Problem.option`
        (``--set NAME.KEY=VALUE``); any other key is refused before a run starts.
    :param check: ``check(problem, name)`` raises a ``ValueError`` (naming the flags to change) for a configuration
        ``fit`` is bound to fail on, without training: called for every job before the first starts
        (:func:`~pyro_flat.bench.runner.check_jobs`; ``problem.data`` is on the CPU, its context does nothing).
    """

    name: str
    fit: Callable
    description: str
    baseline: str | None = None
    reference: str = ""
    options: tuple[str, ...] = ()
    check: Callable[..., None] | None = None  # check(problem, name)


METHODS: dict[str, MethodSpec] = {}
DATASETS: dict[str, Callable[..., ClassificationData]] = {
    "digits": load_digits,
    "mnist1d": load_mnist1d,
}
"""Bundled datasets ``load(flatten=...)``; the image datasets of :data:`~pyro_flat.data.VISION_DATASETS` are read
from ``RunConfig.data_root`` by :func:`load_data`."""


def dataset_names() -> list[str]:
    """Every dataset the harness knows: the bundled ones and the image datasets read from a folder."""
    return sorted(DATASETS) + list(VISION_DATASETS)


def load_data(name: str, config: RunConfig) -> ClassificationData:
    """The dataset ``name`` as the run's model needs it (flattened for an MLP), on the CPU in the run's dtype; image
    datasets come from ``config.data_root`` (a :class:`~pyro_flat.data.VisionData`), reduced to ``config.shots``
    examples per class if set."""
    flatten = config.model not in models.CONV_MODELS
    if name in VISION_DATASETS:
        if config.data_root is None:
            raise ValueError(f"dataset {name!r} is read from a local folder: pass its root (--data-root DIR)")
        data = load_vision_data(name, config.data_root, flatten=flatten, dtype=config.torch_dtype)
    else:
        data = lookup(DATASETS, "dataset", name)(flatten=flatten)
    return data if config.shots is None else data.few_shot(config.shots, seed=0)


def register_method(
    name: str, *, description: str, baseline: str | None = None, reference: str = "", options: tuple[str, ...] = (),
    check: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator registering ``fit(problem) -> Posterior`` under ``name``, with the option keys it reads and the check
    of a configuration it would fail on (:class:`MethodSpec`)."""

    def decorator(fit: Callable) -> Callable:
        if name in METHODS:
            raise ValueError(f"method {name!r} is already registered")
        METHODS[name] = MethodSpec(name, fit, description, baseline, reference, tuple(options), check)
        return fit

    return decorator


def check_method_options(options: Mapping[str, Mapping[str, object]]) -> None:
    """Refuse per-method options for an unknown method or with a key the method does not read (a typo would
    otherwise run the default silently), before any run; their values are checked by
    :func:`~pyro_flat.bench.options.check_option_values`.

    :raises ValueError: naming the method, the key and the method's options.
    """
    for method, values in options.items():
        if method not in METHODS:
            raise ValueError(f"options given for unknown method {method!r}; known methods: {', '.join(METHODS)}")
        unknown = sorted(set(values) - set(METHODS[method].options))
        if unknown:
            known = ", ".join(METHODS[method].options) or "none"
            raise ValueError(f"method {method!r} has no option {', '.join(map(repr, unknown))}; its options: {known}")


def lookup(registry: dict, kind: str, name: str) -> object:
    """``registry[name]`` with an error listing the known names."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(registry))}")
    return registry[name]
