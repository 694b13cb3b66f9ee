r"""The low-rank-plus-diagonal Gaussian family of SWAG and SA-BMA.

A Gaussian :math:`\mathcal N(m, \Sigma)` on :math:`\mathbb R^P` with

.. math:: \Sigma = \mathrm{diag}(s^2) + W W^\top = \mathrm{diag}(s)\,(I + VV^\top)\,\mathrm{diag}(s),
    \qquad W = \mathrm{diag}(s)\,V \in \mathbb R^{P\times K},

sampled as :math:`\theta = m + s\odot(z_1 + V z_2)` with :math:`z_1\sim\mathcal N(0, I_P)`, :math:`z_2\sim
\mathcal N(0, I_K)`. The functions here take the *relative* factor :math:`V` (the parameterisation of Pyro's
:class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`): the capacitance :math:`I + V^\top V` of the Woodbury
identity then stays well conditioned however small :math:`s` is, whereas :math:`I + W^\top\mathrm{diag}(s^{-2})W`
overflows float32 when a SWAG coordinate barely moved.

SWAG [1] estimates the family from SGD iterates :math:`\theta_1,\dots,\theta_T`: the running mean :math:`\bar\theta`,
the diagonal variance :math:`\overline{\theta^2} - \bar\theta^2` and the deviation matrix
:math:`D = [\theta_{T-K+1} - \bar\theta_{T-K+1}, \dots]` of the last :math:`K` iterates, and samples

.. math:: \theta = \bar\theta + \sqrt{c}\,\Big(\sqrt{\mathrm{var}}\odot z_1 + \frac{D z_2}{\sqrt{K-1}}\Big),

where :math:`c` is SWAG's ``scale`` (:math:`c = 1/2` gives the paper's :math:`\tfrac12(\Sigma_{\rm diag} +
\Sigma_{\rm low\,rank})`). Hence :math:`s = \sqrt{c\cdot\mathrm{var}}`, :math:`W = \sqrt{c}\,D/\sqrt{K-1}` and
:math:`V_{ik} = D_{ik}/\sqrt{(K-1)\,\mathrm{var}_i}` (``c`` cancels).

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["low_rank_covariance_product", "swag_to_low_rank"]


def low_rank_covariance_product(scale: Tensor, factor: Tensor, vector: Tensor) -> Tensor:
    r""":math:`\Sigma v = s\odot\big(s\odot v + V (V^\top (s\odot v))\big)` in :math:`O(PK)`, with the relative
    factor :math:`V` (``vector`` may carry leading batch dimensions)."""
    scaled = scale * vector
    return scale * (scaled + (scaled @ factor) @ factor.transpose(-1, -2))


def swag_to_low_rank(
    mean: Tensor, variance: Tensor, deviations: Tensor, *, scale: float = 0.5, min_variance: float = 1e-30
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Convert SWAG moments into the parameters :math:`(m, s, V)` of the low-rank-plus-diagonal Gaussian.

    :param mean: :math:`\bar\theta`, shape ``[P]``.
    :param variance: the diagonal variance :math:`\overline{\theta^2}-\bar\theta^2`, shape ``[P]`` (clamped below at
        ``min_variance``, as SWAG's ``var_clamp``, since round-off can make it slightly negative).
    :param deviations: :math:`D`, shape ``[P, K]`` with :math:`K \ge 1` columns (:math:`K - 1` is replaced by 1 when
        :math:`K = 1`).
    :param scale: SWAG's covariance scale :math:`c > 0` (default 0.5, the SWAG paper's choice).
    :param min_variance: the clamp of ``variance``, :math:`> 0`.
    :returns: ``(loc, scale, factor)`` with ``loc = mean``, ``scale`` :math:`s=\sqrt{c\cdot\mathrm{var}}` and the
        relative ``factor`` :math:`V = D/\sqrt{(K-1)\,\mathrm{var}}` (rows divided), new tensors; the covariance
        :math:`\mathrm{diag}(s)(I+VV^\top)\mathrm{diag}(s)` equals SWAG's :math:`c\,(\mathrm{diag}(\mathrm{var}) +
        DD^\top/(K-1))`.
    """
    if mean.dim() != 1:
        raise ValueError(f"swag_to_low_rank: `mean` must be a vector [P], got shape {tuple(mean.shape)}")
    if variance.shape != mean.shape:
        raise ValueError(
            f"swag_to_low_rank: `variance` must have the shape of `mean` {tuple(mean.shape)}, got "
            f"{tuple(variance.shape)}"
        )
    if deviations.dim() != 2 or deviations.shape[0] != mean.shape[0] or deviations.shape[1] < 1:
        raise ValueError(
            f"swag_to_low_rank: `deviations` must be a matrix [P={mean.shape[0]}, K>=1], got shape "
            f"{tuple(deviations.shape)}"
        )
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"swag_to_low_rank: `scale` must be a finite number > 0, got {scale!r}")
    if not (isinstance(min_variance, (int, float)) and min_variance > 0):
        raise ValueError(f"swag_to_low_rank: `min_variance` must be a number > 0, got {min_variance!r}")
    rank = deviations.shape[1]
    variance = variance.clamp(min=min_variance)
    factor = deviations / (max(rank - 1, 1) * variance).sqrt().unsqueeze(-1)
    return mean.clone(), (scale * variance).sqrt(), factor
