from __future__ import annotations

import math

import numpy as np
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDelta
from pyro.infer.mcmc.util import initialize_model

from pyro_flat.data import (
    BayesianLinearRegression,
    GaussianTarget,
    SharpFlatEnergy,
    heteroscedastic_mean,
    heteroscedastic_noise_std,
    heteroscedastic_regression,
    two_moons,
)

# Monte-Carlo checks compare an estimate with the exact value within Z standard errors of the estimate: Z = 5 makes
# a false alarm (two-sided) about 6e-7 likely per comparison, and the seeds are fixed, so the tests are deterministic.
Z = 5.0


def assert_moments_match(samples: torch.Tensor, mean: torch.Tensor, covariance: torch.Tensor) -> None:
    """Sample mean and covariance within Z Monte-Carlo standard errors (independent draws) of the exact values.

    SE(mean_i) = sqrt(Cov_ii / n); SE(cov_ij) = std((x_i - m_i)(x_j - m_j)) / sqrt(n), estimated from the draws.
    """
    n = len(samples)
    assert ((samples.mean(0) - mean).abs() <= Z * (covariance.diagonal() / n).sqrt()).all()
    centred = samples - mean
    products = centred[:, :, None] * centred[:, None, :]
    standard_error = products.std(0) / math.sqrt(n)
    assert ((products.mean(0) - covariance).abs() <= Z * standard_error).all()


