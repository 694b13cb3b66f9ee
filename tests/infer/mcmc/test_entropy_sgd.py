import math

import pytest
import torch

from pyro_flat.infer.mcmc import EntropySGD, EntropySGLD

from .conftest import mcse_z


def _quadratic():
    q, _ = torch.linalg.qr(torch.tensor([[1.0, 0.3, -0.2], [0.1, 1.0, 0.4], [-0.5, 0.2, 1.0]]))
    a = q @ torch.diag(torch.tensor([0.5, 2.0, 8.0])) @ q.T
    mu = torch.tensor([1.0, -2.0, 0.5])

    def potential(params):
        centred = params["x"] - mu
        return 0.5 * ((centred @ a) * centred).sum()

    return a, mu, potential


def test_closed_form_identity():
    # gamma (x - E[x'|x]) = gamma (A + gamma I)^-1 A (x - mu) with E[x'|x] = (A + gamma I)^-1 (A mu + gamma x)
    a, mu, _ = _quadratic()
    gamma, x = 1.0, torch.tensor([-3.0, 2.0, 1.0])
    inner_mean = torch.linalg.solve(a + gamma * torch.eye(3), a @ mu + gamma * x)
    assert torch.allclose(gamma * (x - inner_mean), gamma * torch.linalg.solve(a + gamma * torch.eye(3), a @ (x - mu)))


@pytest.mark.statistical
def test_inner_loop_mean_matches_the_closed_form():
    # f = (x' - mu)^T A (x' - mu) / 2, A eigenvalues {0.5, 2, 8}, gamma = 1 / eta = 1. The inner
    # chain targets p(x'|x) with mean (A + gamma I)^-1 (A mu + gamma x) (ULA is unbiased for a Gaussian mean).
    # 512 chains vectorised through a separable potential_fn, step 0.01; a first inner loop of 1000 steps burns in
    # (the chain continues), the second averages 2000 steps (mean_weight=None). z < 4.5 per coordinate from the ESS
    # of the inner positions (~ 10^4), seed 0.
    a, mu, potential = _quadratic()
    x = torch.tensor([-3.0, 2.0, 1.0])
    chains = 512
    kernel = EntropySGD(potential_fn=potential, eta=1.0, step_size=0.01, num_inner_steps=1000, mean_weight=None)
    kernel.initial_params = {"x": x.expand(chains, 3).clone()}
    kernel.setup(0)
    outer = kernel.initial_params
    kernel.inner_loop(outer)  # burn-in
    kernel.num_inner_steps = 2000
    trace = []
    original = kernel._record

    def spy(tensors, potential, **kw):
        if kw.get("label"):
            trace.append(tensors["x"])
        original(tensors, potential, **kw)

    kernel._record = spy
    mean = kernel.inner_loop(outer)["x"]  # [512, 3]
    draws = torch.stack(trace, 1)  # [512, 2000, 3]
    assert torch.allclose(mean, draws.mean(1))  # the running mean with a = 1/(k+1) is the plain average
    closed_form = torch.linalg.solve(a + torch.eye(3), a @ mu + x)
    for i in range(3):
        assert mcse_z(draws[..., i], float(closed_form[i])) < 4.5
    assert kernel.num_gradient_steps == 3000


def test_outer_step_of_entropy_sgd():
    _, _, potential = _quadratic()
    kernel = EntropySGD(potential_fn=potential, eta=0.5, step_size=0.01, num_inner_steps=4, outer_step_size=0.2)
    kernel.initial_params = {"x": torch.tensor([-3.0, 2.0, 1.0])}
    kernel.setup(0)
    x = kernel.initial_params["x"]
    new = kernel.sample(kernel.initial_params)["x"]
    mu = kernel.last_inner_mean["x"]
    # x <- x - lambda (x - mu) / eta
    assert torch.allclose(new, x - 0.2 * (x - mu) / 0.5)
    assert kernel.num_gradient_steps == 4
    # the default outer step size eta gives x <- mu (the Entropy-MCMC authors' eta_out * gamma = 1)
    kernel = EntropySGD(potential_fn=potential, eta=0.5, step_size=0.01, num_inner_steps=4)
    kernel.initial_params = {"x": x}
    kernel.setup(0)
    new = kernel.sample(kernel.initial_params)["x"]
    assert torch.allclose(new, kernel.last_inner_mean["x"])


def test_inner_start_outer_restarts_the_inner_chain_at_x():
    _, _, potential = _quadratic()
    kernel = EntropySGD(potential_fn=potential, eta=0.5, step_size=0.01, num_inner_steps=1, mean_weight=1.0,
                        temperature=0.0, inner_start="outer")
    kernel.initial_params = {"x": torch.zeros(3)}
    kernel.setup(0)
    x = torch.tensor([0.5, 0.5, 0.5])
    # one noiseless inner step from x itself: the coupling gradient vanishes there
    grads, _ = kernel._potential_grad({"x": x})
    assert torch.allclose(kernel.inner_loop({"x": x})["x"], x - 0.01 * grads["x"])


@pytest.mark.statistical
def test_entropy_sgld_outer_noise_has_the_langevin_scale():
    # x' = x - lambda (x - mu) / eta + sqrt(2 lambda T) xi: with lambda = eta, x' - mu ~ N(0, 2 eta T) independently
    # per coordinate. 20000 coordinates: se of the variance ratio 1 %, tolerance 4.5 se.
    def potential(params):
        return 0.5 * (params["x"] ** 2).sum()

    eta, temperature = 0.3, 0.5
    kernel = EntropySGLD(potential_fn=potential, eta=eta, step_size=0.01, num_inner_steps=2, temperature=temperature)
    kernel.initial_params = {"x": torch.zeros(20000)}
    kernel.setup(0)
    new = kernel.sample(kernel.initial_params)["x"]
    residual = new - kernel.last_inner_mean["x"]
    ratio = float(residual.var()) / (2 * eta * temperature)
    assert abs(ratio - 1) < 4.5 * math.sqrt(2 / 20000)
    # Entropy-SGD's outer step is noiseless
    sgd = EntropySGD(potential_fn=potential, eta=eta, step_size=0.01, num_inner_steps=2, temperature=temperature)
    sgd.initial_params = {"x": torch.zeros(20000)}
    sgd.setup(0)
    assert torch.allclose(sgd.sample(sgd.initial_params)["x"], sgd.last_inner_mean["x"], atol=1e-15)
