r"""The non-flat baselines, built on plain Pyro, that every flat method is compared with.

* ``map``: maximum a posteriori, :class:`~pyro.infer.autoguide.AutoDelta` + ``Trace_ELBO`` (the prior acts as weight
  decay).
* ``vi``: mean-field variational inference (Bayes by backprop [1]), :class:`~pyro.infer.autoguide.AutoNormal` +
  ``Trace_ELBO``.

``Trace_ELBO`` here is :class:`~pyro_flat.infer.TensorTrace_ELBO` (its values and gradients, without a host read per
site), or its compiled form :class:`~pyro_flat.infer.JitTensorTrace_ELBO` with ``--compile``.
* ``mc_dropout``: MAP of a network with dropout, predicted with dropout active (MC-Dropout [2]).
* ``ensemble``: ``ensemble_size`` MAP fits from independent initialisations, averaged (deep ensembles [3]).

Every weight starts at the network's own torch initialisation (:func:`~pyro_flat.nn.init_to_network`).

References:
    * [1] `Weight Uncertainty in Neural Networks`, Charles Blundell, Julien Cornebise, Koray Kavukcuoglu,
      Daan Wierstra (ICML 2015), arXiv:1505.05424
    * [2] `Dropout as a Bayesian Approximation`, Yarin Gal, Zoubin Ghahramani (ICML 2016), arXiv:1506.02142
    * [3] `Simple and Scalable Predictive Uncertainty Estimation using Deep Ensembles`, Balaji Lakshminarayanan,
      Alexander Pritzel, Charles Blundell (NeurIPS 2017), arXiv:1612.01474
"""

from __future__ import annotations

import pyro
from pyro.infer.autoguide import AutoDelta, AutoNormal

from ..nn import BayesianClassifier, init_to_network
from .problem import Posterior, Problem, run_svi
from .registry import register_method


def fit_map_point(problem: Problem, model: BayesianClassifier, loss: pyro.infer.ELBO | None = None) -> dict:
    """Train ``model`` to its MAP with ``AutoDelta`` (optionally with another ELBO, e.g. a sharpness-aware one) and
    return the point as ``{site: value}``."""
    guide = AutoDelta(model, init_loc_fn=init_to_network(model))
    history = run_svi(problem, model, guide, loss)
    point = {k: v.detach() for k, v in guide.median().items()}
    return {"point": point, "history": history}


@register_method("map", description="MAP: AutoDelta + TensorTrace_ELBO (prior = weight decay)")
def fit_map(problem: Problem) -> Posterior:
    model = problem.build_model()
    fit = fit_map_point(problem, model)
    return Posterior.from_points(model, [fit["point"]], info={"losses": fit["history"]})


def fit_mean_field(problem: Problem, model: BayesianClassifier, loss: pyro.infer.ELBO | None = None) -> Posterior:
    """Mean-field Gaussian VI of ``model`` with ``AutoNormal`` and ``loss`` (default ``TensorTrace_ELBO``)."""
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=problem.config.vi_init_scale)
    history = run_svi(problem, model, guide, loss)
    return Posterior.from_guide(model, guide, problem.config.num_bma_samples, info={"losses": history})


@register_method("vi", description="mean-field VI (Bayes by backprop): AutoNormal + TensorTrace_ELBO")
def fit_vi(problem: Problem) -> Posterior:
    return fit_mean_field(problem, problem.build_model(), problem.base_loss())


def fit_dropout_map(problem: Problem, loss: pyro.infer.ELBO | None = None) -> Posterior:
    """A dropout network's MAP point trained with ``loss``, predicting with dropout kept on (MC-Dropout's BMA)."""
    model = problem.build_model(dropout=problem.config.dropout)
    fit = fit_map_point(problem, model, loss)
    return Posterior(
        model,
        lambda n: (fit["point"] for _ in range(n)),
        problem.config.num_bma_samples,
        mc_dropout=True,
        info={"losses": fit["history"]},
    )


@register_method("mc_dropout", description="MC-Dropout: MAP with dropout, dropout kept on at test time")
def fit_mc_dropout(problem: Problem) -> Posterior:
    return fit_dropout_map(problem)


def fit_ensemble_points(problem: Problem, loss_factory: type | None = None) -> tuple[BayesianClassifier, list]:
    """Train ``ensemble_size`` MAP members from independent initialisations; returns the model and the points."""
    points, model = [], None
    for _ in range(problem.config.ensemble_size):
        pyro.clear_param_store()
        model = problem.build_model()  # a fresh torch initialisation per member
        fit = fit_map_point(problem, model, None if loss_factory is None else loss_factory())
        points.append(fit["point"])
    return model, points


@register_method("ensemble", description="deep ensemble of MAP members from independent initialisations")
def fit_ensemble(problem: Problem) -> Posterior:
    model, points = fit_ensemble_points(problem)
    return Posterior.from_points(model, points)
