"""AutoLowRankPlusDiagonalNormal: its Gaussian, its draws, SWAG initialisation, use with SVI and Predictive."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_flat.infer import AutoLowRankPlusDiagonalNormal, SWAGCollector, latent_supports
from pyro_flat.infer.autoguide.low_rank import ScaledLowRankMultivariateNormal


def model(x=None):
    a = pyro.sample("a", dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))
    b = pyro.sample("b", dist.LogNormal(0.0, 1.0))  # constrained: the guide works in log space
    if x is not None:
        pyro.sample("x", dist.Normal(a.sum((-1, -2)) * b, 1.0), obs=x)
    return a, b


def _params(guide):
    p = guide._pyro_name
    return pyro.param(f"{p}.loc"), pyro.param(f"{p}.scale"), pyro.param(f"{p}.cov_factor")


def _covariance(scale, factor):
    return torch.diag(scale) @ (torch.eye(len(scale)) + factor @ factor.T) @ torch.diag(scale)


def test_posterior_is_diagonal_plus_low_rank_and_marginal_scales():
    guide = AutoLowRankPlusDiagonalNormal(model, rank=3, init_scale=0.2)
    guide()
    loc, scale, factor = _params(guide)
    assert loc.shape == (5,) and scale.shape == (5,) and factor.shape == (5, 3)
    cov = _covariance(scale, factor)
    posterior = guide.get_posterior()
    assert torch.allclose(posterior.covariance_matrix, cov)
    theta = torch.randn(5)
    assert torch.allclose(posterior.log_prob(theta), dist.MultivariateNormal(loc, cov).log_prob(theta))
    _, marginal = guide._loc_scale()
    assert torch.allclose(marginal, cov.diagonal().sqrt())
    assert torch.allclose(scale, torch.full((5,), 0.2 / math.sqrt(2)))


@pytest.mark.statistical
def test_draws_have_the_guide_covariance():
    # 20 000 vectorised draws (independent, ESS = n), seed 0; z-test of every mean and covariance entry, k = 4.5
    guide = AutoLowRankPlusDiagonalNormal(model, rank=2, init_scale=0.5)
    guide()
    n = 20_000
    with pyro.plate("particles", n, dim=-1):
        latent = guide.sample_latent()
    loc, scale, factor = _params(guide)
    cov = _covariance(scale, factor).detach()
    centred = latent.detach() - loc.detach()
    z_mean = centred.mean(0).abs() / (cov.diagonal().sqrt() / math.sqrt(n))
    products = centred.unsqueeze(2) * centred.unsqueeze(1)
    z_cov = (products.mean(0) - cov).abs() / (products.std(0) / math.sqrt(n))
    assert z_mean.max() < 4.5 and z_cov.max() < 4.5
    draw = guide()
    assert draw["a"].shape == (2, 2) and draw["b"] > 0


def test_from_moments_matches_swag_sampling_covariance():
    mean, variance, deviations = torch.arange(5.0) / 10, torch.linspace(0.1, 0.5, 5), torch.randn(5, 4)
    guide = AutoLowRankPlusDiagonalNormal.from_moments(model, mean, variance, deviations, scale=0.5)
    guide()
    loc, scale, factor = _params(guide)
    assert guide.rank == 4
    assert torch.allclose(loc, mean)
    swag = 0.5 * (torch.diag(variance) + deviations @ deviations.T / 3)
    assert torch.allclose(_covariance(scale, factor), swag)


def test_from_swag_matches_sites_by_name_and_reads_constrained_sites_in_unconstrained_space():
    # the collector is filled in another order than the model's and in the model's (constrained) space with the
    # supports: the guide's mean is the collected mean in unconstrained space, in AutoContinuous order
    torch.manual_seed(0)
    iterates = [{"b": torch.rand(()) + 0.5, "a": torch.randn(2, 2)} for _ in range(6)]
    collector = SWAGCollector(max_rank=3, supports=latent_supports(model))
    for it in iterates:
        collector.collect(it)
    guide = AutoLowRankPlusDiagonalNormal.from_swag(model, collector, scale=1.0)
    guide()
    loc, _, _ = _params(guide)
    expected = torch.cat([torch.stack([it["a"] for it in iterates]).mean(0).reshape(-1),
                          torch.stack([it["b"].log() for it in iterates]).mean(0).reshape(1)])
    torch.testing.assert_close(loc, expected)
    torch.testing.assert_close(guide.median()["b"], expected[-1].exp())
    with pytest.raises(ValueError, match="must be a SWAGCollector"):
        AutoLowRankPlusDiagonalNormal.from_swag(model, object())


def test_from_swag_refuses_a_constrained_site_of_unknown_space():
    collector = SWAGCollector(max_rank=3)  # no supports: model-space values of "b" cannot be mapped
    for _ in range(4):
        collector.collect({"a": torch.randn(2, 2), "b": torch.rand(()) + 0.5})
    with pytest.raises(ValueError, match="site 'b' has support .* without that support"):
        AutoLowRankPlusDiagonalNormal.from_swag(model, collector)()


def test_moments_of_the_wrong_size_are_a_value_error():
    guide = AutoLowRankPlusDiagonalNormal.from_moments(model, torch.zeros(4), torch.ones(4), torch.ones(4, 2))
    with pytest.raises(ValueError, match="4 values but the model's latent sites total 5"):
        guide()


@pytest.mark.parametrize("kwargs, match", [({"rank": 0}, "rank"), ({"rank": True}, "rank"),
                                           ({"init_scale": -1.0}, "init_scale"), ({"init_scale": 1}, "init_scale")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoLowRankPlusDiagonalNormal(model, **kwargs)


def test_trains_with_trace_elbo_and_predicts():
    x = torch.tensor(3.0)
    guide = AutoLowRankPlusDiagonalNormal(model, rank=2)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    losses = [svi.step(x) for _ in range(100)]
    assert sum(losses[-10:]) < sum(losses[:10])
    samples = Predictive(model, guide=guide, num_samples=7)()
    assert samples["a"].shape == (7, 2, 2) and (samples["b"] > 0).all()
    quantiles = guide.quantiles([0.25, 0.75])
    assert (quantiles["b"][1] > quantiles["b"][0]).all()


def test_from_swag_with_a_float64_swag_collector_keeps_the_model_dtype_and_trains_with_kl_ball_elbo():
    from pyro_flat.infer import KLBallELBO
    from pyro_flat.infer.autoguide import SWAGCollector

    def real_model(x):  # float32 latents, both real-valued (SWAG's flat values are the unconstrained ones)
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        c = pyro.sample("c", dist.Normal(torch.tensor(0.0), 1.0))
        pyro.sample("x", dist.Normal(w.sum() + c, 1.0).expand([len(x)]).to_event(1), obs=x)

    generator = torch.Generator().manual_seed(0)
    iterates = [
        {"w": torch.randn(3, generator=generator), "c": torch.randn((), generator=generator)}
        for _ in range(6)
    ]
    iterates = [{k: v.float() for k, v in it.items()} for it in iterates]
    swag = SWAGCollector(max_rank=3, dtype=torch.float64)
    for it in iterates:
        swag.collect(it)
    guide = AutoLowRankPlusDiagonalNormal.from_swag(real_model, swag, scale=0.5)
    x = torch.ones(4, dtype=torch.float32)
    guide(x)
    loc, scale, factor = _params(guide)
    assert loc.dtype == scale.dtype == factor.dtype == torch.float32
    flat = torch.stack([torch.cat([it["w"], it["c"].reshape(1)]) for it in iterates]).double()  # trace order
    torch.testing.assert_close(loc, flat.mean(0).float())
    dev = swag.deviation_matrix()  # K = 3 columns: SWAG covariance c (diag + D D^T / (K - 1))
    expected = 0.5 * (torch.diag(swag.flat_variance()) + dev @ dev.T / 2)
    torch.testing.assert_close(_covariance(scale.double(), factor.double()), expected, rtol=1e-5, atol=1e-6)
    svi = SVI(real_model, guide, pyro.optim.Adam({"lr": 1e-2}), KLBallELBO(0.1))
    assert math.isfinite(svi.step(x))
    assert pyro.param(f"{guide._pyro_name}.loc").dtype == torch.float32


def _pyro_twin(guide):
    """Pyro's AutoLowRankMultivariateNormal with the same parameters as ``guide`` (already set up)."""
    from pyro.infer.autoguide import AutoLowRankMultivariateNormal

    twin = AutoLowRankMultivariateNormal(model, rank=guide.cov_factor.shape[-1])
    twin(torch.tensor(1.0))
    loc, scale, factor = _params(guide)
    twin.loc = torch.nn.Parameter(loc.detach().clone())
    twin.scale = pyro.nn.PyroParam(scale.detach().clone(), twin.scale_constraint)
    twin.cov_factor = torch.nn.Parameter(factor.detach().clone())
    return twin


