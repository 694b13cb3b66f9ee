"""Stochastic-gradient MCMC on constrained latents with exact conjugate posteriors (Beta-Bernoulli, Gamma-Poisson):
the kernels move the unconstrained coordinates (logit p, log rate) and must recover the exact posterior moments.

Each model holds 32 independent copies of the latent (each with its own data), which act as chains for the effective
sample size (``pyro.ops.stats.effective_sample_size``). Tolerance: z = |estimate - truth| / MCSE < 4.5 for each
assert (a Bonferroni budget of 8 asserts per test: false-failure rate below 6e-5). Step-size bias: in the
unconstrained coordinates each posterior is close to a Gaussian of variance v, for which unadjusted Langevin inflates
the variance by the factor 1/(1 - eps/(2v)); with the steps below that is 1.2 % (Beta) and 1.1 % (Gamma), under a
quarter of the variance's Monte-Carlo standard error (about 5 % at ESS ~ 800), so the exact moments are the target.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.ops.stats import effective_sample_size

from pyro_flat.infer.mcmc import SGLD, EntropyMCMC

K = 32


def _z(draws: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest MCSE z-score over the K coordinates' pooled estimate: draws [S, K] -> chains K."""
    x = draws.T - truth.unsqueeze(-1)  # [K, S], centred per coordinate at its exact value
    ess = float(effective_sample_size(x, chain_dim=0, sample_dim=1))
    return abs(float(x.mean())) / (float(x.std()) / math.sqrt(ess))


def _check(draws: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> None:
    assert _z(draws, mean) < 4.5
    assert _z((draws - mean) ** 2, var) < 4.5


def beta_bernoulli(x):
    p = pyro.sample("p", dist.Beta(2.0, 2.0).expand([K]).to_event(1))
    pyro.sample("x", dist.Bernoulli(p.unsqueeze(-1).expand(x.shape)).to_event(2), obs=x)


def gamma_poisson(y):
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0).expand([K]).to_event(1))
    pyro.sample("y", dist.Poisson(rate.unsqueeze(-1).expand(y.shape)).to_event(2), obs=y)


@pytest.mark.statistical
@pytest.mark.parametrize("kernel", ["SGLD", "EntropyMCMC"])
def test_beta_bernoulli(kernel):
    torch.manual_seed(0)
    x = torch.bernoulli(torch.rand(K, 1).expand(K, 20))
    a, b = 2.0 + x.sum(-1), 2.0 + 20 - x.sum(-1)  # the exact posterior Beta(a, b) per coordinate
    step = 0.005
    build = (lambda: SGLD(beta_bernoulli, step_size=step)) if kernel == "SGLD" else (
        lambda: EntropyMCMC(beta_bernoulli, eta=0.5, step_size=step))
    mcmc = MCMC(build(), num_samples=2500, warmup_steps=300, disable_progbar=True)
    mcmc.run(x)
    p = mcmc.get_samples()["p"]
    assert ((p > 0) & (p < 1)).all()
    _check(p, a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1)))


@pytest.mark.statistical
@pytest.mark.parametrize("kernel", ["SGLD", "EntropyMCMC"])
def test_gamma_poisson(kernel):
    torch.manual_seed(1)
    y = torch.poisson(torch.full((K, 10), 2.0))
    shape, rate = 2.0 + y.sum(-1), 1.0 + 10
    step = 0.001
    build = (lambda: SGLD(gamma_poisson, step_size=step)) if kernel == "SGLD" else (
        lambda: EntropyMCMC(gamma_poisson, eta=0.5, step_size=step))
    mcmc = MCMC(build(), num_samples=2500, warmup_steps=300, disable_progbar=True)
    mcmc.run(y)
    lam = mcmc.get_samples()["rate"]
    assert (lam > 0).all()
    _check(lam, shape / rate, shape / rate**2)
