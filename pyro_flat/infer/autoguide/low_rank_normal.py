r"""The Gaussian :math:`\mathcal N(\mu, \operatorname{diag}(d) + WW^\top)` in SWAG's sampling form: the distribution of
every fixed Gaussian guide (:class:`~pyro_flat.infer.autoguide.AutoGaussianPosterior`)."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import Tensor

from ...ops.low_rank import low_rank_log_prob, low_rank_rsample, low_rank_variance
from ...runtime.capture import is_capturing

__all__ = ["LowRankPlusDiagonalNormal"]


class LowRankPlusDiagonalNormal(dist.TorchDistribution):
    r"""The Gaussian :math:`\mathcal N(\mu,\ \operatorname{diag}(d) + WW^\top)` sampled as
    :math:`\mu + d^{1/2}\odot z_1 + Wz_2` (SWAG's sampler).

    Unlike :class:`~pyro.distributions.LowRankMultivariateNormal`, nothing is factorised at construction (the
    capacitance matrix of that class can fail to factorise when SWAG clamps variances to :math:`10^{-30}`): sampling
    costs :math:`O(PK)`, and :meth:`log_prob` builds the low-rank factorisation only when called. Neither makes a
    :math:`P\times K` temporary, nor do their gradients (:mod:`pyro_flat.ops.low_rank`). Leading dimensions
    of the parameters are batch dimensions, and :meth:`expand` adds them (Pyro's vectorised plates:
    ``Predictive(parallel=True)``, vectorised particles): a batch of draws is the same as as many draws.

    :param loc: :math:`\mu`, shape ``[..., P]``.
    :param cov_diag: :math:`d > 0`, shape ``[..., P]``.
    :param cov_factor: :math:`W`, shape ``[..., P, K]`` (``K = 0`` gives a diagonal Gaussian).
    :param validate_args: as for every torch distribution (default: Pyro's validation setting).
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "cov_diag": constraints.independent(constraints.positive, 1),
        "cov_factor": constraints.independent(constraints.real, 2),
    }
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: Tensor, cov_diag: Tensor, cov_factor: Tensor, validate_args: bool | None = None) -> None:
        if (loc.dim() < 1 or cov_diag.dim() < 1 or cov_factor.dim() < 2 or cov_diag.shape[-1] != loc.shape[-1]
                or cov_factor.shape[-2] != loc.shape[-1]):
            raise ValueError(
                f"expected loc [..., P], cov_diag [..., P], cov_factor [..., P, K]; got {tuple(loc.shape)}, "
                f"{tuple(cov_diag.shape)}, {tuple(cov_factor.shape)}"
            )
        batch_shape = torch.broadcast_shapes(loc.shape[:-1], cov_diag.shape[:-1], cov_factor.shape[:-2])
        self._set(loc, cov_diag, cov_factor, batch_shape)
        super().__init__(batch_shape, loc.shape[-1:], validate_args=validate_args)

    def _set(self, loc: Tensor, cov_diag: Tensor, cov_factor: Tensor, batch_shape: torch.Size) -> None:
        self._params = (loc, cov_diag, cov_factor)  # unbroadcast: the arithmetic never expands the factor
        self.loc = loc.expand(batch_shape + loc.shape[-1:])
        self.cov_diag = cov_diag.expand(batch_shape + loc.shape[-1:])
        self.cov_factor = cov_factor.expand(batch_shape + cov_factor.shape[-2:])

    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def variance(self) -> Tensor:
        _, cov_diag, cov_factor = self._params
        return low_rank_variance(cov_diag, cov_factor, relative=False).expand(self.loc.shape)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:  # noqa: B008
        loc, cov_diag, cov_factor = self._params
        shape = self._extended_shape(sample_shape)
        z1 = torch.randn(shape, dtype=loc.dtype, device=loc.device)
        rank = cov_factor.shape[-1]
        if rank == 0:
            return loc + cov_diag.sqrt() * z1
        z2 = torch.randn(shape[:-1] + (rank,), dtype=loc.dtype, device=loc.device)
        return low_rank_rsample(loc, cov_diag, cov_factor, z1, z2, relative=False)

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        loc, cov_diag, cov_factor = self._params
        if cov_factor.shape[-1] == 0:
            log_prob = dist.Normal(loc, cov_diag.sqrt()).log_prob(value).sum(-1)
        else:
            log_prob = low_rank_log_prob(value, loc, cov_diag, cov_factor, relative=False,
                                         check_errors=bool(self._validate_args),
                                         fused=not is_capturing())
        return log_prob.expand(torch.broadcast_shapes(value.shape[:-1], self.batch_shape))

    def expand(self, batch_shape: torch.Size, _instance: object = None) -> LowRankPlusDiagonalNormal:
        new = self._get_checked_instance(LowRankPlusDiagonalNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new._set(*self._params, batch_shape)
        super(LowRankPlusDiagonalNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new
