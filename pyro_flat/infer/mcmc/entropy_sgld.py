r"""Entropy-SGLD: Langevin dynamics on the local entropy, with an inner SGLD chain (a comparison for Entropy-MCMC)."""

from __future__ import annotations

from .entropy_sgd import EntropySGD

__all__ = ["EntropySGLD"]


class EntropySGLD(EntropySGD):
    r"""Entropy-SGLD [1]: :class:`~pyro_flat.infer.mcmc.EntropySGD` whose outer step is a Langevin step on the local
    entropy, an :class:`~pyro.infer.mcmc.MCMCKernel`.

    Target of the outer variable: the Gibbs density of the local entropy,
    :math:`p(x) \propto \exp(F(x;\eta)/T)` with :math:`F(x;\eta) = \log\int\exp(-U(x')-\|x-x'\|^2/(2\eta))\,dx'` —
    at :math:`T = 1` the posterior convolved with :math:`\mathcal N(0,\eta I)`, the same law as the anchors of
    :class:`~pyro_flat.infer.mcmc.EntropyMCMC`. Every transition runs the :math:`L` inner SGLD steps of Entropy-SGD
    (the running mean :math:`\mu` estimates :math:`\mathbb E[x'\mid x]`) and then

    .. math:: x \leftarrow x - \lambda\,\frac{x-\mu}{\eta} + \sqrt{2\lambda T}\,\xi,\qquad\xi\sim\mathcal N(0,I),

    an SGLD step (:func:`~pyro_flat.ops.diffusions.langevin_step`) on :math:`-F` with the estimated gradient
    :math:`(x-\mu)/\eta`, outer step size :math:`\lambda` (default :math:`\eta`, which gives
    :math:`x \leftarrow \mu + \sqrt{2\eta T}\,\xi`) and temperature :math:`T` (:math:`1/\tau` of [1]). Each
    transition costs :math:`L` gradient evaluations. Parameters as for :class:`~pyro_flat.infer.mcmc.EntropySGD`.

    .. warning:: Doubly biased: by the finite inner chain (:math:`\mu` is a noisy, finite-:math:`L` estimate of
        :math:`\mathbb E[x'\mid x]`) and by the unadjusted outer step.

    **Mapping.** The Entropy-MCMC authors' re-implementation uses :math:`x \leftarrow \mu + \sqrt{\alpha\eta}\,\xi` on
    their mean-loss scale; here the outer noise follows from SGLD on :math:`F` with step :math:`\lambda`.

    References:
        * [1] `Entropy-SGD optimizes the prior of a PAC-Bayes bound: Generalization properties of Entropy-SGD and
          data-dependent priors`, Gintare Karolina Dziugaite, Daniel M. Roy (ICML 2018), arXiv:1712.09376
        * [2] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    """

    outer_noise = True
