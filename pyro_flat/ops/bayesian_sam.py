r"""The update equations of Bayesian SAM (bSAM), on lists of tensors.

bSAM [1] keeps a diagonal Gaussian :math:`q(\theta)=\mathcal N\big(m,\ \operatorname{diag}(1/(N s))\big)` over the
weights: the mean :math:`m` (the network's weights), a precision-like vector :math:`s>0` and a momentum
:math:`g_m`. With :math:`N` the (effective) number of training examples, :math:`\bar\ell_j` the *mean* loss on
sub-batch :math:`j` of the minibatch (:math:`j=1..M`, "m-sharpness"), :math:`\delta=` ``prior_precision``
:math:`/N`, :math:`\gamma` the damping, :math:`\rho` the radius, :math:`\alpha` the learning rate and
:math:`\beta_1,\beta_2` the decay rates, one step is (``optim.py``, ``build_bsam_optimizer`` of
github.com/team-approx-bayes/bayesian-sam):

.. math::
    e_j &\sim \mathcal N(0, I), \qquad \theta_j = m + e_j / \sqrt{N s}
        &&\text{(noisy sample, } \sigma^2 = 1/(Ns)\text{)}\\
    g_j &= \nabla\bar\ell_j(\theta_j), \qquad \epsilon_j = \rho\, g_j / s
        &&\text{(perturbation of the mean, not normalised)}\\
    g_{\epsilon} &= \frac1M\sum_j \nabla\bar\ell_j(m + \epsilon_j), \qquad
        g_s = \frac1M\sum_j \sqrt{s}\,|g_j| \\
    g_m &\leftarrow \beta_1 g_m + (1-\beta_1)(g_\epsilon + \delta m) \\
    m &\leftarrow m - \alpha\, g_m / s &&\text{(with the old } s\text{)}\\
    s &\leftarrow \beta_2 s + (1-\beta_2)(g_s + \gamma + \delta),

all elementwise; as in the authors' code there is no bias correction, and :math:`s` already contains
:math:`\gamma+\delta`, so the sample variance is :math:`1/(Ns)`. The functions below implement the pieces so that the
optimizer (:class:`pyro_flat.optim.BayesianSAM`) and the tests share one implementation; the noise :math:`e_j` is an
argument. For a quadratic :math:`\bar\ell(\theta)=\tfrac12\sum_i h_i(\theta_i-a_i)^2` with :math:`\delta=0` the
recursion has the fixed point :math:`m=a`, :math:`\mathbb E[s] = h\sqrt{2/(\pi N)} + \gamma` (derived on the *Flat
Gaussians from trajectories* page of the documentation, ``docs/methods/trajectories.md``).

References:
    * [1] `SAM as an Optimal Relaxation of Bayes`, Thomas Möllenhoff, Mohammad Emtiyaz Khan (ICLR 2023),
      arXiv:2210.01620
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def bsam_posterior_std(s: Sequence[Tensor], num_data: float) -> list[Tensor]:
    r"""The standard deviations :math:`\sigma = 1/\sqrt{N s}` of :math:`q`."""
    return list(torch._foreach_rsqrt(torch._foreach_mul(list(s), float(num_data))))


def bsam_noisy_params(means: Sequence[Tensor], s: Sequence[Tensor], num_data: float, noise: Sequence[Tensor]) -> list[
    Tensor
]:
    r"""The noisy sample :math:`\theta = m + e/\sqrt{Ns}` for the given standard-normal ``noise`` :math:`e`."""
    return list(torch._foreach_addcmul(list(means), list(noise), bsam_posterior_std(s, num_data)))


def bsam_perturbed_means(means: Sequence[Tensor], grads: Sequence[Tensor], s: Sequence[Tensor], rho: float) -> list[
    Tensor
]:
    r"""The perturbed mean :math:`m + \epsilon` with :math:`\epsilon = \rho\, g / s` (elementwise; no norm)."""
    return list(torch._foreach_addcdiv(list(means), list(grads), list(s), value=rho))


def bsam_perturbation(grads: Sequence[Tensor], s: Sequence[Tensor], rho: float) -> list[Tensor]:
    r"""The perturbation of the mean :math:`\epsilon = \rho\, g / s` (elementwise; no norm)."""
    return list(torch._foreach_mul(torch._foreach_div(list(grads), list(s)), rho))


def bsam_curvature(grads: Sequence[Tensor], s: Sequence[Tensor]) -> list[Tensor]:
    r"""The curvature term of the :math:`s` update, :math:`\sqrt{s\, g^2} = \sqrt s\,|g|`."""
    return list(torch._foreach_mul(torch._foreach_sqrt(list(s)), torch._foreach_abs(list(grads))))


@torch.no_grad()
def bsam_update_(
    means: Sequence[Tensor],
    momenta: Sequence[Tensor],
    s: Sequence[Tensor],
    grads_perturbed: Sequence[Tensor],
    curvatures: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    delta: float,
    damping: float,
) -> None:
    r"""The bSAM update of :math:`(g_m, m, s)`, **in place**, from :math:`g_\epsilon` and :math:`g_s`.

    .. math::
        g_m \leftarrow \beta_1 g_m + (1-\beta_1)(g_\epsilon + \delta m),\quad
        m \leftarrow m - \alpha g_m/s,\quad
        s \leftarrow \beta_2 s + (1-\beta_2)(g_s + \gamma + \delta).

    :param means: :math:`m`, updated in place.
    :param momenta: :math:`g_m`, updated in place.
    :param s: :math:`s`, updated in place (after :math:`m`, which uses the old :math:`s`).
    :param grads_perturbed: :math:`g_\epsilon`, the (sub-batch averaged) gradient at the perturbed mean.
    :param curvatures: :math:`g_s`, the (sub-batch averaged) :math:`\sqrt s|g|` at the noisy samples.
    :param float lr: :math:`\alpha`.
    :param float beta1: :math:`\beta_1`.
    :param float beta2: :math:`\beta_2`.
    :param float delta: :math:`\delta` = prior precision / :math:`N`.
    :param float damping: :math:`\gamma`.
    """
    means, momenta, s = list(means), list(momenta), list(s)
    # g_m <- beta1 g_m + (1 - beta1) (g_eps + delta m)
    torch._foreach_mul_(momenta, beta1)
    torch._foreach_add_(momenta, list(grads_perturbed), alpha=1 - beta1)
    if delta != 0:
        torch._foreach_add_(momenta, means, alpha=(1 - beta1) * delta)
    # m <- m - lr g_m / s   (old s)
    torch._foreach_addcdiv_(means, momenta, s, value=-lr)
    # s <- beta2 s + (1 - beta2) (g_s + damping + delta)
    torch._foreach_mul_(s, beta2)
    torch._foreach_add_(s, list(curvatures), alpha=1 - beta2)
    torch._foreach_add_(s, (1 - beta2) * (damping + delta))


__all__ = [
    "bsam_curvature",
    "bsam_noisy_params",
    "bsam_perturbation",
    "bsam_perturbed_means",
    "bsam_posterior_std",
    "bsam_update_",
]