def log_joint(model, site: str, value: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return poutine.trace(poutine.condition(model, data={site: value})).get_trace(*args, **kwargs).log_prob_sum()


# ------------------------------------------------------------------------------------------------------------------
# two moons and heteroscedastic regression


def test_two_moons_shapes_and_determinism():
    data = two_moons()
    assert data.x_train.shape == (100, 2) and data.x_test.shape == (500, 2) and data.num_classes == 2
    assert torch.equal(torch.bincount(data.y_train), torch.tensor([50, 50]))
    assert data.x_ood is None
    assert torch.equal(two_moons().x_train, data.x_train)
    assert not torch.equal(two_moons(seed=2).x_train, data.x_train)
    small = two_moons(num_data=11, num_test=6, dtype=torch.float32)
    assert small.dtype == torch.float32 and torch.equal(torch.bincount(small.y_train), torch.tensor([5, 6]))


def test_two_moons_geometry_without_noise():
    data = two_moons(num_data=200, noise=0.0)
    x, y = data.x_train, data.y_train
    upper, lower = x[y == 0], x[y == 1]
    torch.testing.assert_close(upper.norm(dim=1), torch.ones(100))  # (cos t, sin t)
    assert (upper[:, 1] >= -1e-12).all()
    torch.testing.assert_close((lower - torch.tensor([1.0, 0.5])).norm(dim=1), torch.ones(100))  # (1-cos t, .5-sin t)
    assert (lower[:, 1] <= 0.5 + 1e-12).all()


def test_two_moons_matches_sklearn_without_noise():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    x_ref, y_ref = sklearn_datasets.make_moons(n_samples=101, noise=0.0, shuffle=False)
    data = two_moons(num_data=101, noise=0.0)
    for label in (0, 1):
        ours = sorted(map(tuple, data.x_train[data.y_train == label].numpy().round(10).tolist()))
        ref = sorted(map(tuple, x_ref[y_ref == label].round(10).tolist()))
        assert ours == ref


def test_two_moons_errors():
    with pytest.raises(ValueError, match="`num_data` must be an int >= 2"):
        two_moons(num_data=1)
    with pytest.raises(ValueError, match="`noise` must be a finite number >= 0"):
        two_moons(noise=-0.1)


def test_heteroscedastic_regression_layout():
    data = heteroscedastic_regression()
    assert data.x_train.shape == (200, 1) and data.y_train.shape == (200,) and data.x_test.shape == (500, 1)
    x = data.x_train[:, 0]
    assert ((x.abs() >= 1) & (x.abs() <= 3)).all()  # the gap (-1, 1) is empty
    assert 60 < int((x < 0).sum()) < 140
    assert data.x_test.min() == -5 and data.x_test.max() == 5
    assert torch.equal(heteroscedastic_regression().y_train, data.y_train)
    assert not torch.equal(heteroscedastic_regression(seed=1).y_train, data.y_train)
    assert heteroscedastic_regression(dtype=torch.float32).dtype == torch.float32


def test_heteroscedastic_regression_follows_the_documented_formula():
    n = 20_000
    data = heteroscedastic_regression(n, seed=3)
    x, y = data.x_train[:, 0], data.y_train
    torch.testing.assert_close(heteroscedastic_mean(x), torch.sin(2 * x) + 0.3 * x)
    torch.testing.assert_close(heteroscedastic_noise_std(x), 0.05 + 0.1 * x.abs())
    z = (y - heteroscedastic_mean(x)) / heteroscedastic_noise_std(x)
    # standardised residuals are N(0, 1): SE(mean) = 1/sqrt(n), SE(std) ~= 1/sqrt(2n)
    assert abs(float(z.mean())) < Z / math.sqrt(n)
    assert abs(float(z.std()) - 1) < Z / math.sqrt(2 * n)
    # and the raw noise really grows with |x|
    residual = y - heteroscedastic_mean(x)
    assert residual[x.abs() > 2.5].std() > 1.5 * residual[x.abs() < 1.5].std()


# ------------------------------------------------------------------------------------------------------------------
# SharpFlatEnergy


def test_sharp_flat_potential_matches_scipy_mixture():
    stats = pytest.importorskip("scipy.stats")
    special = pytest.importorskip("scipy.special")
    energy = SharpFlatEnergy()
    x = torch.tensor([[-2.0, 0.0], [2.0, 0.0], [0.0, 0.0], [-1.8, 0.3], [3.0, -2.0], [-2.5, 1.0]])
    log_components = np.stack(
        [
            np.log(0.5) + stats.multivariate_normal([-2, 0], 0.15**2 * np.eye(2)).logpdf(x.numpy()),
            np.log(0.5) + stats.multivariate_normal([2, 0], np.eye(2)).logpdf(x.numpy()),
        ]
    )
    expected = -special.logsumexp(log_components, axis=0)
    np.testing.assert_allclose(energy.potential(x).numpy(), expected, rtol=1e-12)
    torch.testing.assert_close(energy.log_prob(x), -energy.potential(x))
    assert energy.potential(x.reshape(2, 3, 2)).shape == (2, 3)


def test_sharp_flat_is_normalised_and_differentiable():
    energy = SharpFlatEnergy()
    h = 0.02
    grid = torch.stack(torch.meshgrid(torch.arange(-7, 8, h), torch.arange(-6, 6, h), indexing="ij"), dim=-1)
    assert abs(float(energy.log_prob(grid).exp().sum() * h * h) - 1) < 1e-6
    x = torch.tensor([[-1.9, 0.1], [0.5, -0.4], [2.5, 1.0]], requires_grad=True)
    assert torch.autograd.gradcheck(energy.potential, (x,))


def test_sharp_flat_exact_moments_and_samples():
    energy = SharpFlatEnergy()
    # hand-derived: mean 0; var_x = .5 (.15^2 + 4) + .5 (1 + 4) = 4.51125; var_y = .5 .15^2 + .5 = .51125
    torch.testing.assert_close(energy.mean, torch.zeros(2))
    torch.testing.assert_close(energy.covariance, torch.diag(torch.tensor([4.51125, 0.51125])))
    samples = energy.sample(200_000, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (200_000, 2) and samples.dtype == torch.float64
    assert_moments_match(samples, energy.mean, energy.covariance)
    # the flat-mode fraction is 1 - w = 0.5 (misclassified sharp draws are ~e^-8 rare): binomial SE = 0.5/sqrt(n)
    assert abs(float(energy.in_flat_mode(samples).double().mean()) - 0.5) < Z * 0.5 / math.sqrt(200_000) + 1e-3


def test_sharp_flat_in_flat_mode_and_modes():
    energy = SharpFlatEnergy()
    points = torch.stack([energy.sharp_mode, energy.flat_mode, torch.zeros(2), torch.tensor([-1.5, 0.0])])
    assert energy.in_flat_mode(points).tolist() == [False, True, True, False]
    assert energy.in_flat_mode(points.expand(3, 4, 2)).shape == (3, 4)
    # the component means are the modes: the gradient of U vanishes there (up to the other component's ~e^-8 tail)
    modes = torch.stack([energy.sharp_mode, energy.flat_mode]).requires_grad_()
    (grad,) = torch.autograd.grad(energy.potential(modes).sum(), modes)
    assert grad.abs().max() < 1e-3
    assert energy.potential(energy.sharp_mode) < energy.potential(energy.flat_mode)  # the sharp mode is higher


def test_sharp_flat_model_posterior_is_exp_minus_u():
    energy = SharpFlatEnergy()
    x = torch.tensor([[-2.1, 0.2], [1.0, 1.0], [3.0, -0.5]])
    for point in x:
        torch.testing.assert_close(log_joint(energy.model, "x", point), -energy.potential(point))
    # Pyro's own machinery sees the same potential and can initialise the model
    params, potential_fn, _, _ = initialize_model(energy.model)
    assert params["x"].shape == (2,)
    torch.testing.assert_close(potential_fn({"x": x[0]}), energy.potential(x[0]))
    assert AutoDelta(energy.model)()["x"].shape == (2,)


def test_sharp_flat_dtype_and_errors():
    energy = SharpFlatEnergy(dtype=torch.float32)
    assert energy.sharp_mode.dtype == energy.sample(3).dtype == energy.covariance.dtype == torch.float32
    with pytest.raises(ValueError, match=r"`sharp_weight` must be a number in \(0, 1\)"):
        SharpFlatEnergy(sharp_weight=1.0)
    with pytest.raises(ValueError, match="`sharp_scale` must be a finite number > 0"):
        SharpFlatEnergy(sharp_scale=0.0)
    with pytest.raises(ValueError, match="vectors of one length D"):
        SharpFlatEnergy(flat_mean=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match=r"x of shape \[\.\.\., 2\]"):
        SharpFlatEnergy().potential(torch.zeros(4, 3))


# ------------------------------------------------------------------------------------------------------------------
# BayesianLinearRegression


def sequential_posterior(x: np.ndarray, y: np.ndarray, alpha: float, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Recursive (Kalman / recursive-least-squares) conjugate updates, one observation at a time, no batch inverse."""
    dim = x.shape[1]
    mean, cov = np.zeros(dim), np.eye(dim) / alpha
    for xn, yn in zip(x, y, strict=True):
        gain = cov @ xn / (1 / beta + xn @ cov @ xn)
        mean = mean + gain * (yn - xn @ mean)
        cov = cov - np.outer(gain, xn @ cov)
    return mean, cov


def test_blr_exact_posterior_matches_sequential_updates():
    blr = BayesianLinearRegression.generate(60, 4, alpha=2.0, beta=10.0, seed=1)
    mean, cov = sequential_posterior(blr.x.numpy(), blr.y.numpy(), 2.0, 10.0)
    np.testing.assert_allclose(blr.posterior_mean.numpy(), mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(blr.posterior_covariance.numpy(), cov, rtol=1e-9, atol=1e-12)
    assert (blr.posterior_mean - blr.true_weights).abs().max() < 0.3


def test_blr_log_joint_is_the_posterior_quadratic():
    blr = BayesianLinearRegression.generate(50, 3, seed=0)
    mean, precision = blr.posterior_mean, torch.linalg.inv(blr.posterior_covariance)
    f = lambda w: log_joint(blr.model, "w", w)  # noqa: E731
    w = mean.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(w), w)
    assert grad.abs().max() < 1e-8
    torch.testing.assert_close(torch.autograd.functional.hessian(f, mean), -precision)
    # exactly quadratic: log p(w, D) = log p(mu, D) - (w - mu)^T Sigma^-1 (w - mu) / 2
    other = mean + torch.tensor([0.3, -1.0, 0.5])
    delta = other - mean
    torch.testing.assert_close(f(other), f(mean) - 0.5 * delta @ precision @ delta)


def test_blr_subsampled_plate_scales_the_minibatch():
    blr = BayesianLinearRegression.generate(50, 3, beta=4.0, seed=0)
    w = torch.tensor([0.5, -0.2, 1.0])
    trace = poutine.trace(poutine.condition(blr.model, data={"w": w})).get_trace(subsample_size=10)
    idx = trace.nodes["data"]["value"]
    assert idx.shape == (10,) and trace.nodes["obs"]["scale"] == 5.0
    expected = 5.0 * torch.distributions.Normal(blr.x[idx] @ w, 0.5).log_prob(blr.y[idx]).sum()
    trace.compute_log_prob()
    torch.testing.assert_close(trace.nodes["obs"]["log_prob_sum"], expected)


def test_blr_predictive_with_batched_weights():
    blr = BayesianLinearRegression.generate(20, 3, seed=0)
    x_new = torch.randn(7, 3)
    weights = torch.randn(5, 3)
    # [S, 1, D]: the shape of parallel posterior samples of "w" (one batch dim per plate, max_plate_nesting = 1)
    samples = {"w": weights[:, None, :]}
    predictive = Predictive(blr.model, posterior_samples=samples, parallel=True, return_sites=["obs"])
    obs = predictive(x_new)["obs"]
    assert obs.shape == (5, 7)
    assert ((obs - weights @ x_new.T).abs() < 5 * blr.beta**-0.5).all()


def test_blr_dtype_and_errors():
    blr = BayesianLinearRegression.generate(10, 2, dtype=torch.float32)
    assert blr.x.dtype == blr.posterior_mean.dtype == blr.posterior_covariance.dtype == torch.float32
    with pytest.raises(ValueError, match="`alpha` must be a finite number > 0"):
        BayesianLinearRegression(torch.randn(5, 2), torch.randn(5), alpha=0.0)
    with pytest.raises(ValueError, match=r"y of shape \[N\] = \[5\]"):
        BayesianLinearRegression(torch.randn(5, 2), torch.randn(4))


# ------------------------------------------------------------------------------------------------------------------
# GaussianTarget


@pytest.fixture
def gaussian() -> GaussianTarget:
    return GaussianTarget(
        torch.tensor([1.0, -2.0, 0.5]), torch.tensor([[2.0, 0.6, 0.0], [0.6, 1.0, -0.3], [0.0, -0.3, 0.5]])
    )


def test_gaussian_log_prob_and_model(gaussian):
    theta = torch.tensor([0.3, -1.0, 1.2])
    mean, cov = gaussian.mean.numpy(), gaussian.covariance.numpy()
    diff = theta.numpy() - mean
    expected = -0.5 * diff @ np.linalg.solve(cov, diff) - 0.5 * np.log(np.linalg.det(2 * np.pi * cov))
    assert abs(float(gaussian.log_prob(theta)) - expected) < 1e-12
    torch.testing.assert_close(log_joint(gaussian.model, "theta", theta), gaussian.log_prob(theta))
    torch.testing.assert_close(gaussian.precision, torch.linalg.inv(gaussian.covariance))
    params, potential_fn, _, _ = initialize_model(gaussian.model)
    assert params["theta"].shape == (3,)
    torch.testing.assert_close(potential_fn({"theta": theta}), -gaussian.log_prob(theta))


def test_gaussian_samples(gaussian):
    samples = gaussian.sample(100_000, generator=torch.Generator().manual_seed(0))
    assert_moments_match(samples, gaussian.mean, gaussian.covariance)


def test_gaussian_errors_and_dtype():
    target = GaussianTarget(torch.zeros(2, dtype=torch.float32), torch.eye(2))
    assert target.mean.dtype == target.covariance.dtype == torch.float32
    assert GaussianTarget([0.0, 0.0], [[1.0, 0.0], [0.0, 1.0]]).mean.dtype == torch.float64
    with pytest.raises(ValueError, match="positive definite"):
        GaussianTarget(torch.zeros(2), torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    with pytest.raises(ValueError, match="symmetric"):
        GaussianTarget(torch.zeros(2), torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"covariance of shape \[D, D\]"):
        GaussianTarget(torch.zeros(2), torch.eye(3))
    with pytest.raises(ValueError, match=r"theta of shape \[\.\.\., 2\]"):
        GaussianTarget(torch.zeros(2), torch.eye(2)).log_prob(torch.zeros(3))


def test_flat_prior_contributes_nothing_but_can_be_sampled():
    # unlike dist.ImproperUniform, the masked flat prior can be sampled, so the model runs unconditioned (init)
    for model, site in ((SharpFlatEnergy().model, "x"), (GaussianTarget(torch.zeros(4), torch.eye(4)).model, "theta")):
        trace = poutine.trace(model).get_trace()
        trace.compute_log_prob()
        assert trace.nodes[site]["value"].shape[-1] in (2, 4)
        assert float(trace.nodes[site]["log_prob_sum"]) == 0.0
