import json

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, Predictive
from pyro.infer.mcmc.api import StreamingMCMC, _MultiSampler, _UnarySampler

from pyro_flat.infer.mcmc import (
    SGHMC,
    SGLD,
    CyclicalStepSize,
    DiskWriter,
    DrawHook,
    EntropyMCMC,
    EntropySGD,
    EntropySGLD,
    load_draws,
)
from pyro_flat.infer.mcmc.base import initialize_sg_model

from .models import normal_normal, quadratic_potential

DATA = torch.tensor([0.5, 1.5, 1.0, 2.0])
KERNELS = {
    "sgld": lambda model: SGLD(model, step_size=0.01),
    "sghmc": lambda model: SGHMC(model, step_size=0.01, friction=0.5),
    "emcmc": lambda model: EntropyMCMC(model, eta=0.5, step_size=0.01),
    "esgd": lambda model: EntropySGD(model, eta=0.5, step_size=0.01, num_inner_steps=3),
    "esgld": lambda model: EntropySGLD(model, eta=0.5, step_size=0.01, num_inner_steps=3),
}


@pytest.fixture
def sequential(monkeypatch):
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 1)


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("num_chains", [1, 2])
def test_shapes_diagnostics_and_predictive(name, num_chains, sequential):
    kernel = KERNELS[name](normal_normal)
    if num_chains > 1:
        with pytest.warns(UserWarning, match="sequentially"):
            mcmc = MCMC(kernel, num_samples=7, warmup_steps=3, num_chains=num_chains, disable_progbar=True)
    else:
        mcmc = MCMC(kernel, num_samples=7, warmup_steps=3, disable_progbar=True)
    mcmc.run(DATA, subsample_size=2)
    assert isinstance(mcmc.sampler, _UnarySampler)
    assert mcmc.get_samples()["y"].shape == (7 * num_chains,)
    assert mcmc.get_samples(group_by_chain=True)["y"].shape == (num_chains, 7)
    assert set(mcmc.get_samples()) == {"y"}
    diag = mcmc.diagnostics()
    assert diag["y"]["n_eff"].shape == () and diag["y"]["r_hat"].shape == ()
    # 10 transitions per chain; the nested kernels take 3 gradient steps per transition
    steps = 30 if name in ("esgd", "esgld") else 10
    assert diag["gradient_steps"] == {f"chain {i}": steps for i in range(num_chains)}
    pred = Predictive(normal_normal, posterior_samples=mcmc.get_samples(), return_sites=["x"])(DATA)
    assert pred["x"].shape == (7 * num_chains, 4)


def test_no_state_leaks_between_sequential_chains(sequential):
    initial = {"y": torch.tensor([-3.0, 3.0])}
    with pytest.warns(UserWarning, match="sequentially"):
        mcmc = MCMC(SGHMC(normal_normal, step_size=1e-4, temperature=0.0), num_samples=2, warmup_steps=0,
                    num_chains=2, initial_params=initial, disable_progbar=True)
    mcmc.run(DATA)
    y = mcmc.get_samples(group_by_chain=True)["y"]
    # at T = 0 and a tiny step each chain stays next to its own start, with momentum starting at 0 in each chain
    assert torch.allclose(y[0], torch.tensor(-3.0), atol=0.01) and torch.allclose(y[1], torch.tensor(3.0), atol=0.01)
    start = torch.tensor([-3.0, 3.0])
    grad_at_start = start * (1 + len(DATA)) - DATA.sum()  # U(y) = y^2 / 2 + sum_i (x_i - y)^2 / 2
    first_step = start - 1e-4 * grad_at_start
    assert torch.allclose(y[:, 0], first_step, atol=1e-9)


def test_multiprocess_path(monkeypatch):
    # force the one-process-per-chain sampler; workers seed with initial_seed + chain id
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 4)
    mcmc = MCMC(SGLD(normal_normal, step_size=0.01), num_samples=20, warmup_steps=5, num_chains=2,
                mp_context="spawn", disable_progbar=True)
    assert isinstance(mcmc.sampler, _MultiSampler)
    mcmc.run(DATA, subsample_size=2)
    y = mcmc.get_samples(group_by_chain=True)["y"]
    assert y.shape == (2, 20)
    assert not torch.equal(y[0], y[1])
    assert mcmc.diagnostics()["gradient_steps"] == {"chain 0": 25, "chain 1": 25}


