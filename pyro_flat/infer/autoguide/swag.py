r"""SWAG: a Gaussian posterior (diagonal plus rank :math:`K`) from the iterates of any trajectory, as a Pyro guide.

SWAG [1] collects iterates :math:`\theta_i` of a trajectory — usually once per epoch after ``swa_start`` — and keeps
their running mean :math:`\bar\theta` (that alone is SWA [2]), their running mean of squares :math:`m_2` and the last
:math:`K` deviations :math:`D_{:,i}=\theta_i-\bar\theta` (from the *updated* mean). The posterior at scale
:math:`\lambda` is

.. math::
    q(\theta) = \mathcal N\Big(\bar\theta,\ \lambda\big(\Sigma_{\mathrm{diag}} + \tfrac{1}{K-1}DD^\top\big)\Big),
    \qquad \Sigma_{\mathrm{diag}} = \max(m_2-\bar\theta^2,\ 10^{-30}),

sampled as :math:`\tilde\theta=\bar\theta+\sqrt\lambda(\Sigma_{\mathrm{diag}}^{1/2}z_1+Dz_2/\sqrt{K-1})`
(:mod:`pyro_flat.ops.moments`). :math:`\lambda=\tfrac12` is the paper's SWAG; SWAG-Diagonal drops :math:`D` and uses
:math:`\lambda=1`; the F-BNN code evaluates F-SWAG at 0.1 and F-SWAG-Diagonal at 0.2 [3].

Two objects, in two files (the collector's module imports this one, to build its guide; not the reverse):

* :class:`~pyro_flat.infer.autoguide.SWAGCollector` (:mod:`~pyro_flat.infer.autoguide.swag_collector`) collects
  ``{site: value}`` dicts from any trajectory (pure bookkeeping, no Pyro state); its spaces and site order are
  described there.
* :class:`AutoSWAG` (here) is the post-hoc Pyro guide built from a collector
  (:meth:`~pyro_flat.infer.autoguide.SWAGCollector.guide`), an
  :class:`~pyro_flat.infer.autoguide.AutoGaussianPosterior` whose parameters are **buffers** (like the guide
  :class:`~pyro.infer.autoguide.AutoLaplaceApproximation` returns): usable by ``Predictive(model, guide=swag)``,
  :func:`~pyro_flat.infer.guide_draws` and :func:`~pyro_flat.infer.bma_predict` (which recomputes BatchNorm statistics
  for every draw when given ``batchnorm_inputs``).

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
    * [2] `Averaging Weights Leads to Wider Optima and Better Generalization`, Pavel Izmailov, Dmitrii Podoprikhin,
      Timur Garipov, Dmitry Vetrov, Andrew Gordon Wilson (UAI 2018), arXiv:1803.05407
    * [3] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from pyro.distributions import constraints
from torch import Tensor

from ..._validation import check_positive
from ..util import is_real_support
from .gaussian_posterior import AutoGaussianPosterior

__all__ = ["AutoSWAG"]

_MOMENTS = ("num_collected", "rank", "sites", "values_dtype", "space_known", "mean", "variance", "deviation_matrix")
"""What :class:`AutoSWAG` reads from its collector (a :class:`~pyro_flat.infer.autoguide.SWAGCollector`, whose module
imports this one to build the guide)."""


class AutoSWAG(AutoGaussianPosterior):
    r"""The SWAG posterior of a :class:`~pyro_flat.infer.autoguide.SWAGCollector` as a post-hoc Pyro guide (an
    :class:`AutoGaussianPosterior`):

    .. math::
        q(z) = \mathcal N\Big(\bar\theta,\ \lambda\big(\Sigma_{\mathrm{diag}} + \tfrac{1}{K-1}DD^\top\big)\Big)

    over the sites' unconstrained values :math:`z`, sampled as :math:`\bar\theta+\sqrt\lambda(\Sigma_{\mathrm{diag}}
    ^{1/2}z_1 + Dz_2/\sqrt{K-1})`, as the reference ``sample(scale, cov=True)``, with :math:`K` the number of
    deviation columns *held* (the reference divides by ``max_num_models - 1`` even before that many exist).
    ``median()`` is :math:`\bar\theta` mapped to the support: the SWA solution.

    :param model: the Pyro model whose latent sites were collected.
    :param collector: a :class:`~pyro_flat.infer.autoguide.SWAGCollector`, the moments; copied at construction (later
        collection does not change the guide).
    :param float scale: :math:`\lambda>0`; default 0.5 (SWAG [1]). Use 1.0 with ``diagonal_only`` for SWAG-Diagonal;
        F-BNN [3] uses 0.1 (F-SWAG) and 0.2 (F-SWAG-Diagonal).
    :param bool diagonal_only: drop the low-rank term (SWAG-Diagonal); default ``False``. Without it the collector
        must hold :math:`K\ge2` columns.
    :param variance: a per-site diagonal variance (> 0, unconstrained) used *instead of* the collector's
        :math:`\Sigma_{\mathrm{diag}}` (e.g. the variance rules of :class:`~pyro_flat.infer.averaging.HWA`); default
        ``None`` (the collector's).
    :raises ValueError: if nothing was collected, for a bad ``scale``, or a low-rank guide with :math:`K<2`; at the
        first call, if the model's latent sites differ from the collected ones, or if a constrained site was
        collected in the model's space without its support (the collector cannot know the values' space).

    Example::

        collector = SWAGCollector(max_rank=20, supports=latent_supports(delta_guide))
        callback = collector.callback(delta_guide.median, every=steps_per_epoch, start=swa_start)
        ...  # SVI steps, calling callback(step) after each
        swag = collector.guide(model, scale=0.5)
        logits = Predictive(model, guide=swag, num_samples=30, return_sites=["logits"])(x_test)["logits"]
    """

    def __init__(
        self,
        model: Callable,
        collector: Any,
        *,
        scale: float = 0.5,
        diagonal_only: bool = False,
        variance: Mapping[str, Tensor] | None = None,
    ) -> None:
        if not all(hasattr(collector, name) for name in _MOMENTS):
            raise ValueError(f"AutoSWAG: `collector` must be a SWAGCollector, got {type(collector).__name__}")
        if collector.num_collected == 0:
            raise ValueError("AutoSWAG: the collector is empty; collect iterates first")
        self.scale = check_positive(scale, "scale", owner="AutoSWAG")
        self.diagonal_only = bool(diagonal_only)
        if not self.diagonal_only and collector.rank < 2:
            raise ValueError(
                f"AutoSWAG: the low-rank term needs K >= 2 deviation columns, the collector holds {collector.rank}; "
                "collect more iterates or use diagonal_only=True"
            )
        self._space_known = {name: collector.space_known(name) for name in collector.sites}
        dtype = collector.values_dtype
        mean = {k: v.to(dtype) for k, v in collector.mean().items()}
        diag = collector.variance() if variance is None else dict(variance)
        factor = None
        if not self.diagonal_only:
            columns = collector.deviation_matrix() * math.sqrt(self.scale / (collector.rank - 1))
            factor = collector._unflatten_columns(columns.to(dtype))
        super().__init__(model, mean, {k: (self.scale * v).to(dtype) for k, v in diag.items()}, factor)

    def _check_site(self, name: str, support: constraints.Constraint) -> None:
        if not is_real_support(support) and not self._space_known[name]:
            raise ValueError(
                f"AutoSWAG: site {name!r} has support {support} but the collector received its values in the "
                "model's space without that support, so it cannot tell their space. Build the collector with "
                "SWAGCollector(..., supports=latent_supports(model_or_guide, *args)), or collect unconstrained "
                "values with collect_unconstrained (as mcmc_hook does)"
            )
