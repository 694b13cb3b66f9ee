import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, Predictive
from pyro.ops.stats import split_gelman_rubin

from pyro_flat.data import BayesianLinearRegression
from pyro_flat.infer.mcmc import SGLD

from .conftest import covariance_z, mcse_z


def sgld_stationary_law(blr, step, batch, temperature=1.0):
    r"""The exact stationary mean and covariance of SGLD with minibatches of ``batch`` points drawn without replacement
    (Pyro's plate) on Bayesian linear regression, the discretised law the sampler must match.

    The minibatch gradient is A_b w - c_b with A_b = alpha I + k sum_i z_i x_i x_i^T, c_b = k sum_i z_i y_i x_i,
    k = beta N / B and inclusion indicators z_i (E z_i = p = B/N, E z_i z_j = q = B(B-1)/(N(N-1)) for i != j). The
    recursion w' = (I - eps A_b) w + eps c_b + sqrt(2 eps T) xi with a fresh batch each step is linear in the first
    two moments: the mean is the posterior mean exactly, and S = E[w w^T] solves a D^2 x D^2 linear system.
    """
    x, y = blr.x, blr.y
    n, d = x.shape
    alpha, k = blr.alpha, blr.beta * n / batch
    p = batch / n
    q = batch * (batch - 1) / (n * (n - 1))
    outer = torch.einsum("ni,nj->nij", x, x)
    sum_outer, sum_yx = outer.sum(0), (y[:, None] * x).sum(0)
    a_bar = alpha * torch.eye(d) + k * p * sum_outer
    c_bar = k * p * sum_yx
    m = torch.linalg.solve(a_bar, c_bar)

    def mean_a_s_a(s):
        pairs = q * sum_outer @ s @ sum_outer + (p - q) * torch.einsum("nij,jk,nkl->il", outer, s, outer)
        return alpha**2 * s + alpha * k * p * (sum_outer @ s + s @ sum_outer) + k**2 * pairs

    mean_a_m_c = alpha * torch.outer(m, c_bar) + k**2 * (
        q * torch.outer(sum_outer @ m, sum_yx) + (p - q) * torch.einsum("nij,j,n,nk->ik", outer, m, y, x)
    )
    mean_c_c = k**2 * (q * torch.outer(sum_yx, sum_yx) + (p - q) * torch.einsum("n,ni,nj->ij", y * y, x, x))
    mean_m_c = torch.outer(m, c_bar) - step * mean_a_m_c
    constant = step * (mean_m_c + mean_m_c.T) + step**2 * mean_c_c + 2 * step * temperature * torch.eye(d)

    def linear_part(s):
        return s - step * (a_bar @ s + s @ a_bar) + step**2 * mean_a_s_a(s)

    basis = torch.eye(d * d).reshape(d * d, d, d)
    matrix = torch.stack([linear_part(e).reshape(-1) for e in basis], dim=1)
    second = torch.linalg.solve(torch.eye(d * d) - matrix, constant.reshape(-1)).reshape(d, d)
    return m, second - torch.outer(m, m)


def test_stationary_law_helper_reduces_to_ula_and_to_the_posterior():
    blr = BayesianLinearRegression.generate(64, 2, beta=1.0)
    precision = torch.linalg.inv(blr.posterior_covariance)
    # full batch: the ULA law (P - eps P^2 / 2)^-1 of the discretised chain
    m, cov = sgld_stationary_law(blr, 0.01, 64)
    assert torch.allclose(cov, torch.linalg.inv(precision - 0.01 * precision @ precision / 2), atol=1e-12)
    assert torch.allclose(m, blr.posterior_mean, atol=1e-12)
    # minibatches: the covariance bias shrinks linearly as the step size halves, towards the exact posterior
    bias = [sgld_stationary_law(blr, eps, 16)[1] - blr.posterior_covariance for eps in (4e-4, 2e-4, 1e-4)]
    assert (bias[0].diag() > 0).all()
    assert torch.allclose(bias[1], bias[0] / 2, rtol=0.05, atol=1e-6)
    assert torch.allclose(bias[2], bias[0] / 4, rtol=0.05, atol=1e-6)


