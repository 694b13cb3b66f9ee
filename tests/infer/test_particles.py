"""Batched particles: K vmapped chains / ensemble members equal K separate runs; the chains sample the right law."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from pyro.infer.autoguide.initialization import init_to_value

from pyro_flat.data import BayesianLinearRegression, load_digits
from pyro_flat.infer.mcmc import SGLD, NotMixedWarning
from pyro_flat.infer.particles import BatchedMAP, BatchedPotential, BatchedSGLD, init_particles
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.optim import SAM

K = 3


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    return data.x_train[:40].double(), data.y_train[:40], data.num_data


def _members(x, y, num_data):
    torch.manual_seed(0)
    models = [BayesianMLP(64, 10, hidden=(16,)) for _ in range(K)]  # K different torch initialisations
    particles, transforms = init_particles(models, x, y, init_strategy=[init_to_network(m) for m in models],
                                           num_data=num_data)
    return models, particles, transforms


def test_batched_potential_equals_each_particle_alone(digits):
    x, y, n = digits
    models, particles, transforms = _members(x, y, n)
    potential = BatchedPotential(models[0], transforms)
    values, grads = potential.value_and_grad(particles, x, y, num_data=n)
    assert values.shape == (K,)
    for k in range(K):
        single = {name: v[k].clone().requires_grad_() for name, v in particles.items()}
        trace = pyro.poutine.trace(pyro.poutine.condition(models[0], single)).get_trace(x, y, num_data=n)
        u = -trace.log_prob_sum()
        torch.testing.assert_close(values[k], u, rtol=1e-12, atol=1e-10)
        for name, g in zip(single, torch.autograd.grad(u, list(single.values())), strict=True):
            torch.testing.assert_close(grads[name][k], g, rtol=1e-10, atol=1e-12)


def test_batched_sgld_at_zero_temperature_equals_k_sgld_kernels(digits):
    # T = 0 makes both deterministic: K vmapped steps must equal K runs of pyro_flat's SGLD kernel from the same starts
    x, y, n = digits
    models, particles, transforms = _members(x, y, n)
    batched = BatchedSGLD(models[0], particles, step_size=1e-4, temperature=0.0, transforms=transforms)
    for _ in range(4):
        batched.step(x, y, num_data=n)
    for k in range(K):
        kernel = SGLD(models[0], step_size=1e-4, temperature=0.0,
                      init_strategy=init_to_value(values={name: v[k] for name, v in particles.items()}))
        kernel.setup(0, x, y, num_data=n)
        params = kernel.initial_params
        for _ in range(4):
            params = kernel.sample(params)
        for name, value in params.items():
            torch.testing.assert_close(batched.particles[name][k], value, rtol=1e-10, atol=1e-12)


@pytest.mark.statistical
def test_batched_sgld_chains_sample_the_bayesian_linear_regression_posterior():
    # 400 independent chains (full batch, step 1e-3, T = 1), 300 burn-in steps (the slowest mode relaxes in
    # 1 / (eps * lambda_min) ~ 60 steps), then one draw per chain: 400 independent draws. The discretisation bias of
    # this step is below 1 % of the posterior sd; z < 4 per mean / covariance entry (MCSE of 400 independent draws).
    blr = BayesianLinearRegression.generate(50, 2, beta=4.0)
    chains = 400
    particles = {"w": torch.zeros(chains, 2)}
    sampler = BatchedSGLD(blr.model, particles, step_size=1e-3)
    draws = sampler.run(1, lambda: ((blr.x, blr.y), {}), warmup_steps=300)["w"][:, 0]
    mean, cov = blr.posterior_mean, blr.posterior_covariance
    se_mean = (cov.diagonal() / chains).sqrt()
    assert ((draws.mean(0) - mean).abs() / se_mean).max() < 4
    centred = draws - mean
    products = torch.einsum("ni,nj->nij", centred, centred)
    se_cov = products.std(0) / chains**0.5
    assert ((products.mean(0) - cov).abs() / se_cov).max() < 4


def test_batched_sgld_draws_feed_predictive():
    blr = BayesianLinearRegression.generate(30, 2)
    sampler = BatchedSGLD(blr.model, {"w": torch.randn(4, 2)}, step_size=1e-3)
    with pytest.warns(NotMixedWarning, match="'w'"):  # 4 chains started apart, after 12 steps: not mixed
        draws = sampler.run(5, lambda: ((blr.x, blr.y), {}), warmup_steps=2, thinning=2)
    assert draws["w"].shape == (4, 5, 2)
    out = Predictive(blr.model, posterior_samples={"w": draws["w"].reshape(20, 2)})(blr.x[:3])
    assert out["obs"].shape == (20, 3)


@pytest.mark.parametrize("rho", [0.0, 0.05])
def test_batched_map_equals_k_separate_map_fits(digits, rho):
    # rho = 0: K AutoDelta + Trace_ELBO + pyro Adam runs; rho > 0: K runs of pyro_flat.optim.SAM(Adam) with the MAP
    # loss as closure (the per-member SAM step). Same starts, same minibatch, 3 steps.
    x, y, n = digits
    models, particles, transforms = _members(x, y, n)
    batched = BatchedMAP(models[0], particles, lr=1e-2, rho=rho, transforms=transforms)
    for _ in range(3):
        batched.step(x, y, num_data=n)
    members = batched.members()
    for k in range(K):
        point = _map_fit(models[0], {name: v[k].clone() for name, v in particles.items()}, (x, y, n), rho)
        for name, value in point.items():
            torch.testing.assert_close(members[k][name], value, rtol=1e-9, atol=1e-11)


def _map_fit(model, start, data, rho, steps=3):
    """One member alone: AutoDelta + Trace_ELBO + pyro Adam (rho = 0) or optim.SAM(Adam) on the MAP loss."""
    x, y, n = data
    pyro.clear_param_store()
    guide = AutoDelta(model, init_loc_fn=init_to_value(values=start))
    if rho == 0:
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
        for _ in range(steps):
            svi.step(x, y, num_data=n)
    else:
        guide(x, y, num_data=n)
        optimizer = SAM(guide.parameters(), torch.optim.Adam, rho=rho, lr=1e-2)
        elbo = Trace_ELBO()
        for _ in range(steps):
            optimizer.step(lambda: elbo.differentiable_loss(model, guide, x, y, num_data=n).backward())
    return {name: value.detach() for name, value in guide.median().items()}


def test_a_model_that_subsamples_inside_is_a_clear_error(digits):
    x, y, n = digits
    models, particles, transforms = _members(x, y, n)
    with pytest.raises(ValueError, match="num_data=N instead of pyro.plate"):
        BatchedPotential(models[0], transforms)(particles, x, y, subsample_size=8)


def test_bad_arguments():
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="leading particle dimension"):
        BatchedSGLD(model, {"a": torch.zeros(3), "b": torch.zeros(2, 1)}, step_size=0.1)
    with pytest.raises(ValueError, match="step_size"):
        BatchedSGLD(model, {"a": torch.zeros(3)}, step_size=0.0)
    with pytest.raises(ValueError, match="temperature"):
        BatchedSGLD(model, {"a": torch.zeros(3)}, step_size=0.1, temperature=-1.0)
    with pytest.raises(ValueError, match="rho"):
        BatchedMAP(model, {"a": torch.zeros(3)}, rho=-0.1)
    with pytest.raises(ValueError, match="num_samples"):
        BatchedSGLD(model, {"a": torch.zeros(3)}, step_size=0.1).run(0, lambda: ((), {}))


def test_the_batched_particles_benchmark_runs(tmp_path, monkeypatch):
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # for its shared modules `_report`, `_timing`
    path = benchmarks / "batched_particles.py"
    spec = importlib.util.spec_from_file_location("batched_particles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dtype = torch.get_default_dtype()
    try:
        text = module.main(["--particles", "2", "--repeats", "1", "--steps", "1", "--out", str(tmp_path / "b.md")])
    finally:
        torch.set_default_dtype(dtype)
    assert text.count("| MLP") == 2 and "nan" not in text


def _steppers(device):
    blr = BayesianLinearRegression.generate(30, 2, device=device)
    start = {"w": torch.zeros(4, 2, device=device)}
    sgld = BatchedSGLD(blr.model, start, step_size=1e-3)
    members = BatchedMAP(blr.model, start, lr=1e-2, rho=0.05)
    return lambda: sgld.step(blr.x, blr.y), lambda: members.step(blr.x, blr.y)


def test_batched_steps_make_no_host_sync_beyond_adams_step_counter():
    from pyro_flat.testing import HostSyncCounter

    sgld_step, map_step = _steppers("cpu")
    map_step()  # the first call builds Adam's state
    with HostSyncCounter() as syncs:
        for _ in range(3):
            sgld_step()
    assert syncs.count == 0, syncs.report()
    with HostSyncCounter() as syncs:
        for _ in range(3):
            map_step()
    # the baseline: torch's Adam alone reads its CPU-resident step counter (free on a GPU, see tests/test_devices.py)
    leaf = torch.zeros(4, 2, requires_grad=True)
    adam = torch.optim.Adam([leaf])
    leaf.grad = torch.ones_like(leaf)
    adam.step()
    with HostSyncCounter() as baseline:
        for _ in range(3):
            adam.step()
    assert syncs.count == baseline.count, syncs.report()


@pytest.mark.cuda
def test_batched_steps_on_cuda_without_sync(no_host_sync):
    sgld_step, map_step = _steppers("cuda")
    sgld_step(), map_step()  # the set-up (Adam's state) may synchronise
    with no_host_sync("cuda"):
        sgld_step()
        map_step()
