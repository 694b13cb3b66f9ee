"""What a method receives (:class:`Problem`) and what it returns (:class:`Posterior`), plus the shared SVI loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import Tensor

from ..data import ClassificationData
from ..infer.predict import guide_draws, sample_draws
from ..nn import BayesianClassifier
from .config import RunConfig
from .registry import MODELS, lookup


@dataclass
class Problem:
    """A dataset (already on the run's device and dtype) and the run's hyperparameters."""

    data: ClassificationData
    config: RunConfig

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.data.num_data / min(self.config.batch_size, self.data.num_data))

    @property
    def num_steps(self) -> int:
        """Optimisation steps of a method with the run's epoch budget."""
        return self.config.num_epochs * self.steps_per_epoch

    @property
    def batch_size(self) -> int:
        return min(self.config.batch_size, self.data.num_data)

    def build_model(self, *, dropout: float = 0.0) -> BayesianClassifier:
        """A fresh model of the run's architecture on the run's device and dtype."""
        build = lookup(MODELS, "model", self.config.model)
        model = build(self.data, hidden=self.config.hidden, prior_scale=self.config.prior_scale, dropout=dropout)
        return model.to(device=self.data.device, dtype=self.data.dtype)

    def option(self, method: str, name: str, default: Any) -> Any:
        """A per-method hyperparameter from ``config.options[method][name]``, else ``default``."""
        return self.config.options.get(method, {}).get(name, default)

    def train_args(self) -> tuple[tuple[Tensor, Tensor], dict[str, int]]:
        """``(args, kwargs)`` for a model step on a random minibatch drawn inside the model."""
        return (self.data.x_train, self.data.y_train), {"subsample_size": self.batch_size}


@dataclass
class Posterior:
    """What a trained method leaves for prediction: a model and a way to draw latent values.

    :param model: the trained model.
    :param draw: ``draw(num_samples) -> iterator of {site: value}``.
    :param num_samples: draws averaged in the BMA (1 for a point estimate, M for an ensemble).
    :param mc_dropout: keep dropout active at prediction time.
    :param info: anything the method wants to report (training losses, ...).
    """

    model: BayesianClassifier
    draw: Callable[[int], Iterator[dict[str, Tensor]]]
    num_samples: int
    mc_dropout: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_guide(cls, model: BayesianClassifier, guide: Callable, num_samples: int, **kw: Any) -> Posterior:
        """Draws from a (trained) guide."""
        return cls(model, lambda n: guide_draws(guide, n), num_samples, **kw)

    @classmethod
    def from_points(cls, model: BayesianClassifier, points: Sequence[Mapping[str, Tensor]], **kw: Any) -> Posterior:
        """A point estimate (one dict) or an equally weighted set of points (ensemble members), cycled."""
        points = [{k: v.detach() for k, v in p.items()} for p in points]
        if not points:
            raise ValueError("`points` is empty")

        def draw(n: int) -> Iterator[dict[str, Tensor]]:
            for i in range(n):
                yield points[i % len(points)]

        kw.setdefault("num_samples", len(points))
        return cls(model, draw, **kw)

    @classmethod
    def from_samples(
        cls, model: BayesianClassifier, samples: Mapping[str, Tensor], num_samples: int, **kw: Any
    ) -> Posterior:
        """Stacked samples ``{site: [S, ...]}`` (e.g. from MCMC), thinned evenly to ``num_samples``."""
        total = next(iter(samples.values())).shape[0]
        return cls(model, lambda n: sample_draws(samples, min(n, total)), min(num_samples, total), **kw)


def run_svi(
    problem: Problem,
    model: BayesianClassifier,
    guide: Callable,
    loss: pyro.infer.ELBO | None = None,
    *,
    optim: pyro.optim.PyroOptim | None = None,
    num_steps: int | None = None,
    callback: Callable[[int], None] | None = None,
    log_every: int = 50,
) -> list[float]:
    """Run ``num_steps`` (default ``problem.num_steps``) of Pyro's ``SVI`` on in-model minibatches.

    :param loss: the ELBO (default ``Trace_ELBO()``).
    :param optim: a Pyro optimiser (default ``Adam(lr=config.lr)``).
    :param callback: called as ``callback(step)`` after every step (e.g. to collect SWAG iterates).
    :param log_every: keep every ``log_every``-th loss value.
    :returns: the kept loss values.
    :raises FloatingPointError: if the loss becomes NaN or infinite, naming the step.
    """
    loss = Trace_ELBO() if loss is None else loss
    optim = pyro.optim.Adam({"lr": problem.config.lr}) if optim is None else optim
    svi = SVI(model, guide, optim, loss)
    args, kwargs = problem.train_args()
    num_steps = problem.num_steps if num_steps is None else num_steps
    model.train()
    history = []
    for step in range(num_steps):
        value = svi.step(*args, **kwargs)
        if step % log_every == 0 or step == num_steps - 1:
            if not math.isfinite(value):
                raise FloatingPointError(f"SVI loss became {value} at step {step} of {num_steps}")
            history.append(value)
        if callback is not None:
            callback(step)
    return history


def to_device(data: ClassificationData, config: RunConfig) -> ClassificationData:
    """``data`` on the run's device and dtype."""
    return data.to(device=torch.device(config.device), dtype=config.torch_dtype)
