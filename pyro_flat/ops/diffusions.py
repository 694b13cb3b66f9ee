r"""Discretised Langevin diffusions and the local-entropy coupling: the pure update rules of the SG-MCMC kernels.

Every stochastic-gradient kernel of :mod:`pyro_flat.infer.mcmc` calls these functions; the equations are written
(and tested) once, here. They import only ``torch``, take the Gaussian noise as an argument (so a test can fix it)
and return new tensors (the inputs are not modified).

**Convention** (used everywhere in pyro_flat). The target is the tempered density

.. math:: p_T(\theta) \propto \exp\big(-U(\theta)/T\big),

where :math:`U` is the *potential* (negative log density; for a Pyro model the full-data negative log joint, which
a ``pyro.plate("data", N, subsample_size=B)`` estimates without bias by scaling the minibatch log-likelihood by
:math:`N/B`) and :math:`T \ge 0` the temperature (:math:`T = 1`: the posterior; :math:`T = 0`: gradient descent).
One step of size :math:`\varepsilon > 0` with :math:`\xi \sim \mathcal N(0, I)` is

.. math:: \theta' = \theta - \varepsilon\,\nabla U(\theta) + \sqrt{2\varepsilon T}\,\xi .

The other common convention, :math:`\theta' = \theta + \tfrac{\epsilon}{2}\nabla\log p + \sqrt{\epsilon}\,\xi`, is
this one with :math:`\varepsilon = \epsilon/2`. Papers that write the loss as a *mean* over the data (Entropy-MCMC's
code, ``posteriors``) use a learning rate :math:`\alpha` on that scale; it corresponds to
:math:`\varepsilon = \alpha/N` here.

.. warning:: Without a Metropolis correction these updates are biased at any finite step size: on a Gaussian
    target :math:`\mathcal N(\mu, \sigma^2)` the chain of :func:`langevin_step` (exact gradients, :math:`T = 1`) has
    the stationary law :math:`\mathcal N\big(\mu, \sigma^2/(1 - \varepsilon/(2\sigma^2))\big)`; minibatch gradients
    add a further :math:`O(\varepsilon)` variance. The bias vanishes as :math:`\varepsilon \to 0` (pyro#1921).

References:
    * [1] `Bayesian Learning via Stochastic Gradient Langevin Dynamics`, Max Welling, Yee Whye Teh (ICML 2011)
    * [2] `Stochastic Gradient Hamiltonian Monte Carlo`, Tianqi Chen, Emily B. Fox, Carlos Guestrin (ICML 2014),
      arXiv:1402.4102
    * [3] `Entropy-SGD: Biasing Gradient Descent Into Wide Valleys`, Pratik Chaudhari, Anna Choromanska, Stefano
      Soatto, Yann LeCun, Carlo Baldassi, Christian Borgs, Jennifer Chayes, Levent Sagun, Riccardo Zecchina
      (ICLR 2017), arXiv:1611.01838
    * [4] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "langevin_step",
    "sghmc_step",
    "coupling_potential",
    "coupling_grad",
    "running_mean",
]


def _noise_scale(variance_factor: float, noise: Tensor | None, name: str) -> float:
    """``sqrt(variance_factor)``, checking that noise is given whenever it is needed."""
    if variance_factor < 0:
        raise ValueError(f"{name}: expected a non-negative noise variance (step_size, temperature >= 0)")
    if noise is None and variance_factor > 0:
        raise ValueError(f"{name}: noise=None is only allowed at temperature 0")
    return math.sqrt(variance_factor)


def langevin_step(
    position: Tensor, grad_potential: Tensor, step_size: float, temperature: float, noise: Tensor | None
) -> Tensor:
    r"""One step of the unadjusted (stochastic-gradient) Langevin algorithm, SGLD [1]:

    .. math:: \theta' = \theta - \varepsilon\,g + \sqrt{2\varepsilon T}\,\xi,

    where :math:`g` estimates :math:`\nabla U(\theta)`. Its continuous-time limit samples
    :math:`p_T \propto e^{-U/T}` (see the module docstring for the convention and the discretisation bias).

    :param Tensor position: :math:`\theta`.
    :param Tensor grad_potential: :math:`g`, the (stochastic) gradient of the potential :math:`U = -\log p`, same
        shape as ``position``.
    :param float step_size: :math:`\varepsilon > 0`.
    :param float temperature: :math:`T \ge 0` (0: plain gradient descent).
    :param noise: :math:`\xi`, standard normal, same shape as ``position``; ``None`` only when the temperature is 0.
    :type noise: Tensor or None
    :returns: :math:`\theta'`.
    """
    scale = _noise_scale(2.0 * step_size * temperature, noise, "langevin_step")
    out = torch.add(position, grad_potential, alpha=-step_size)
    if scale > 0:
        out.add_(noise, alpha=scale)
    return out


def sghmc_step(
    position: Tensor,
    momentum: Tensor,
    grad_potential: Tensor,
    step_size: float,
    friction: float,
    temperature: float,
    noise: Tensor | None,
) -> tuple[Tensor, Tensor]:
    r"""One step of stochastic-gradient Hamiltonian Monte Carlo, SGHMC [2] (its eq. 15, in the "SGD with momentum"
    parametrisation, without a gradient-noise estimate :math:`\hat\beta`):

    .. math::
        v' = (1-\alpha)\,v - \varepsilon\,g + \sqrt{2\alpha\varepsilon T}\,\xi, \qquad \theta' = \theta + v',

    with :math:`g` an estimate of :math:`\nabla U(\theta)`. As :math:`\varepsilon \to 0` the :math:`\theta`-marginal
    of the stationary law is :math:`p_T \propto e^{-U/T}`. :math:`\varepsilon` plays the role of the learning rate
    (:math:`\varepsilon = \eta` of [2], i.e. step² / mass) and :math:`1-\alpha` of the momentum; with
    :math:`\alpha = 1` and :math:`v = 0` the step is exactly :func:`langevin_step`.

    :param Tensor position: :math:`\theta`.
    :param Tensor momentum: :math:`v`, same shape.
    :param Tensor grad_potential: :math:`g`, same shape.
    :param float step_size: :math:`\varepsilon > 0`.
    :param float friction: :math:`\alpha \in (0, 1]`.
    :param float temperature: :math:`T \ge 0`.
    :param noise: :math:`\xi`, standard normal; ``None`` only when the temperature is 0.
    :type noise: Tensor or None
    :returns: ``(position', momentum')``.
    """
    scale = _noise_scale(2.0 * friction * step_size * temperature, noise, "sghmc_step")
    new_momentum = torch.add(momentum * (1.0 - friction), grad_potential, alpha=-step_size)
    if scale > 0:
        new_momentum.add_(noise, alpha=scale)
    return position + new_momentum, new_momentum


def coupling_potential(theta: Tensor, anchor: Tensor, eta: float) -> Tensor:
    r"""The local-entropy coupling energy :math:`\|\theta - \theta_a\|^2 / (2\eta)` (a scalar: summed over all
    elements) [3, 4].

    :param Tensor theta: :math:`\theta`.
    :param Tensor anchor: :math:`\theta_a`, same shape.
    :param float eta: :math:`\eta > 0`, the variance of the Gaussian smoothing kernel.
    """
    return (theta - anchor).pow(2).sum() / (2.0 * eta)


def coupling_grad(theta: Tensor, anchor: Tensor, eta: float) -> Tensor:
    r"""The gradient of :func:`coupling_potential` with respect to ``theta``: :math:`(\theta - \theta_a)/\eta`
    (with respect to ``anchor`` it is the negative).

    Entropy-SGD [3] uses it twice: in the inner chain (gradient in :math:`\theta'` with the anchor fixed) and as the
    outer gradient of the negative local entropy, :math:`-\nabla_x F(x;\eta) = (x - \langle\theta'\rangle)/\eta`,
    with :math:`\langle\theta'\rangle` the inner chain's mean.

    :param Tensor theta: :math:`\theta`.
    :param Tensor anchor: :math:`\theta_a`, same shape.
    :param float eta: :math:`\eta > 0`.
    """
    return (theta - anchor) / eta


def running_mean(mean: Tensor, value: Tensor, weight: float) -> Tensor:
    r"""An exponential running mean :math:`\mu' = (1 - a)\,\mu + a\,x` (Entropy-SGD's inner average [3]);
    :math:`a = 1/(k+1)` at the :math:`k`-th update (from 0) gives the plain average.

    :param Tensor mean: :math:`\mu`.
    :param Tensor value: :math:`x`, same shape.
    :param float weight: :math:`a \in (0, 1]`.
    """
    return torch.lerp(mean, value, weight)
