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

import math
from collections.abc import Callable

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoLowRankMultivariateNormal
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn import PyroParam
from torch import Tensor, nn
from torch.distributions.utils import lazy_property

from ...ops.low_rank import (
    low_rank_capacitance_tril,
    low_rank_log_prob,
    low_rank_rsample,
    low_rank_rsample_and_log_prob,
    low_rank_variance,
    row_dot,
    swag_to_low_rank,
)
from ...runtime.capture import is_capturing
from ..util import is_real_support
from .swag_collector import SWAGCollector

__all__ = ["AutoLowRankPlusDiagonalNormal", "ScaledLowRankMultivariateNormal"]


class ScaledLowRankMultivariateNormal(dist.LowRankMultivariateNormal):
    r"""Pyro's :class:`~pyro.distributions.LowRankMultivariateNormal` given by its diagonal scale :math:`s` and
    relative factor :math:`V`, :math:`\mathcal N(m,\ \mathrm{diag}(s)(I + VV^\top)\mathrm{diag}(s))` — the
    distribution Pyro's ``AutoLowRankMultivariateNormal`` builds with the absolute factor :math:`W = \mathrm{diag}(s)V`
    and :math:`D = s^2` — whose density, draws and their gradients make no :math:`P\times K` temporary
    (:mod:`pyro_flat.ops.low_rank`): :math:`W` is not formed (only on demand, for the dense matrices and torch's KL
    divergences), the capacitance is :math:`I + V^\top V`. Draws use torch's noise in torch's order, so a seed gives
    the same draws as Pyro's distribution (up to rounding).

    A draw made while autograd records the parameters is scored with it
    (:func:`~pyro_flat.ops.low_rank.low_rank_rsample_and_log_prob`): :meth:`log_prob` of that very tensor — what an
    ELBO asks for — returns the log-density computed with the draw, whose gradient in the parameters is the same and
    whose backward pass gives the factor one gradient buffer instead of two. That log-density has no gradient in the
    draw itself; ask for ``log_prob(value.detach())`` (or of any other tensor) to differentiate in the value.

    :param loc: :math:`m`, shape ``[..., P]``.
    :param scale: :math:`s > 0`, shape ``[..., P]``.
    :param factor: :math:`V`, shape ``[..., P, K]``.
    :param validate_args: as for every torch distribution.
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "scale": constraints.independent(constraints.positive, 1),
        "factor": constraints.independent(constraints.real, 2),
    }

    def __init__(self, loc: Tensor, scale: Tensor, factor: Tensor, validate_args: bool | None = None) -> None:
        if (loc.dim() < 1 or scale.dim() < 1 or factor.dim() < 2 or scale.shape[-1] != loc.shape[-1]
                or factor.shape[-2] != loc.shape[-1]):
            raise ValueError(
                f"ScaledLowRankMultivariateNormal: expected loc [..., P], scale [..., P], factor [..., P, K]; got "
                f"{tuple(loc.shape)}, {tuple(scale.shape)}, {tuple(factor.shape)}"
            )
        self._set(loc, scale, factor, torch.broadcast_shapes(loc.shape[:-1], scale.shape[:-1], factor.shape[:-2]))
        self._scored: tuple[Tensor, Tensor] | None = None  # the last draw and its log-density
        torch.distributions.Distribution.__init__(self, self.loc.shape[:-1], self.loc.shape[-1:], validate_args)

    def _set(self, loc: Tensor, scale: Tensor, factor: Tensor, batch_shape: torch.Size) -> None:
        self._params = (loc, scale, factor)  # unbroadcast: the arithmetic never expands the factor
        event_shape = loc.shape[-1:]
        self.loc = loc.expand(batch_shape + event_shape)
        self.scale = scale.expand(batch_shape + event_shape)
        self.factor = factor.expand(batch_shape + factor.shape[-2:])

    @staticmethod
    def infer_shapes(loc: torch.Size, scale: torch.Size, factor: torch.Size) -> tuple[torch.Size, torch.Size]:
        return torch.broadcast_shapes(loc[:-1], scale[:-1], factor[:-2]), loc[-1:]

    def expand(
        self, batch_shape: torch.Size, _instance: ScaledLowRankMultivariateNormal | None = None
    ) -> ScaledLowRankMultivariateNormal:
        new = self._get_checked_instance(ScaledLowRankMultivariateNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new._set(*self._params, batch_shape)
        new._scored = None
        torch.distributions.Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @lazy_property
    def _unbroadcasted_cov_factor(self) -> Tensor:
        _, scale, factor = self._params
        return factor * scale.unsqueeze(-1)

    @lazy_property
    def _unbroadcasted_cov_diag(self) -> Tensor:
        return self._params[1].square()

    @lazy_property
    def _capacitance_tril(self) -> Tensor:
        return low_rank_capacitance_tril(self._params[2], check_errors=bool(self._validate_args))

    @lazy_property
    def cov_factor(self) -> Tensor:
        r""":math:`W = \mathrm{diag}(s)V`, broadcast (a :math:`P\times K` tensor, made on first access)."""
        return self._unbroadcasted_cov_factor.expand(self.factor.shape)

    @lazy_property
    def cov_diag(self) -> Tensor:
        """:math:`D = s^2`, broadcast."""
        return self._unbroadcasted_cov_diag.expand(self.loc.shape)

    @lazy_property
    def variance(self) -> Tensor:
        _, scale, factor = self._params
        return low_rank_variance(scale, factor).expand(self.loc.shape)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:  # noqa: B008
        loc, scale, factor = self._params
        shape = self._extended_shape(sample_shape)
        noise_rank = torch.empty(shape[:-1] + factor.shape[-1:], dtype=loc.dtype, device=loc.device).normal_()
        noise_diag = torch.empty(shape, dtype=loc.dtype, device=loc.device).normal_()  # torch's own standard draws
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in self._params)):
            return low_rank_rsample(loc, scale, factor, noise_diag, noise_rank)
        value, log_prob = low_rank_rsample_and_log_prob(loc, scale, factor, noise_diag, noise_rank,
                                                        check_errors=bool(self._validate_args),
                                                        fused=not is_capturing())
        self._scored = (value, log_prob)
        return value

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        if self._scored is not None and value is self._scored[0]:
            return self._scored[1]
        log_prob = low_rank_log_prob(value, *self._params, check_errors=bool(self._validate_args),
                                     fused=not is_capturing())
        return log_prob.expand(torch.broadcast_shapes(value.shape[:-1], self.batch_shape))

    def entropy(self) -> Tensor:
        _, scale, _ = self._params
        logdet = 2 * scale.log().sum(-1) + 2 * self._capacitance_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return (0.5 * (self.event_shape[0] * (1.0 + math.log(2 * math.pi)) + logdet)).expand(self.batch_shape)


class AutoLowRankPlusDiagonalNormal(AutoLowRankMultivariateNormal):
    r"""Pyro's low-rank-plus-diagonal Gaussian guide, with SWAG initialisation and a lean posterior
    (:class:`ScaledLowRankMultivariateNormal`: no :math:`P\times K` temporary in its density, draws and gradients).

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

    def get_posterior(self, *args: object, **kwargs: object) -> ScaledLowRankMultivariateNormal:
        """The Gaussian over the packed unconstrained latent vector (Pyro's, without forming :math:`W`)."""
        return ScaledLowRankMultivariateNormal(self.loc, self.scale, self.cov_factor)

    def _loc_scale(self, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        return self.loc, self.scale * (1 + row_dot(self.cov_factor, self.cov_factor)).sqrt()
