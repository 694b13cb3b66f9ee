r"""A low-rank-plus-diagonal Gaussian autoguide that can start from a SWAG fit.

:class:`AutoLowRankPlusDiagonalNormal` is Pyro's :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal` — a
Gaussian over the flattened unconstrained latent vector :math:`\theta\in\mathbb R^P` (Pyro's AutoContinuous site
order),

.. math:: q_\phi(\theta) = \mathcal N\big(\theta;\ m,\ \mathrm{diag}(s)(I + VV^\top)\mathrm{diag}(s)\big)
    = \mathcal N\big(\theta;\ m,\ \mathrm{diag}(s^2) + WW^\top\big),\qquad W = \mathrm{diag}(s)\,V,

with parameters :math:`\phi = (m, u, V)`: the mean ``loc``, the diagonal scale ``scale`` :math:`s =
\mathrm{softplus}(u)` and the relative factor ``cov_factor`` :math:`V\in\mathbb R^{P\times K}` — plus constructors
that start it at the Gaussian of a SWAG fit [1] (diagonal plus rank :math:`K`, exactly this family):
:meth:`~AutoLowRankPlusDiagonalNormal.from_moments` and :meth:`~AutoLowRankPlusDiagonalNormal.from_swag`. It is then
trained by any ELBO, in particular by :class:`~pyro_flat.infer.elbo.KLBallELBO` (SA-BMA [2], whose variational family
is this SWAG-like Gaussian).

.. note:: The factor is stored relative to the diagonal scale (Pyro's parameterisation), not as SWAG's absolute
    :math:`W`: the Woodbury capacitance :math:`I + V^\top V` of the density then stays well conditioned even where a
    SWAG coordinate barely moved (tiny :math:`s`), which in the absolute form overflows float32 as soon as an
    optimiser touches :math:`W`.

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
    * [2] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
      Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pyro.infer.autoguide import AutoLowRankMultivariateNormal
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn import PyroParam
from torch import Tensor, nn

from ...ops.low_rank import swag_to_low_rank
from ..util import is_real_support
from .swag import SWAGCollector

__all__ = ["AutoLowRankPlusDiagonalNormal"]


class AutoLowRankPlusDiagonalNormal(AutoLowRankMultivariateNormal):
    r"""Pyro's low-rank-plus-diagonal Gaussian guide, with SWAG initialisation.

    Usage::

        guide = AutoLowRankPlusDiagonalNormal(model, rank=5, init_loc_fn=init_to_network(model))
        svi = SVI(model, guide, optim, loss=KLBallELBO(radius=0.01))

        # or start at a SWAG fit (flat tensors in AutoContinuous order):
        guide = AutoLowRankPlusDiagonalNormal.from_moments(model, mean, variance, deviations, scale=0.5)

    :param callable model: a Pyro model with continuous latent sites.
    :param callable init_loc_fn: per-site initialisation of the mean (default ``init_to_median``; use
        :func:`~pyro_flat.nn.init_to_network` for networks).
    :param float init_scale: approximate initial marginal standard deviation :math:`> 0` (default 0.1, as Pyro).
    :param rank: the number of factor columns :math:`K \ge 1` (default :math:`\approx\sqrt P`, as Pyro; SA-BMA's
        SWAG prior has 5, SWAG 20).
    :type rank: int or None
    """

    def __init__(
        self,
        model: Callable,
        init_loc_fn: Callable = init_to_median,
        init_scale: float = 0.1,
        rank: int | None = None,
    ) -> None:
        if isinstance(rank, bool):
            raise ValueError(f"`rank` must be an int >= 1 or None, got {rank!r}")
        self._initial_parameters: tuple[Tensor, Tensor, Tensor] | None = None
        self._swag: tuple[SWAGCollector, float] | None = None
        super().__init__(model, init_loc_fn=init_loc_fn, init_scale=init_scale, rank=rank)

    @classmethod
    def from_moments(
        cls,
        model: Callable,
        mean: Tensor,
        variance: Tensor,
        deviations: Tensor,
        *,
        scale: float = 0.5,
        min_variance: float = 1e-30,
    ) -> AutoLowRankPlusDiagonalNormal:
        r"""A guide that starts at the SWAG Gaussian :math:`\mathcal N(\bar\theta,\ c\,(\mathrm{diag}(\mathrm{var}) +
        DD^\top/(K-1)))` of these moments (see :func:`~pyro_flat.ops.low_rank.swag_to_low_rank`).

        :param model: the Pyro model; its latent sites, flattened in AutoContinuous order (the model-trace order of
            the latent sites, each flattened row-major in unconstrained space), must total ``P`` values.
        :param mean: :math:`\bar\theta`, shape ``[P]``.
        :param variance: the diagonal variance, shape ``[P]``.
        :param deviations: the deviation matrix :math:`D`, shape ``[P, K]``; the guide has rank :math:`K`.
        :param scale: SWAG's covariance scale :math:`c > 0` (default 0.5, the SWAG paper's).
        :param min_variance: lower clamp of ``variance`` (default ``1e-30``, SWAG's ``var_clamp``).

        The parameters are created on the guide's first call (as for every autoguide), with the device and dtype of
        the given tensors; a ``P`` that differs from the model's latent dimension is a ``ValueError`` then.

        .. note:: Accumulate SWAG's moments in float64 (or with Welford's update): in float32 the difference
            :math:`\overline{\theta^2}-\bar\theta^2` loses the variance of weights that barely move.
        """
        loc, diag_scale, factor = swag_to_low_rank(
            mean.detach(), variance.detach(), deviations.detach(), scale=scale, min_variance=min_variance
        )
        guide = cls(model, rank=deviations.shape[1])
        guide._initial_parameters = (loc, diag_scale, factor)
        return guide

    @classmethod
    def from_swag(cls, model: Callable, swag: SWAGCollector, *, scale: float = 0.5) -> AutoLowRankPlusDiagonalNormal:
        """A guide that starts at a fitted SWAG posterior.

        :param model: the Pyro model the SWAG iterates belong to.
        :param swag: a :class:`~pyro_flat.infer.autoguide.SWAGCollector`. Its sites are matched to the model's by
            name at the guide's first call (any collection order); a constrained site collected in the model's space
            without its support is refused (as :class:`~pyro_flat.infer.autoguide.AutoSWAG` does). The guide's
            parameters take the dtype of the collected values.
        :param scale: SWAG's covariance scale :math:`c` (default 0.5).
        """
        if not isinstance(swag, SWAGCollector):
            raise ValueError(f"`swag` must be a SWAGCollector, got {type(swag).__name__}")
        if swag.num_collected == 0:
            raise ValueError("from_swag: the collector is empty; collect iterates first")
        guide = cls(model, rank=swag.rank)
        guide._swag = (swag, float(scale))
        return guide

    def _setup_prototype(self, *args: object, **kwargs: object) -> None:
        super()._setup_prototype(*args, **kwargs)
        if self._swag is not None:
            self._initial_parameters = self._moments_in_model_order(*self._swag)
            self._swag = None
        if self._initial_parameters is None:
            return
        loc, diag_scale, factor = self._initial_parameters
        if loc.shape[0] != self.latent_dim:
            raise ValueError(
                f"the moments have {loc.shape[0]} values but the model's latent sites total {self.latent_dim} "
                f"(AutoContinuous order: {list(self._unconstrained_shapes)})"
            )
        self._initial_parameters = None
        self.loc = nn.Parameter(loc)
        self.scale = PyroParam(diag_scale, self.scale_constraint)
        self.cov_factor = nn.Parameter(factor)

    def _moments_in_model_order(self, swag: SWAGCollector, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        sites = {name: site for name, site in self.prototype_trace.iter_stochastic_nodes()}
        if set(sites) != set(swag.sites):
            raise ValueError(
                f"from_swag: the collector holds the sites {list(swag.sites)}, the model's latent sites are "
                f"{list(sites)}"
            )
        for name, site in sites.items():
            if not is_real_support(site["fn"].support) and not swag.space_known(name):
                raise ValueError(
                    f"from_swag: site {name!r} has support {site['fn'].support} but the collector received its values "
                    "in the model's space without that support; build it with SWAGCollector(..., supports=...) or "
                    "collect unconstrained values"
                )
        order = list(self._unconstrained_shapes)
        mean, variance = swag.mean(), swag.variance()
        columns = swag._unflatten_columns(swag.deviation_matrix())
        dtype = swag.values_dtype
        flat = [torch.cat([m[n].reshape(-1) for n in order]).to(dtype) for m in (mean, variance)]
        deviations = torch.cat([columns[n].reshape(-1, swag.rank) for n in order]).to(dtype)
        return swag_to_low_rank(flat[0], flat[1], deviations, scale=scale, min_variance=swag.var_clamp)
