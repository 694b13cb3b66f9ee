r"""Running moments of a trajectory of vectors, and a buffer of its last deviations (SWA / SWAG / HWA).

For iterates :math:`\theta_1,\dots,\theta_n\in\mathbb R^P` collected along a trajectory, SWAG [1] keeps

.. math::
    \bar\theta_n = \frac{(n-1)\,\bar\theta_{n-1} + \theta_n}{n}, \qquad
    m_{2,n} = \frac{(n-1)\,m_{2,n-1} + \theta_n^2}{n}, \qquad
    D_{:,n} = \theta_n - \bar\theta_n,

the running mean, the running mean of squares (elementwise) and the *deviation* of the new iterate from the
**updated** mean (as ``swag/posteriors/swag.py`` of github.com/wjmaddox/swa_gaussian does); only the last :math:`K`
columns of :math:`D` are kept. The diagonal variance is

.. math:: \Sigma_{\mathrm{diag}} = \max(m_2 - \bar\theta^2,\ c),

with the clamp :math:`c = 10^{-30}` of the reference code, and a SWAG sample at scale :math:`\lambda` is

.. math::
    \tilde\theta = \bar\theta + \sqrt{\lambda}\,\Big(\Sigma_{\mathrm{diag}}^{1/2}\odot z_1
        + \frac{1}{\sqrt{K-1}}\,D z_2\Big),\qquad z_1\sim\mathcal N(0, I_P),\ z_2\sim\mathcal N(0, I_K),

i.e. :math:`\tilde\theta\sim\mathcal N\big(\bar\theta,\ \lambda(\Sigma_{\mathrm{diag}} + DD^\top/(K-1))\big)`;
:math:`\lambda = \tfrac12` gives the paper's :math:`\tfrac12(\Sigma_{\mathrm{diag}} + DD^\top/(K-1))`.

Everything here works on flat vectors, in place, on the tensors' own device (no host synchronisation).

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import check_int

VARIANCE_CLAMP = 1e-30
"""The lower clamp of the diagonal variance in github.com/wjmaddox/swa_gaussian (``var_clamp``)."""


def update_running_mean(mean: Tensor, value: Tensor, num_before: int) -> None:
    r"""Add ``value`` to the running mean of ``num_before`` values, **in place**:
    :math:`\bar x \leftarrow (n\bar x + x)/(n+1)`."""
    if num_before < 0:
        raise ValueError(f"`num_before` must be >= 0, got {num_before}")
    if num_before == 0:
        mean.copy_(value)
    else:
        mean.lerp_(value, 1.0 / (num_before + 1))


def update_running_moments(mean: Tensor, sq_mean: Tensor, value: Tensor, num_before: int) -> None:
    r"""Add ``value`` to the running mean and running mean of squares, **in place**.

    .. math:: \bar\theta \leftarrow \frac{n\bar\theta + \theta}{n+1},\qquad
        m_2 \leftarrow \frac{n\,m_2 + \theta^2}{n+1}

    :param mean: :math:`\bar\theta` of the first ``num_before`` values (any value when ``num_before == 0``).
    :param sq_mean: :math:`m_2`, same shape.
    :param value: the new value :math:`\theta`, same shape.
    :param int num_before: :math:`n\ge0`, how many values the moments already hold.
    """
    update_running_mean(mean, value, num_before)
    if num_before == 0:
        torch.mul(value, value, out=sq_mean)
    else:  # m2 (n / (n+1)) + theta^2 / (n+1) without a temporary theta^2 (a full copy of the weights)
        weight = 1.0 / (num_before + 1)
        sq_mean.mul_(1.0 - weight).addcmul_(value, value, value=weight)


def diagonal_variance(mean: Tensor, sq_mean: Tensor, clamp: float = VARIANCE_CLAMP) -> Tensor:
    r""":math:`\max(m_2-\bar\theta^2,\ c)` elementwise (the SWAG-Diagonal variance)."""
    return (sq_mean - mean.square()).clamp_min(clamp)


def low_rank_gaussian_sample(
    mean: Tensor,
    variance: Tensor,
    deviations: Tensor | None,
    scale: float,
    noise_diag: Tensor,
    noise_rank: Tensor | None = None,
) -> Tensor:
    r"""The SWAG sample :math:`\bar\theta+\sqrt\lambda(\Sigma_{\mathrm{diag}}^{1/2}z_1 + Dz_2/\sqrt{K-1})`.

    :param mean: :math:`\bar\theta`, shape ``[..., P]``.
    :param variance: :math:`\Sigma_{\mathrm{diag}}`, shape ``[P]``.
    :param deviations: :math:`D`, shape ``[P, K]`` with :math:`K\ge2`, or ``None`` for the diagonal sample.
    :param float scale: :math:`\lambda\ge0`.
    :param noise_diag: :math:`z_1`, shape ``[..., P]``.
    :param noise_rank: :math:`z_2`, shape ``[..., K]`` (needed with ``deviations``).
    """
    rand = variance.sqrt() * noise_diag
    if deviations is not None:
        rank = deviations.shape[-1]
        if rank < 2 or noise_rank is None:
            raise ValueError(f"the low-rank term needs K >= 2 deviation columns and `noise_rank`, got K = {rank}")
        rand = rand + (noise_rank @ deviations.T) / (rank - 1) ** 0.5
    return mean + scale**0.5 * rand


class DeviationBuffer:
    r"""The last ``max_rank`` columns :math:`D_{:,i}` of a trajectory's deviations, in a preallocated ring buffer.

    Appending costs one copy of a length-:math:`P` vector (no reallocation); :meth:`matrix` returns the columns in
    the order they were appended (oldest first), shape ``[P, K]`` with :math:`K=\min(n, \text{max\_rank})`.

    :param int max_rank: :math:`K_{\max}\ge1`, how many columns are kept.
    :param int size: :math:`P`, the length of a column.
    :param dtype: the dtype of the buffer.
    :param device: the device of the buffer.
    """

    def __init__(self, max_rank: int, size: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        check_int(max_rank, "max_rank")
        self.max_rank = max_rank
        self.rows = torch.zeros(max_rank, size, dtype=dtype, device=device)  # one deviation per row
        self.num_appended = 0

    @property
    def rank(self) -> int:
        """:math:`K`, the number of columns held."""
        return min(self.num_appended, self.max_rank)

    def append(self, column: Tensor, minus: Tensor | None = None) -> None:
        """Store ``column`` (length :math:`P`), or ``column - minus`` written straight into the buffer, overwriting
        the oldest column once ``max_rank`` are held."""
        row = self.rows[self.num_appended % self.max_rank]
        if minus is None:
            row.copy_(column)
        else:
            torch.sub(column, minus, out=row)
        self.num_appended += 1

    def matrix(self) -> Tensor:
        r""":math:`D`, shape ``[P, K]``, oldest column first (a new tensor)."""
        k, start = self.rank, self.num_appended % self.max_rank
        rows = self.rows[:k] if self.num_appended <= self.max_rank else torch.roll(self.rows, -start, dims=0)
        return rows.T.clone()


__all__ = [
    "VARIANCE_CLAMP",
    "DeviationBuffer",
    "diagonal_variance",
    "low_rank_gaussian_sample",
    "update_running_mean",
    "update_running_moments",
]