@pytest.mark.parametrize("elbo", [Trace_ELBO(num_particles=3), Trace_ELBO(num_particles=3, vectorize_particles=True)])
def test_same_draws_loss_and_gradients_as_pyros_guide(elbo):
    # the lean posterior is Pyro's LowRankMultivariateNormal computed without P x K temporaries: same seed, same
    # draws, same ELBO and gradients (float64: agreement to rounding)
    x = torch.tensor(2.0)
    guide = AutoLowRankPlusDiagonalNormal(model, rank=3, init_scale=0.3)
    guide(x)
    with torch.no_grad():
        guide.cov_factor.normal_()  # a non-trivial factor
    twin = _pyro_twin(guide)
    results = []
    for g in (guide, twin):
        elbo.differentiable_loss(model, g, x)  # vectorised particles: the first call guesses the plates (draws)
        pyro.set_rng_seed(5)
        loss = elbo.differentiable_loss(model, g, x)
        params = (g.loc, g.scale_unconstrained, g.cov_factor)
        results.append((loss, torch.autograd.grad(loss, params)))
        pyro.set_rng_seed(6)
        results[-1] += (g.get_posterior().sample((4,)),)
    (loss, grads, draws), (expected_loss, expected_grads, expected_draws) = results
    assert isinstance(guide.get_posterior(), ScaledLowRankMultivariateNormal)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(draws, expected_draws, rtol=1e-12, atol=1e-12)


