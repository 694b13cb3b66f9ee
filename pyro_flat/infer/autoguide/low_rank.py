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
    [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
        Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
    [2] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
        Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
"""

from __future__ import annotations

from collections.abc import Callable

from pyro.infer.autoguide import AutoLowRankMultivariateNormal
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn import PyroParam
from torch import Tensor, nn

from ...ops.low_rank import swag_to_low_rank

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
    def from_swag(cls, model: Callable, swag: object, *, scale: float = 0.5) -> AutoLowRankPlusDiagonalNormal:
        """A guide that starts at a fitted SWAG posterior.

        :param model: the Pyro model the SWAG iterates belong to.
        :param swag: any object with ``flat_mean()`` ``[P]``, ``flat_variance()`` ``[P]`` and ``deviation_matrix()``
            ``[P, K]`` methods returning flat tensors in AutoContinuous order, e.g. a
            :class:`~pyro_flat.infer.autoguide.SWAGCollector` fed ``{site: value}`` dicts in the model's latent-site
            order. If it has a ``values_dtype`` attribute (the collector's dtype of the collected values, when the
            moments are accumulated in float64), the guide's parameters take that dtype.
        :param scale: SWAG's covariance scale :math:`c` (default 0.5).
        """
        needed = ("flat_mean", "flat_variance", "deviation_matrix")
        missing = [m for m in needed if not callable(getattr(swag, m, None))]
        if missing:
            raise ValueError(
                f"`swag` must provide flat_mean(), flat_variance() and deviation_matrix(); {type(swag).__name__} "
                f"lacks {missing}"
            )
        moments = (swag.flat_mean(), swag.flat_variance(), swag.deviation_matrix())
        dtype = getattr(swag, "values_dtype", None)
        if dtype is not None:
            moments = tuple(m.to(dtype) for m in moments)
        return cls.from_moments(model, *moments, scale=scale)

    def _setup_prototype(self, *args: object, **kwargs: object) -> None:
        super()._setup_prototype(*args, **kwargs)
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
