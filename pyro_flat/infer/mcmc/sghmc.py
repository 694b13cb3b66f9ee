r"""Stochastic gradient Hamiltonian Monte Carlo (with friction) as a :class:`~pyro.infer.mcmc.MCMCKernel`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..._validation import check_real
from ...ops.diffusions import sghmc_step
from .base import Params, StochasticGradientKernel

__all__ = ["SGHMC"]


class SGHMC(StochasticGradientKernel):
    r"""Stochastic gradient Hamiltonian Monte Carlo (SGHMC) with friction [1], an
    :class:`~pyro.infer.mcmc.MCMCKernel` whose model draws its own minibatch.

    Target: :math:`p_T(z\mid\mathcal D)\propto\exp(-U(z)/T)` as for :class:`~pyro_flat.infer.mcmc.SGLD`. With a
    momentum :math:`v` (zero at the start of each chain and carried between draws) each gradient step is
    (:func:`~pyro_flat.ops.diffusions.sghmc_step`)

    .. math::
        v_{t+1} = (1-\alpha)\,v_t - \varepsilon_t\nabla\tilde U(z_t) + \sqrt{2\alpha\varepsilon_t T}\,\xi_t,\qquad
        z_{t+1} = z_t + v_{t+1},

    where :math:`\tilde U` is the minibatch estimate of the potential, :math:`\varepsilon_t` the step size (the
    learning rate, :math:`\eta` of [1]), :math:`\alpha` the friction (:math:`1-\alpha` is the momentum of SGD) and
    :math:`T` the temperature. :math:`\alpha = 1` gives SGLD.

    :param model: a Pyro model (see :class:`~pyro_flat.infer.mcmc.SGLD`); exactly one of ``model`` and
        ``potential_fn``.
    :param potential_fn: alternatively, a potential :math:`U(\{name: tensor\})`.
    :param float friction: :math:`\alpha \in (0, 1]` (default 0.1, i.e. momentum 0.9; [1] uses 0.01-0.1).
    :param kwargs: the options of every kernel (:class:`~pyro_flat.infer.mcmc.StochasticGradientKernel`):
        ``step_size`` (:math:`\varepsilon`, required), ``temperature`` (:math:`T`), ``init_strategy``, ``thinning``,
        ``divergence_check_every``, ``jit_compile``, ``jit_options``.

    .. warning:: No Metropolis correction and no estimate of the gradient noise (:math:`\hat\beta = 0`): the chain is
        biased at a finite step size, like SGLD.

    References:
        * [1] `Stochastic Gradient Hamiltonian Monte Carlo`, Tianqi Chen, Emily B. Fox, Carlos Guestrin (ICML 2014),
          arXiv:1402.4102
    """

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable[[Params], Tensor] | None = None,
        *,
        friction: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, potential_fn, **kwargs)
        self.friction = check_real(friction, "friction", low=0, high=1, low_open=True, owner="SGHMC")
        self._momentum: Params = {}

    def _setup_chain(self, params: Params) -> None:
        self._momentum = {name: torch.zeros_like(value) for name, value in params.items()}

    def _cleanup_chain(self) -> None:
        self._momentum = {}

    def _chain_state(self) -> dict:
        return {"momentum": dict(self._momentum)}

    def _load_chain_state(self, state: Mapping) -> None:
        self._momentum = dict(state["momentum"])

    def _transition(self, params: Params) -> Params:
        step_size, temperature = self._step_parameters(self._state.step)
        grads, potential = self._potential_grad(params)
        new, momentum = {}, {}
        for name, value in params.items():
            noise = self._noise(value, temperature)
            new[name], momentum[name] = sghmc_step(
                value, self._momentum[name], grads[name], step_size, self.friction, temperature, noise
            )
        self._momentum = momentum
        self._record(new, potential)
        return new
