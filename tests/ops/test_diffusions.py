import math

import pytest
import torch
from pyro.ops.stats import effective_sample_size

from pyro_flat.ops.diffusions import coupling_grad, coupling_potential, langevin_step, running_mean, sghmc_step


def test_langevin_step_is_the_documented_formula():
    g = torch.Generator().manual_seed(1)
    theta, grad, noise = (torch.randn(4, 3, generator=g) for _ in range(3))
    out = langevin_step(theta, grad, 0.03, 0.7, noise)
    expected = theta - 0.03 * grad + math.sqrt(2 * 0.03 * 0.7) * noise
    assert torch.allclose(out, expected, atol=1e-15)


def test_langevin_step_does_not_modify_its_inputs():
    theta, grad, noise = torch.ones(3), torch.ones(3), torch.ones(3)
    langevin_step(theta, grad, 0.1, 1.0, noise)
    assert torch.equal(theta, torch.ones(3)) and torch.equal(grad, torch.ones(3))


def test_zero_gradient_at_zero_temperature_does_not_move_and_gradient_descends():
    theta = torch.tensor([0.3, -1.2])
    assert torch.equal(langevin_step(theta, torch.zeros(2), 0.5, 0.0, None), theta)
    assert torch.equal(langevin_step(theta, torch.zeros(2), 0.5, 0.0, torch.randn(2)), theta)
    # a positive gradient of the potential U = -log p moves the position down (up the log density)
    moved = langevin_step(theta, torch.tensor([1.0, 2.0]), 0.1, 0.0, None)
    assert torch.allclose(moved, theta - torch.tensor([0.1, 0.2]))
    new, momentum = sghmc_step(theta, torch.zeros(2), torch.zeros(2), 0.5, 0.3, 0.0, None)
    assert torch.equal(new, theta) and torch.equal(momentum, torch.zeros(2))


def test_noise_is_required_at_positive_temperature():
    with pytest.raises(ValueError, match="noise=None is only allowed at temperature 0"):
        langevin_step(torch.zeros(2), torch.zeros(2), 0.1, 1.0, None)
    with pytest.raises(ValueError, match="noise=None"):
        sghmc_step(torch.zeros(2), torch.zeros(2), torch.zeros(2), 0.1, 0.5, 1.0, None)


def test_sghmc_step_is_the_documented_formula_and_reduces_to_sgld():
    g = torch.Generator().manual_seed(2)
    theta, v, grad, noise = (torch.randn(5, generator=g) for _ in range(4))
    eps, alpha, temp = 0.02, 0.3, 1.3
    new, new_v = sghmc_step(theta, v, grad, eps, alpha, temp, noise)
    expected_v = (1 - alpha) * v - eps * grad + math.sqrt(2 * alpha * eps * temp) * noise
    assert torch.allclose(new_v, expected_v, atol=1e-15)
    assert torch.allclose(new, theta + expected_v, atol=1e-15)
    sgld = langevin_step(theta, grad, eps, temp, noise)
    assert torch.allclose(sghmc_step(theta, torch.zeros(5), grad, eps, 1.0, temp, noise)[0], sgld, atol=1e-15)


def test_coupling_potential_and_gradient():
    theta = torch.randn(3, 2, requires_grad=True)
    anchor = torch.randn(3, 2, requires_grad=True)
    energy = coupling_potential(theta, anchor, 0.25)
    assert torch.allclose(energy, ((theta - anchor) ** 2).sum() / 0.5)
    g_theta, g_anchor = torch.autograd.grad(energy, [theta, anchor])
    assert torch.allclose(coupling_grad(theta, anchor, 0.25), g_theta)
    assert torch.allclose(coupling_grad(anchor, theta, 0.25), g_anchor)


def test_running_mean():
    mean, value = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    assert torch.allclose(running_mean(mean, value, 0.25), 0.75 * mean + 0.25 * value)
    values = torch.randn(7, 2)
    avg = values[0]
    for k in range(1, 7):
        avg = running_mean(avg, values[k], 1 / (k + 1))
    assert torch.allclose(avg, values.mean(0))