@pytest.mark.statistical
def test_sgld_with_minibatches_recovers_the_discretised_posterior_of_linear_regression(monkeypatch):
    # SGLD on Bayesian linear regression (N = 64, D = 2, beta = 1) with the likelihood in a subsampled plate
    # (B = 16), step 0.005, two sequential chains x 2500 draws after 200 warm-up steps (seed 0). The mean must be the
    # exact posterior mean; the covariance that of the exact minibatch-SGLD law above, which is 1.7x the posterior
    # covariance at this step (the unadjusted bias; it shrinks linearly with the step). z < 4.5 per entry from the
    # MCSE (ESS ~ 800), 5 asserts; r_hat < 1.05.
    blr = BayesianLinearRegression.generate(64, 2, beta=1.0)
    step, batch = 0.005, 16
    mean, cov = sgld_stationary_law(blr, step, batch)
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 1)  # sequential chains whatever the machine
    with pytest.warns(UserWarning, match="Chains will be drawn sequentially"):
        mcmc = MCMC(SGLD(blr.model, step_size=step), num_samples=2500, warmup_steps=200, num_chains=2,
                    disable_progbar=True)
    mcmc.run(subsample_size=batch)
    w = mcmc.get_samples(group_by_chain=True)["w"]  # [2, 4000, 2]
    assert w.shape == (2, 2500, 2)
    for i in range(2):
        assert mcse_z(w[..., i], float(blr.posterior_mean[i])) < 4.5
    assert (covariance_z(w, mean, cov) < 4.5).all()
    # the discretisation bias is visible: the posterior covariance itself is far outside the MC error
    assert (covariance_z(w, mean, blr.posterior_covariance).diag() > 4.5).all()
    assert (split_gelman_rubin(w, chain_dim=0, sample_dim=1) < 1.05).all()


def test_each_gradient_step_draws_a_fresh_minibatch():
    blr = BayesianLinearRegression.generate(50, 2)
    seen = []

    def model(subsample_size):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", 50, subsample_size=subsample_size) as idx:
            seen.append(idx.clone())
            pyro.sample("obs", dist.Normal((blr.x[idx] * w).sum(-1), blr.beta**-0.5), obs=blr.y[idx])

    kernel = SGLD(model, step_size=1e-3)
    MCMC(kernel, num_samples=6, warmup_steps=0, disable_progbar=True).run(subsample_size=10)
    assert kernel.num_gradient_steps == 0  # reset by cleanup
    batches = seen[-6:]  # one model call per gradient step (after the initialisation's)
    assert all(len(b) == 10 and len(set(b.tolist())) == 10 for b in batches)
    assert all(not torch.equal(batches[i], batches[i + 1]) for i in range(5))


def test_predictive_on_sgld_samples():
    blr = BayesianLinearRegression.generate(40, 2)
    mcmc = MCMC(SGLD(blr.model, step_size=2e-3, thinning=2), num_samples=20, warmup_steps=50, disable_progbar=True)
    mcmc.run(subsample_size=8)
    samples = mcmc.get_samples()
    out = Predictive(blr.model, posterior_samples=samples, return_sites=["obs"])(blr.x[:5])
    assert out["obs"].shape == (20, 5)
    # the predictive mean follows the sampled weights
    assert torch.allclose(out["obs"].mean(0), (blr.x[:5] @ samples["w"].mean(0)), atol=4 * 0.2 / math.sqrt(20) * 3)


@pytest.mark.statistical
def test_constrained_sites_sample_the_right_density():
    # s ~ Gamma(3, 2) (64 iid coordinates) and nothing else: SGLD runs on z = log s, whose density includes
    # log|ds/dz| = z. Without the Jacobian term the chain would sample a Gamma(2, 2) (mean 1.0) instead of the mean
    # 1.5 here. Step 0.02 (the ULA bias on the mean is far inside the tolerance), one chain of 1000 draws after 200
    # warm-up steps; the coordinates act as chains for the ESS (~ 1900); z < 4.5 (seed 0).
    def model():
        pyro.sample("s", dist.Gamma(3.0, 2.0).expand([64]).to_event(1))

    mcmc = MCMC(SGLD(model, step_size=0.02), num_samples=1000, warmup_steps=200, disable_progbar=True)
    mcmc.run()
    s = mcmc.get_samples()["s"].T  # [64, 1000]
    assert (s > 0).all()
    assert mcse_z(s, 1.5) < 4.5
    assert mcse_z(s, 1.0) > 4.5


def test_zero_temperature_is_stochastic_gradient_descent():
    # with a deterministic potential and T = 0 one kernel step is exactly z - eps grad U(z)
    def potential(p):
        return (p["a"] ** 2).sum() + 3 * p["b"].sum()

    kernel = SGLD(potential_fn=potential, step_size=0.1, temperature=0.0)
    kernel.initial_params = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    kernel.setup(0)
    out = kernel.sample(kernel.initial_params)
    assert torch.allclose(out["a"], torch.tensor([0.8, -1.6]))
    assert torch.allclose(out["b"], torch.tensor([0.2]))
