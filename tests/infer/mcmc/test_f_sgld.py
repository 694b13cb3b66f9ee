"""F-SGLD: the SGLD kernel on ``sharpness_aware(model, rho)`` (Flat Seeking BNNs, NeurIPS 2023)."""

import pyro
import pytest
import torch
from pyro.infer import MCMC, Predictive
from pyro.infer.autoguide.initialization import init_to_value

from pyro_flat.data import BayesianLinearRegression
from pyro_flat.infer.mcmc import SGLD
from pyro_flat.transforms import sharpness_aware


def _run(model, w0, step, *, temperature, num_samples, seed=0, **kwargs):
    pyro.set_rng_seed(seed)
    kernel = SGLD(model, step_size=step, temperature=temperature, init_strategy=init_to_value(values={"w": w0}))
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=0, disable_progbar=True)
    mcmc.run(**kwargs)
    return mcmc.get_samples()["w"]


def test_f_sgld_step_is_langevin_on_the_sharpness_aware_energy():
    # Full batch, T = 0: one step is w1 = w0 - eps * grad U_SA(w0) with
    # grad U_SA(w) = alpha w + beta X^T (X (w + e) - y),  e = rho g / |g|,  g = beta X^T (X w - y)   (closed form).
    blr = BayesianLinearRegression.generate(40, 3, beta=4.0)
    w0, rho, step = torch.tensor([0.3, -1.0, 2.0]), 0.2, 1e-3
    g = blr.beta * blr.x.T @ (blr.x @ w0 - blr.y)
    e = rho * g / g.norm()
    expected = w0 - step * (blr.alpha * w0 + blr.beta * blr.x.T @ (blr.x @ (w0 + e) - blr.y))
    w1 = _run(sharpness_aware(blr.model, rho), w0, step, temperature=0.0, num_samples=1)[0]
    torch.testing.assert_close(w1, expected, rtol=1e-12, atol=1e-12)
    plain = _run(blr.model, w0, step, temperature=0.0, num_samples=1)[0]
    assert (w1 - plain).abs().max() > 1e-4  # the perturbation changes the step: the test can fail


def test_f_sgld_with_rho_zero_is_sgld_under_the_same_seed():
    blr = BayesianLinearRegression.generate(64, 2)
    w0 = torch.zeros(2)
    flat = _run(sharpness_aware(blr.model, 0.0), w0, 1e-3, temperature=1.0, num_samples=20, subsample_size=16)
    plain = _run(blr.model, w0, 1e-3, temperature=1.0, num_samples=20, subsample_size=16)
    torch.testing.assert_close(flat, plain, rtol=1e-12, atol=1e-12)


def test_f_sgld_samples_feed_predictive_on_the_original_model():
    blr = BayesianLinearRegression.generate(64, 2)
    samples = _run(sharpness_aware(blr.model, 0.05), torch.zeros(2), 1e-3, temperature=1.0, num_samples=10,
                   subsample_size=16)
    assert samples.shape == (10, 2) and torch.isfinite(samples).all()
    out = Predictive(blr.model, posterior_samples={"w": samples})(blr.x[:5])
    assert out["obs"].shape == (10, 5)


@pytest.mark.parametrize("rho", [-0.1, float("nan"), float("inf")])
def test_f_sgld_rejects_a_bad_radius(rho):
    blr = BayesianLinearRegression.generate(8, 2)
    with pytest.raises(ValueError, match="rho"):
        SGLD(sharpness_aware(blr.model, rho), step_size=1e-3)
