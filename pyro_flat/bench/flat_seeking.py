r"""The flat-seeking counterparts of the baselines, from Flat Seeking Bayesian Neural Networks [1].

Each method is its baseline (:mod:`pyro_flat.bench.baselines`) with ``Trace_ELBO`` replaced by
:class:`~pyro_flat.infer.SharpnessAwareELBO`, i.e. every weight sample is trained with the SAM gradient
:math:`\nabla\ell_B(\theta+\rho\,\hat g/\|\hat g\|_2)` (prior and guide at :math:`\theta`):

* ``f_vi`` — F-BBB / F-VI: ``AutoNormal`` + SA-ELBO; baseline ``vi``;
* ``sam`` — the flat MAP: ``AutoDelta`` + SA-ELBO, which is SAM with the prior as weight decay; baseline ``map``;
* ``f_mc_dropout`` — F-MC-Dropout: the MAP of a dropout network trained with SAM, predicted with dropout on; the
  perturbed pass uses the *same* dropout mask as the ascent pass (the authors' code draws a fresh one;
  keeping it is the faithful "perturb the sampled θ"); baseline ``mc_dropout``;
* ``f_ensemble`` — F-Deep-Ensemble: ``ensemble_size`` members, each trained with SAM from its own initialisation;
  baseline ``ensemble`` (same number of members, unlike the authors' README: 5 SGD vs 3 SAM members).

Hyperparameters, per method with ``--set <method>.<key>=<value>``: ``rho`` (SAM radius, default 0.05: the F-BNN
code's value for CIFAR-10 and ImageNet fine-tuning), ``adaptive`` (ASAM, default ``False``), and the cheaper steps of
:mod:`pyro_flat.ops.efficient_sam`: ``looksam_k`` and ``looksam_alpha`` (LookSAM's period and :math:`\alpha`,
defaults 1 and 0.7) or ``rst_p`` (RST's probability of a sharpness-aware step, default 1); the defaults take the
ascent at every step.
Everything else (epochs, Adam learning rate, batch size, prior, BMA samples) is the run's shared configuration, so
each flat method differs from its baseline only by the objective. F-SWAG (SWAG collected from the SAM iterates)
needs the SWAG guide of the averaging issue and is wired where both are available.

References:
    * [1] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

from ..infer import JitSharpnessAwareELBO, SharpnessAwareELBO
from .baselines import fit_dropout_map, fit_ensemble_points, fit_map_point, fit_mean_field
from .problem import Posterior, Problem
from .registry import register_method

DEFAULT_RHO = 0.05
"""SAM radius of the flat-seeking methods unless ``--set <method>.rho=...`` (F-BNN code, CIFAR-10 / ImageNet)."""

REFERENCE = "Nguyen et al., Flat Seeking Bayesian Neural Networks (NeurIPS 2023), arXiv:2302.02713"


OPTIONS = ("rho", "adaptive", "looksam_k", "looksam_alpha", "rst_p")
"""The options of the flat-seeking methods."""


def cheaper_step_options(problem: Problem, method: str) -> dict[str, object]:
    """The method's LookSAM and RST options (``looksam_k``, ``looksam_alpha``, ``rst_p``), those it was given."""
    return {key: problem.option(method, key, None) for key in ("looksam_k", "looksam_alpha", "rst_p")
            if problem.option(method, key, None) is not None}


def sharpness_aware_loss(problem: Problem, method: str) -> SharpnessAwareELBO:
    """The SA-ELBO with the method's ``rho`` and ``adaptive`` options (defaults 0.05 and ``False``) and its LookSAM
    or RST options, compiled when ``problem.compiled``; data-parallel runs all-reduce its ascent direction."""
    elbo = JitSharpnessAwareELBO if problem.compiled else SharpnessAwareELBO
    return elbo(
        problem.option(method, "rho", DEFAULT_RHO), adaptive=problem.option(method, "adaptive", False),
        distributed=problem.distributed, **cheaper_step_options(problem, method),
    )


@register_method("f_vi", description="F-VI (F-BBB): AutoNormal + SharpnessAwareELBO", baseline="vi",
                 reference=REFERENCE, options=OPTIONS)
def fit_f_vi(problem: Problem) -> Posterior:
    return fit_mean_field(problem, problem.build_model(), sharpness_aware_loss(problem, "f_vi"))


@register_method("sam", description="SAM (flat MAP): AutoDelta + SharpnessAwareELBO", baseline="map",
                 reference=REFERENCE, options=OPTIONS)
def fit_sam(problem: Problem) -> Posterior:
    model = problem.build_model()
    fit = fit_map_point(problem, model, sharpness_aware_loss(problem, "sam"))
    return Posterior.from_points(model, [fit["point"]], info={"losses": fit["history"]})


@register_method("f_mc_dropout", description="F-MC-Dropout: dropout MAP trained with SAM (same mask in both passes)",
                 baseline="mc_dropout", reference=REFERENCE, options=OPTIONS)
def fit_f_mc_dropout(problem: Problem) -> Posterior:
    return fit_dropout_map(problem, sharpness_aware_loss(problem, "f_mc_dropout"))


@register_method("f_ensemble", description="F-Deep-Ensemble: MAP members each trained with SAM",
                 baseline="ensemble", reference=REFERENCE, options=OPTIONS)
def fit_f_ensemble(problem: Problem) -> Posterior:
    model, points = fit_ensemble_points(problem, lambda: sharpness_aware_loss(problem, "f_ensemble"))
    return Posterior.from_points(model, points)
