r"""A fixed Gaussian posterior over a model's latent sites as a post-hoc Pyro guide: :class:`AutoGaussianPosterior`, the
guide SWAG, HWA and Bayesian SAM end in."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.guides import prototype_hide_fn
from pyro.infer.autoguide.initialization import init_to_sample
from torch import Tensor
from torch.distributions import biject_to

from ..util import subsampled_plate
from .low_rank_normal import LowRankPlusDiagonalNormal

__all__ = ["AutoGaussianPosterior"]


def _flat(values: Mapping[str, Tensor], names: list[str]) -> Tensor:
    return torch.cat([values[n].detach().reshape(-1) for n in names])


class AutoGaussianPosterior(AutoContinuous):
    r"""A fixed Gaussian over the model's latent sites in unconstrained space, given by its moments, as a post-hoc
    Pyro guide (every parameter a **buffer**: nothing to train, like the guide ``AutoLaplaceApproximation``
    returns). SWAG (:class:`AutoSWAG`), HWA and Bayesian SAM (:meth:`pyro_flat.optim.BayesianSAM.guide`) all end in
    one, so that ``Predictive(model, guide=...)``, :func:`~pyro_flat.infer.guide_draws` and
    :func:`~pyro_flat.infer.bma_predict` use them the same way.

    .. math:: q(z) = \mathcal N\big(\mu,\ \operatorname{diag}(v) + WW^\top\big),\qquad \theta = t^{-1}(z),

    :math:`z` the unconstrained values of the sites (``biject_to(support).inv``; the values themselves for real
    sites) and :math:`\theta` what the guide returns, in each site's support (Pyro's ``AutoContinuous`` adds the
    Jacobian). ``median()`` is :math:`t^{-1}(\mu)`.

    :param model: the Pyro model whose latent sites the moments describe (same names, unconstrained shapes).
    :param mean: :math:`\mu` per site, unconstrained.
    :param variance: :math:`v>0` per site.
    :param factor: :math:`W` per site, shaped ``[*site_shape, K]`` (default ``None``: diagonal).
    :raises ValueError: for a non-positive variance or inconsistent shapes; at the first call, if the model's latent
        sites differ from the given ones.
    """

    def __init__(
        self,
        model: Callable,
        mean: Mapping[str, Tensor],
        variance: Mapping[str, Tensor],
        factor: Mapping[str, Tensor] | None = None,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(mean, Mapping) or not mean:
            raise ValueError(f"{owner}: `mean` must be a non-empty dict {{site: tensor}}")
        names = list(mean)
        self._shapes = {n: mean[n].shape for n in names}
        for what, moments in (("variance", variance), ("factor", factor)):
            if moments is not None and (not isinstance(moments, Mapping) or set(moments) != set(names)):
                raise ValueError(f"{owner}: `{what}` must be a dict over the sites {names}")
        for n in names:
            if variance[n].shape != self._shapes[n]:
                raise ValueError(f"{owner}: `variance[{n!r}]` must have shape {tuple(self._shapes[n])}")
            if factor is not None and factor[n].shape[:-1] != self._shapes[n]:
                raise ValueError(f"{owner}: `factor[{n!r}]` must have shape {tuple(self._shapes[n])} + (K,)")
        flat_mean, flat_variance = _flat(mean, names), _flat(variance, names)
        if not flat_variance.is_meta and not bool((flat_variance > 0).all()):  # meta tensors hold no values
            raise ValueError(f"{owner}: `variance` must be > 0 everywhere")
        rank = 0 if factor is None else next(iter(factor.values())).shape[-1]
        flat_factor = flat_mean.new_zeros(len(flat_mean), 0) if factor is None else torch.cat(
            [factor[n].detach().reshape(-1, rank) for n in names]
        )
        super().__init__(model, init_loc_fn=self._init_at_mean)
        self.register_buffer("posterior_mean", flat_mean)
        self.register_buffer("posterior_variance", flat_variance.to(flat_mean))
        self.register_buffer("posterior_factor", flat_factor.to(flat_mean))

    def _init_at_mean(self, site: dict) -> Tensor:
        """The prototype's values: the mean mapped into each site's support (so that validation holds and a network
        is run at the mean, e.g. the SWA weights); other sites from their prior."""
        name = site["name"]
        if name not in self._shapes:
            return init_to_sample(site)
        self._check_site(name, site["fn"].support)  # a value in the support's space has another shape: say so first
        plate = subsampled_plate(site)
        if plate is not None:
            raise ValueError(
                f"{type(self).__name__}: site {name!r} is a local latent of the subsampled plate {plate!r}; a "
                "Gaussian over the packed latent vector cannot follow a minibatch. Call the guide (e.g. Predictive) "
                "on the full data, without subsampling"
            )
        to_support = biject_to(site["fn"].support)
        expected = to_support.inverse_shape(site["fn"].shape())
        if expected != self._shapes[name]:
            raise ValueError(
                f"{type(self).__name__}: site {name!r} has unconstrained shape {tuple(expected)} in the model, "
                f"{tuple(self._shapes[name])} in the moments (values of a local latent collected from minibatches, "
                "e.g. the median() of a guide whose plate subsamples, hold only one minibatch's rows)"
            )
        offset = 0
        for n, shape in self._shapes.items():
            if n == name:
                break
            offset += math.prod(shape)
        z = self.posterior_mean[offset : offset + math.prod(self._shapes[name])].reshape(self._shapes[name])
        return to_support(z).detach()

    def _check_site(self, name: str, support: constraints.Constraint) -> None:
        """Hook: refuse a site whose moments may not be in unconstrained space (see :class:`AutoSWAG`)."""

    def _prototype_hide_fn(self, msg: dict) -> bool:
        # the guide covers exactly the given sites; the model draws every other site itself (e.g. the observation
        # site, which is not observed when Predictive calls the model without targets)
        return prototype_hide_fn(msg) or msg["name"] not in self._shapes

    def _setup_prototype(self, *args: Any, **kwargs: Any) -> None:
        owner = type(self).__name__
        try:
            super()._setup_prototype(*args, **kwargs)
        except RuntimeError:  # AutoContinuous found none of the sites in the model
            if self.prototype_trace is None:
                raise
        found = {name: site for name, site in self.prototype_trace.iter_stochastic_nodes()}
        missing = [name for name in self._shapes if name not in found]
        if missing:
            self.prototype_trace = None
            raise ValueError(
                f"{owner}: the sites {missing} are not latent sample sites of the model (its latent sites among the "
                f"given ones: {list(found)})"
            )
        for name, site in found.items():
            self._check_site(name, site["fn"].support)
        model_shapes = dict(self._unconstrained_shapes)
        for name, shape in model_shapes.items():
            if torch.Size(shape) != torch.Size(self._shapes[name]):
                raise ValueError(
                    f"{owner}: site {name!r} has unconstrained shape {tuple(shape)} in the model, "
                    f"{tuple(self._shapes[name])} in the moments"
                )
        offsets, pos = {}, 0
        for name, shape in self._shapes.items():
            offsets[name] = pos
            pos += math.prod(shape)
        # the model's order equals the moments' iff the sites come in the same order (their shapes match)
        identity = list(model_shapes) == list(self._shapes)
        device = self.posterior_mean.device
        self._order = None if identity else torch.cat(
            [torch.arange(offsets[n], offsets[n] + math.prod(s), device=device) for n, s in model_shapes.items()]
        )

    def _ordered(self, t: Tensor) -> Tensor:
        return t if self._order is None else t[self._order.to(t.device)]

    def get_posterior(self, *args: Any, **kwargs: Any) -> dist.TorchDistribution:
        """The Gaussian over the packed unconstrained latent vector (model trace order); the guide must have run once
        (or pass the model's arguments)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        return LowRankPlusDiagonalNormal(
            self._ordered(self.posterior_mean), self._ordered(self.posterior_variance),
            self._ordered(self.posterior_factor),
        )

    def _loc_scale(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The mean and marginal standard deviations (for ``median()`` and ``quantiles()``; pass the model's
        arguments the first time if the guide has not been called yet)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        posterior = self.get_posterior()
        return posterior.mean, posterior.variance.sqrt()