@pytest.mark.statistical
def test_ula_on_a_gaussian_has_the_exact_discretised_law():
    # mu = 1.5, sigma^2 = 2, eps = 0.2, 256 chains, 500 warm-up, 4000 kept draws. The stationary
    # law of theta' = theta - eps (theta - mu)/sigma^2 + sqrt(2 eps) xi is N(mu, sigma^2 / (1 - eps / (2 sigma^2))).
    # Tolerance: z < 4.5 on the mean and the variance with se from the ESS (pyro.ops.stats), seed 0.
    torch.manual_seed(0)
    mu, var, eps, chains = 1.5, 2.0, 0.2, 256
    theta = torch.zeros(chains)
    draws = []
    for t in range(4500):
        theta = langevin_step(theta, (theta - mu) / var, eps, 1.0, torch.randn(chains))
        if t >= 500:
            draws.append(theta)
    x = torch.stack(draws, dim=1)  # [chains, draws]
    ess = float(effective_sample_size(x, chain_dim=0, sample_dim=1))
    ula_var = var / (1 - eps / (2 * var))
    assert abs(float(x.mean()) - mu) / math.sqrt(ula_var / ess) < 4.5
    se_var = ula_var * math.sqrt(2 / ess)
    assert abs(float(x.var()) - ula_var) / se_var < 4.5
    # the bias is real: the continuous variance 2.0 is about 8 standard errors away (ESS ~ 54k)
    assert abs(float(x.var()) - var) / se_var > 4.5


@pytest.mark.statistical
def test_sghmc_on_a_gaussian_has_the_exact_discretised_law():
    # With exact gradients of U = (theta - mu)^2 / (2 sigma^2) the SGHMC step is linear in (theta, v):
    # (theta', v') = F (theta, v) + (s, s) xi, s = sqrt(2 alpha eps T), so the stationary covariance C solves the
    # discrete Lyapunov equation C = F C F^T + s^2 [[1, 1], [1, 1]]. Tolerance z < 4.5 (ESS from pyro.ops.stats,
    # seed 0).
    torch.manual_seed(0)
    mu, var, eps, alpha, temp, chains = -0.5, 2.0, 0.05, 0.2, 1.0, 256
    f = torch.tensor([[1 - eps / var, 1 - alpha], [-eps / var, 1 - alpha]])
    s2 = 2 * alpha * eps * temp
    lyapunov = torch.eye(4) - torch.kron(f, f)
    cov = torch.linalg.solve(lyapunov, (s2 * torch.ones(2, 2)).reshape(-1)).reshape(2, 2)
    theta, v = torch.full((chains,), mu), torch.zeros(chains)
    draws = []
    for t in range(5000):
        theta, v = sghmc_step(theta, v, (theta - mu) / var, eps, alpha, temp, torch.randn(chains))
        if t >= 1000:
            draws.append(theta)
    x = torch.stack(draws, dim=1)
    ess = float(effective_sample_size(x, chain_dim=0, sample_dim=1))
    exact_var = float(cov[0, 0])
    assert abs(float(x.mean()) - mu) / math.sqrt(exact_var / ess) < 4.5
    assert abs(float(x.var()) - exact_var) / (exact_var * math.sqrt(2 / ess)) < 4.5

    def discretised_variance(step):
        f = torch.tensor([[1 - step / var, 1 - alpha], [-step / var, 1 - alpha]])
        c = torch.linalg.solve(torch.eye(4) - torch.kron(f, f), (2 * alpha * step * temp * torch.ones(4)))
        return float(c[0])

    # the bias (here +0.7 %) shrinks linearly in eps towards T sigma^2
    assert discretised_variance(eps) == pytest.approx(exact_var)
    biases = [discretised_variance(step) - temp * var for step in (eps, eps / 10, eps / 100)]
    assert biases[0] > 0 and biases[1] == pytest.approx(biases[0] / 10, rel=0.02)
    assert biases[2] == pytest.approx(biases[0] / 100, rel=0.02)