def test_kl_ball_elbo_is_unchanged_by_the_lean_posterior():
    from pyro_flat.infer import KLBallELBO

    x = torch.tensor(2.0)
    guide = AutoLowRankPlusDiagonalNormal(model, rank=2, init_scale=0.3)
    guide(x)
    with torch.no_grad():
        guide.cov_factor.normal_()
    twin = _pyro_twin(guide)
    results = []
    for g in (guide, twin):
        pyro.set_rng_seed(3)
        loss = KLBallELBO(0.05).differentiable_loss(model, g, x)
        results.append((loss, torch.autograd.grad(loss, (g.loc, g.scale_unconstrained, g.cov_factor))))
    (loss, grads), (expected_loss, expected_grads) = results
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_scaled_posterior_is_pyros_distribution_at_the_absolute_factor():
    loc, scale, factor = torch.randn(2, 5), torch.rand(2, 5) + 0.2, torch.randn(5, 3)
    ours = ScaledLowRankMultivariateNormal(loc, scale, factor)
    theirs = dist.LowRankMultivariateNormal(loc, factor * scale.unsqueeze(-1), scale.square())
    assert ours.batch_shape == theirs.batch_shape == (2,) and ours.event_shape == (5,)
    value = torch.randn(4, 2, 5)
    torch.testing.assert_close(ours.log_prob(value), theirs.log_prob(value))
    torch.testing.assert_close(ours.entropy(), theirs.entropy())
    torch.testing.assert_close(ours.variance, theirs.variance)
    torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix)
    expanded = ours.expand((3, 2))
    assert expanded.batch_shape == (3, 2) and expanded.log_prob(value[0]).shape == (3, 2)
    assert expanded.rsample((4,)).shape == (4, 3, 2, 5)
    with pytest.raises(ValueError, match="factor \\[..., P, K\\]"):
        ScaledLowRankMultivariateNormal(loc, scale, factor[:4])