def test_hand_driven_kernel_with_potential_fn():
    # without a model: set initial_params, setup, apply the kernel to its own output
    kernel = SGLD(potential_fn=quadratic_potential, step_size=0.05)
    kernel.initial_params = {"theta": torch.zeros(500)}
    kernel.setup(warmup_steps=0)
    params = kernel.initial_params
    draws = []
    for _ in range(400):
        params = kernel(params)
        draws.append(params["theta"])
    x = torch.stack(draws[100:])
    # ULA on N(0, 1) with eps = 0.05: variance 1 / (1 - 0.025); 500 independent coordinates x 300 draws
    assert abs(float(x.mean())) < 0.05
    assert float(x.var()) == pytest.approx(1 / (1 - 0.025), rel=0.05)
    assert kernel.diagnostics() == {"gradient_steps": 400}


def test_potential_fn_needs_initial_params():
    kernel = SGLD(potential_fn=quadratic_potential, step_size=0.1)
    with pytest.raises(ValueError, match="needs initial parameters"):
        kernel.setup(0)


def test_thinning_and_warmup_count_gradient_steps():
    kernel = SGLD(normal_normal, step_size=0.01, thinning=5)
    mcmc = MCMC(kernel, num_samples=4, warmup_steps=3, disable_progbar=True)
    mcmc.run(DATA)
    assert mcmc.diagnostics()["gradient_steps"] == {"chain 0": 3 + 4 * 5}


def test_cyclical_schedule_collects_at_the_end_of_each_cycle():
    positions = []
    schedule = CyclicalStepSize(0.05, cycle_length=6, exploration_fraction=0.5, samples_per_cycle=1)
    kernel = SGLD(normal_normal, step_size=schedule)
    hook = DrawHook(lambda draw: positions.append(kernel.num_gradient_steps))
    mcmc = MCMC(kernel, num_samples=3, warmup_steps=0, hook_fn=hook, disable_progbar=True)
    mcmc.run(DATA)
    # the draws are the positions after steps 5, 11, 17 (counted from 0), i.e. after 6, 12, 18 gradient steps
    assert positions == [6, 12, 18]


def test_logging_is_json_for_the_progress_bar():
    kernel = SGLD(normal_normal, step_size=0.01, divergence_check_every=2)
    kernel.setup(0, DATA)
    params = kernel.initial_params
    for _ in range(4):
        params = kernel.sample(params)
    fields = json.loads(json.dumps(kernel.logging()))
    assert fields["step size"] == "1.00e-02"
    assert float(fields["potential"]) > 0


def test_divergence_names_the_step_and_the_site():
    def model():
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        pyro.factor("stiff", -1e300 * b**2 + 0 * a)

    # T = 0, b = 1: step 0 jumps to b = 1 - 0.1 * 2e300 = -2e299 (finite); step 1 has an infinite potential and
    # gradient, so b becomes infinite there. The record is read at the end (diagnostics), yet names step 1.
    kernel = SGLD(model, step_size=0.1, temperature=0.0, init_strategy=lambda site: torch.tensor(1.0),
                  divergence_check_every=1000)
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=0, disable_progbar=True)
    message = r"diverged at gradient step 1 \(.*\): site 'b' and the potential"
    with pytest.raises(FloatingPointError, match=message) as err:
        mcmc.run()
    assert "'a'" not in str(err.value)


def test_divergence_of_the_potential_is_reported():
    def potential(params):
        return torch.log(params["theta"]).sum()  # NaN once theta < 0

    kernel = SGLD(potential_fn=potential, step_size=1.0, temperature=0.0, divergence_check_every=1)
    kernel.initial_params = {"theta": torch.tensor([0.5])}
    kernel.setup(0)
    # step 0: theta = 0.5 - 1 / 0.5 = -1.5; step 1: log(-1.5) is NaN while the gradient 1 / theta is finite
    with pytest.raises(FloatingPointError, match=r"gradient step 1 .*: the potential energy became NaN"):
        params = kernel.initial_params
        for _ in range(5):
            params = kernel.sample(params)


