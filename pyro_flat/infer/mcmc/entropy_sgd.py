r"""Entropy-SGD: a nested chain that descends the local entropy (kept as a comparison for Entropy-MCMC)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from ..._validation import check_int, check_positive, check_real
from ...ops.diffusions import coupling_grad, langevin_step, running_mean
from .base import Params, StochasticGradientKernel

__all__ = ["EntropySGD"]


class EntropySGD(StochasticGradientKernel):
    r"""Entropy-SGD [1] as an :class:`~pyro.infer.mcmc.MCMCKernel`: an inner SGLD chain estimates the gradient of
    the local entropy, and the outer variable descends it.

    The local entropy of the potential :math:`U` (the model's full-data negative log joint, unconstrained
    coordinates) is

    .. math:: F(x;\eta) = \log\int\exp\Big(-U(x') - \frac{\|x-x'\|^2}{2\eta}\Big)\,dx', \qquad
        -\nabla F(x;\eta) = \frac{x - \mathbb E[x'\mid x]}{\eta},

    the expectation under the inner density :math:`p(x'\mid x)\propto\exp(-[U(x') + \|x-x'\|^2/(2\eta)]/T)`. One
    transition (one draw of ``MCMC`` before thinning) runs :math:`L` = ``num_inner_steps`` inner SGLD steps on
    minibatches (:func:`~pyro_flat.ops.diffusions.langevin_step`, step :math:`\varepsilon_t` from ``step_size``,
    temperature :math:`T`), averaging them into :math:`\mu` with weight :math:`a` (:func:`~pyro_flat.ops.diffusions
    .running_mean`, :math:`\mu` restarted from the inner chain's value at each transition), then takes the outer
    step with :math:`\lambda` = ``outer_step_size``:

    .. math::
        x'_{l+1} &= x'_l - \varepsilon_t\Big[\nabla\tilde U(x'_l) + \frac{x'_l - x}{\eta}\Big]
                    + \sqrt{2\varepsilon_t T}\,\xi_l,\qquad \mu \leftarrow (1-a)\,\mu + a\,x'_{l+1}, \\
        x &\leftarrow x - \lambda\,\frac{x-\mu}{\eta} \quad(\text{Entropy-SGD}), \qquad
        x \leftarrow x - \lambda\,\frac{x-\mu}{\eta} + \sqrt{2\lambda T}\,\xi
        \quad(\text{Entropy-SGLD, } :class:`~pyro_flat.infer.mcmc.EntropySGLD`).

    Each transition costs :math:`L` gradient evaluations; the default :math:`\lambda=\eta` makes the outer step
    :math:`x\leftarrow\mu` (the Entropy-MCMC authors' re-implementation; :math:`\gamma = 1/\eta` of [1]).
    Entropy-SGD is an optimiser: its "draws" follow the outer iterate, which does not sample a posterior.

    :param model: a Pyro model (see :class:`~pyro_flat.infer.mcmc.SGLD`); exactly one of ``model`` and
        ``potential_fn``.
    :param potential_fn: alternatively, a potential :math:`U(\{name: tensor\})`.
    :param float eta: :math:`\eta > 0`, the coupling variance.
    :param int num_inner_steps: :math:`L \ge 1` (default 20, as in [1] and the Entropy-MCMC code).
    :param mean_weight: :math:`a \in (0, 1]` (default 0.25, the Entropy-MCMC code's :math:`5/L`; [1] uses 0.75), or
        ``None`` for the plain average of the :math:`L` inner positions.
    :type mean_weight: float or None
    :param outer_step_size: :math:`\lambda > 0` (default :math:`\eta`).
    :type outer_step_size: float or None
    :param str inner_start: ``"continue"`` (default) or ``"outer"`` (restart the inner chain at :math:`x`).
    :param kwargs: the options of every kernel (:class:`~pyro_flat.infer.mcmc.StochasticGradientKernel`):
        ``step_size`` (the inner step size :math:`\varepsilon`, indexed by gradient step, required),
        ``temperature`` (:math:`T` of the inner chain and of the Entropy-SGLD outer step), ``init_strategy``,
        ``thinning`` (transitions per draw), ``divergence_check_every``, ``jit_compile``, ``jit_options``.

    References:
        * [1] `Entropy-SGD: Biasing Gradient Descent Into Wide Valleys`, Pratik Chaudhari, Anna Choromanska, Stefano
          Soatto, Yann LeCun, Carlo Baldassi, Christian Borgs, Jennifer Chayes, Levent Sagun, Riccardo Zecchina
          (ICLR 2017), arXiv:1611.01838
        * [2] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    """

    outer_noise = False
    """Whether the outer step adds Langevin noise (Entropy-SGLD)."""

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable[[Params], Tensor] | None = None,
        *,
        eta: float,
        num_inner_steps: int = 20,
        mean_weight: float | None = 0.25,
        outer_step_size: float | None = None,
        inner_start: Literal["continue", "outer"] = "continue",
        **kwargs: Any,
    ) -> None:
        super().__init__(model, potential_fn, **kwargs)
        owner = type(self).__name__
        self.eta = check_positive(eta, "eta", owner=owner)
        self.num_inner_steps = check_int(num_inner_steps, "num_inner_steps", owner=owner)
        if mean_weight is not None:
            mean_weight = check_real(mean_weight, "mean_weight", low=0, high=1, low_open=True, owner=owner)
        self.mean_weight = mean_weight
        self.outer_step_size = self.eta if outer_step_size is None else check_positive(
            outer_step_size, "outer_step_size", owner=owner)
        if inner_start not in ("continue", "outer"):
            raise ValueError(f"{owner}: expected inner_start 'continue' or 'outer', got {inner_start!r}")
        self.inner_start = inner_start
        self._inner: Params = {}
        self.last_inner_mean: Params = {}

    def _setup_chain(self, params: Params) -> None:
        self._inner = {name: value.clone() for name, value in params.items()}
        self.last_inner_mean = {}

    def _cleanup_chain(self) -> None:
        self._inner = {}
        self.last_inner_mean = {}

    def _chain_state(self) -> dict:
        return {"inner": dict(self._inner), "last_inner_mean": dict(self.last_inner_mean)}

    def _load_chain_state(self, state: Mapping) -> None:
        self._inner, self.last_inner_mean = dict(state["inner"]), dict(state["last_inner_mean"])

    def inner_loop(self, outer: Params) -> Params:
        r"""Run the :math:`L` inner SGLD steps around the fixed outer value ``outer`` and return the running mean
        :math:`\mu` (an estimate of :math:`\mathbb E[x'\mid x]`); the inner chain's state is kept."""
        inner = outer if self.inner_start == "outer" else self._inner
        inner = {name: value.clone() for name, value in inner.items()}
        mean = dict(inner)
        for k in range(self.num_inner_steps):
            step_size, temperature = self._step_parameters(self._state.step)
            grads, potential = self._potential_grad(inner)
            inner = {
                name: langevin_step(
                    value,
                    grads[name] + coupling_grad(value, outer[name], self.eta),
                    step_size,
                    temperature,
                    self._noise(value, temperature),
                )
                for name, value in inner.items()
            }
            weight = 1.0 / (k + 1) if self.mean_weight is None else self.mean_weight
            mean = {name: running_mean(mean[name], inner[name], weight) for name in inner}
            self._record(inner, potential, label=" (inner chain)")
        self._inner = inner
        return mean

    def _transition(self, params: Params) -> Params:
        mean = self.inner_loop(params)
        self.last_inner_mean = mean
        temperature = self.temperature if self.outer_noise else 0.0
        new = {
            name: langevin_step(
                value,
                coupling_grad(value, mean[name], self.eta),
                self.outer_step_size,
                temperature,
                torch.randn_like(value) if temperature > 0 else None,
            )
            for name, value in params.items()
        }
        self._record(new, None, steps=0)
        return new
