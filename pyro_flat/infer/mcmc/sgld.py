r"""Stochastic gradient Langevin dynamics as a :class:`~pyro.infer.mcmc.MCMCKernel` with minibatches drawn inside the
model."""

from __future__ import annotations

from ...ops.diffusions import langevin_step
from .base import Params, StochasticGradientKernel

__all__ = ["SGLD"]


class SGLD(StochasticGradientKernel):
    r"""Stochastic gradient Langevin dynamics (SGLD) [1], an :class:`~pyro.infer.mcmc.MCMCKernel` for
    :class:`~pyro.infer.MCMC` whose model draws its own minibatch.

    .. math:: z_{t+1} = z_t - \varepsilon_t\,\nabla\tilde U(z_t) + \sqrt{2\varepsilon_t T}\,\xi_t,
        \qquad \xi_t\sim\mathcal N(0, I),

    in the unconstrained coordinates :math:`z`, with :math:`\tilde U` the potential on the minibatch drawn inside the
    model's ``pyro.plate("data", N, subsample_size=B)`` (likelihood scaled by :math:`N/B`); :math:`T = 1` targets the
    posterior, :math:`T = 0` is SGD on the MAP objective, a mean-loss learning rate :math:`\alpha` is
    :math:`\varepsilon = \alpha/N`, and a :class:`~pyro_flat.infer.mcmc.CyclicalStepSize` gives cSGLD [2]. There is
    no Metropolis correction: the chain is biased at any finite step size (the SG-MCMC page of the documentation).

    :param model: a Pyro model with continuous latent sites whose likelihood sits in ``pyro.plate("data", N,
        subsample_size=B)`` (or a plate without subsampling for full-batch Langevin); exactly one of ``model`` and
        ``potential_fn``.
    :param potential_fn: alternatively, a potential :math:`U(\{name: tensor\})` (then set ``initial_params``).
    :param kwargs: the options of every kernel (:class:`~pyro_flat.infer.mcmc.StochasticGradientKernel`):
        ``step_size`` (:math:`\varepsilon > 0` or a schedule; no default: it depends on :math:`N` and the model),
        ``temperature`` (:math:`T`, default 1), ``init_strategy`` (for networks :class:`~pyro_flat.nn.init_to_network`),
        ``thinning``, ``divergence_check_every``, ``jit_compile`` (compile the gradient evaluation), ``jit_options``.

    Example::

        model = BayesianMLP(64, 10)
        kernel = SGLD(model, step_size=1e-5, temperature=1.0, init_strategy=init_to_network(model), thinning=10)
        mcmc = MCMC(kernel, num_samples=50, warmup_steps=500)
        mcmc.run(x_train, y_train, subsample_size=128)      # the full data set; the model draws minibatches
        logits = Predictive(model, posterior_samples=mcmc.get_samples())(x_test)["logits"]

    References:
        * [1] `Bayesian Learning via Stochastic Gradient Langevin Dynamics`, Max Welling, Yee Whye Teh (ICML 2011)
        * [2] `Cyclical Stochastic Gradient MCMC for Bayesian Deep Learning`, Ruqi Zhang, Chunyuan Li, Jianyi Zhang,
          Changyou Chen, Andrew Gordon Wilson (ICLR 2020), arXiv:1902.03932
    """

    def _transition(self, params: Params) -> Params:
        step_size, temperature = self._step_parameters(self._state.step)
        grads, potential = self._potential_grad(params)
        new = {
            name: langevin_step(value, grads[name], step_size, temperature, self._noise(value, temperature))
            for name, value in params.items()
        }
        self._record(new, potential)
        return new
