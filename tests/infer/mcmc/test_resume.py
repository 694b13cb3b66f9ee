"""Driving a kernel from outside: external minibatches (set_model_args) and resuming a chain from its state_dict."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_flat.infer.mcmc import SGHMC, SGLD, CyclicalStepSize, EntropyMCMC, EntropySGD

from .models import normal_normal, quadratic_potential

DATA = torch.tensor([0.5, 1.5, 1.0, 2.0, -0.5, 3.0])
KERNELS = {
    "sgld": lambda: SGLD(normal_normal, step_size=0.01),
    "csgld": lambda: SGLD(normal_normal, step_size=CyclicalStepSize(0.05, 4)),
    "sghmc": lambda: SGHMC(normal_normal, step_size=0.01, friction=0.5),
    "emcmc": lambda: EntropyMCMC(normal_normal, eta=0.5, step_size=0.01),
    "esgd": lambda: EntropySGD(normal_normal, eta=0.5, step_size=0.01, num_inner_steps=3),
}


def _run(kernel, params, steps):
    for _ in range(steps):
        params = kernel.sample(params)
    return params


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_chain_resumed_from_its_state_continues_exactly(name):
    pyro.set_rng_seed(3)
    kernel = KERNELS[name]()
    kernel.setup(100, DATA, subsample_size=2)
    params = _run(kernel, kernel.initial_params, 5)
    saved, rng = kernel.state_dict(), torch.get_rng_state()
    reference = _run(kernel, params, 7)
    reference_state = kernel.state_dict()

    pyro.set_rng_seed(11)  # another process: a new kernel, set up again, then restored
    resumed = KERNELS[name]()
    resumed.setup(100, DATA, subsample_size=2)
    resumed.load_state_dict(saved)
    torch.set_rng_state(rng)
    out = _run(resumed, params, 7)
    assert all(torch.equal(out[k], reference[k]) for k in reference)
    assert resumed.num_gradient_steps == kernel.num_gradient_steps
    assert resumed.state_dict()["sampler"]["step"] == reference_state["sampler"]["step"]
    chain = resumed.state_dict()["chain"]  # per-chain state (momenta, inner chain), empty for SGLD/Entropy-MCMC
    assert set(chain) == set(reference_state["chain"]) and bool(chain) == (name in ("sghmc", "esgd"))
    for key, values in reference_state["chain"].items():
        assert all(torch.equal(chain[key][site], value) for site, value in values.items())


@pytest.mark.parametrize("jit_compile", [False, True])
def test_external_minibatches_replace_the_models_arguments(jit_compile):
    # compiled: the first step runs eagerly, the second is captured, the others evaluate the graph on the new batch
    batches = [DATA[:2], DATA[2:4], DATA[4:]] * 2
    pyro.set_rng_seed(0)
    kernel = SGLD(normal_normal, step_size=0.05, temperature=0.0, jit_compile=jit_compile,
                  jit_options={"backend": None})
    kernel.setup(10, DATA[:2])
    params = start = kernel.initial_params
    for batch in batches:
        kernel.set_model_args(batch)
        params = kernel.sample(params)
    # at temperature 0 an SGLD step is gradient descent on U(y) = y^2 / 2 + sum_batch (x - y)^2 / 2 (no scaling)
    y = start["y"]
    for batch in batches:
        y = y - 0.05 * (y + (y - batch).sum())
    torch.testing.assert_close(params["y"], y)


def test_set_model_args_needs_a_model_kernel():
    kernel = SGLD(potential_fn=quadratic_potential, step_size=0.1)
    kernel.initial_params = {"theta": torch.zeros(2)}
    kernel.setup(1)
    with pytest.raises(ValueError, match="needs a kernel built on a model"):
        kernel.set_model_args(DATA)


def test_entropy_mcmc_minibatches_reach_the_coupled_potential():
    def model(x, num_data=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            pyro.sample("x", dist.Normal(w, 1.0), obs=x)

    kernel = EntropyMCMC(model, eta=1.0, step_size=0.1, temperature=0.0)
    kernel.setup(5, DATA[:3], num_data=6)
    before = kernel.potential_fn({"w": torch.tensor(0.0), "w_anchor": torch.tensor(0.0)})
    kernel.set_model_args(DATA[3:], num_data=6)
    after = kernel.potential_fn({"w": torch.tensor(0.0), "w_anchor": torch.tensor(0.0)})
    expected = lambda x: -(dist.Normal(0.0, 1.0).log_prob(torch.tensor(0.0))  # noqa: E731
                           + 2 * dist.Normal(0.0, 1.0).log_prob(x).sum())
    torch.testing.assert_close(before, expected(DATA[:3]))
    torch.testing.assert_close(after, expected(DATA[3:]))