@pytest.mark.parametrize("validation", [False, True])
def test_nan_in_the_data_is_blamed_on_the_data_not_the_step_size(validation):
    # issue 11: with NaN in the data the message advised lowering the step size
    y = torch.randn(10)
    y[3] = float("nan")

    def model(y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=5) as idx:
            pyro.sample("obs", dist.Normal(w, 1.0), obs=y[idx])

    pyro.enable_validation(validation)
    mcmc = MCMC(SGLD(model, step_size=1e-3, divergence_check_every=1), num_samples=50, disable_progbar=True)
    with pytest.raises(FloatingPointError, match=r"data hold NaN or infinite values \(argument 'y': 1 of 10") as err:
        mcmc.run(y)
    assert "lower the step size" not in str(err.value)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: SGLD(normal_normal, step_size=0.0), "step_size"),
        (lambda: SGLD(normal_normal, step_size=-1e-3), "step_size"),
        (lambda: SGLD(normal_normal, step_size=1e-3, temperature=-1.0), "temperature"),
        (lambda: SGLD(normal_normal, step_size=1e-3, thinning=0), "thinning"),
        (lambda: SGLD(step_size=1e-3), "exactly one of model and potential_fn"),
        (lambda: SGLD(normal_normal, quadratic_potential, step_size=1e-3), "exactly one"),
        (lambda: SGHMC(normal_normal, step_size=1e-3, friction=0.0), "friction"),
        (lambda: SGHMC(normal_normal, step_size=1e-3, friction=1.5), "friction"),
        (lambda: EntropyMCMC(normal_normal, eta=0.0, step_size=1e-3), "eta"),
        (lambda: EntropyMCMC(normal_normal, eta=-1.0, step_size=1e-3), "eta"),
        (lambda: EntropyMCMC(normal_normal, eta=1.0, step_size=0.0), "step_size"),
        (lambda: EntropyMCMC(normal_normal, eta=1.0, step_size=1e-3, collect="all"), "collect"),
        (lambda: EntropySGD(normal_normal, eta=0.0, step_size=1e-3), "eta"),
        (lambda: EntropySGD(normal_normal, eta=1.0, step_size=-1.0), "step_size"),
        (lambda: EntropySGD(normal_normal, eta=1.0, step_size=1e-3, num_inner_steps=0), "num_inner_steps"),
        (lambda: EntropySGD(normal_normal, eta=1.0, step_size=1e-3, mean_weight=0.0), "mean_weight"),
        (lambda: EntropySGLD(normal_normal, eta=1.0, step_size=1e-3, outer_step_size=0.0), "outer_step_size"),
        (lambda: EntropySGLD(normal_normal, eta=1.0, step_size=1e-3, inner_start="x"), "inner_start"),
    ],
)
def test_bad_hyperparameters(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("kernel_class", [SGLD, EntropyMCMC])
def test_discrete_latents_are_rejected(kernel_class):
    def model():
        pyro.sample("k", dist.Categorical(torch.ones(3)))
        pyro.sample("x", dist.Normal(0.0, 1.0))

    extra = {"eta": 1.0} if kernel_class is EntropyMCMC else {}
    kernel = kernel_class(model, step_size=0.1, **extra)
    with pytest.raises(ValueError, match="'k' is (a )?discrete"):
        MCMC(kernel, num_samples=2, disable_progbar=True).run()


def test_initialize_accepts_subsampled_plates_that_pyro_rejects():
    from pyro.infer.mcmc.util import initialize_model

    with pytest.raises(NotImplementedError, match="subsample"):
        initialize_model(normal_normal, model_args=(DATA, 2))
    params, potential, transforms = initialize_sg_model(normal_normal, (DATA, 2))
    assert set(params) == set(transforms) == {"y"}
    assert potential(params).shape == ()


def test_initial_params_must_match_the_latent_sites():
    kernel = SGLD(normal_normal, step_size=0.01)
    kernel.initial_params = {"z": torch.tensor(0.0)}
    with pytest.raises(ValueError, match=r"missing \['y'\], unexpected \['z'\]"):
        kernel.setup(0, DATA)


def test_save_params_are_sorted_for_mcmc():
    def model():
        pyro.sample("b", dist.Normal(0.0, 1.0))
        pyro.sample("a", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    init = {"b": torch.tensor(5.0), "a": torch.tensor([-5.0, -6.0])}
    mcmc = MCMC(SGLD(model, step_size=1e-6, temperature=0.0), num_samples=2, warmup_steps=0,
                initial_params=init, save_params=["b", "a"], disable_progbar=True)
    mcmc.run()
    samples = mcmc.get_samples()
    assert torch.allclose(samples["b"], torch.tensor(5.0), atol=1e-3)
    assert torch.allclose(samples["a"], torch.tensor([-5.0, -6.0]), atol=1e-3)


def test_streaming_draws_to_a_callback_and_to_disk(tmp_path):
    def model():
        pyro.sample("scale", dist.LogNormal(0.0, 0.5))

    received = []
    hook = DrawHook(received.append)
    StreamingMCMC(SGLD(model, step_size=0.01), num_samples=5, warmup_steps=3, hook_fn=hook,
                  disable_progbar=True).run()
    assert len(received) == hook.num_draws == 5
    assert all(d["scale"] > 0 for d in received)  # constrained space
    writer = DiskWriter(tmp_path / "draws")
    MCMC(SGLD(model, step_size=0.01), num_samples=4, warmup_steps=0, hook_fn=DrawHook(writer),
         disable_progbar=True).run()
    loaded = list(load_draws(tmp_path / "draws"))
    assert len(loaded) == writer.count == 4 and all(d["scale"] > 0 for d in loaded)
    with pytest.raises(ValueError, match="already holds"):
        DiskWriter(tmp_path / "draws")
    with pytest.raises(ValueError, match="no draw"):
        list(load_draws(tmp_path))
