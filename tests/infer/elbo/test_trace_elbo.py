"""TensorTrace_ELBO / TensorTraceMeanField_ELBO: Pyro's ELBOs with the loss summed on the device — the same loss and
gradients as Pyro's (same seed, float64: equal to rounding) on reparameterised, score-function, subsampled, analytic-KL
and vectorised-particle cases, the three entry points agreeing, and no host read in ``differentiable_loss``."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.distributions.testing.fakes import NonreparameterizedNormal
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_flat.infer import TensorTrace_ELBO, TensorTraceMeanField_ELBO
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.testing import HostSyncCounter

from ...conformance.catalogue import local_model
from .test_sharpness_aware import loss_and_param_grads

X = torch.tensor([-0.5, 2.0, 0.3, 1.1, 0.7, -1.4], dtype=torch.float64)


def local_guide(x, subsample_size=None, reparameterised=True):
    m = pyro.param("m", torch.tensor(0.3))
    s = pyro.param("s", torch.tensor(0.7), constraint=dist.constraints.positive)
    loc = pyro.param("loc", torch.linspace(-1, 1, len(x)))
    scale = pyro.param("scale", torch.full((len(x),), 0.8), constraint=dist.constraints.positive)
    pyro.sample("mu", dist.Normal(m, s))
    normal = dist.Normal if reparameterised else NonreparameterizedNormal
    with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
        pyro.sample("z", normal(loc[idx], scale[idx]))


def score_guide(x, subsample_size=None):
    local_guide(x, subsample_size, reparameterised=False)


def mlp():
    torch.manual_seed(1)
    model = BayesianMLP(5, 3, hidden=(8,))
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    return model, (x, y), {"subsample_size": 8}


def loss_and_grads(elbo, model, guide, args, kwargs, seed=3):
    pyro.set_rng_seed(seed)
    return loss_and_param_grads(elbo, model, guide, *args, **kwargs)


CASES = {
    # name: (model, guide factory, args, kwargs, Pyro's ELBO, ours, ELBO options)
    "reparameterised, subsampled": (local_model, lambda m: local_guide, (X,), {"subsample_size": 4},
                                    Trace_ELBO, TensorTrace_ELBO, {}),
    "score function, subsampled": (local_model, lambda m: score_guide, (X,), {"subsample_size": 4},
                                   Trace_ELBO, TensorTrace_ELBO, {}),
    "two particles": (local_model, lambda m: score_guide, (X,), {}, Trace_ELBO, TensorTrace_ELBO,
                      {"num_particles": 2}),
    "vectorised particles": (local_model, lambda m: local_guide, (X,), {}, Trace_ELBO, TensorTrace_ELBO,
                             {"num_particles": 3, "vectorize_particles": True, "max_plate_nesting": 1}),
    "mean field, analytic KL": (local_model, lambda m: local_guide, (X,), {"subsample_size": 4},
                                TraceMeanField_ELBO, TensorTraceMeanField_ELBO, {}),
    "mean field, AutoNormal": ("mlp", AutoNormal, None, None, TraceMeanField_ELBO, TensorTraceMeanField_ELBO, {}),
    "AutoNormal MLP": ("mlp", AutoNormal, None, None, Trace_ELBO, TensorTrace_ELBO, {}),
    "AutoDelta MLP": ("mlp", AutoDelta, None, None, Trace_ELBO, TensorTrace_ELBO, {}),
}


def _setup(case):
    model, make_guide, args, kwargs, pyro_elbo, ours, options = CASES[case]
    if model == "mlp":
        model, args, kwargs = mlp()
        guide = make_guide(model, init_loc_fn=init_to_network(model))
    else:
        guide = make_guide(model)
    pyro.set_rng_seed(0)
    guide(*args, **kwargs)  # set up the guide's parameters once
    return model, guide, args, kwargs, pyro_elbo(**options), ours(**options)


@pytest.mark.parametrize("case", list(CASES))
def test_same_loss_and_gradients_as_pyros_elbo(case):
    model, guide, args, kwargs, theirs, ours = _setup(case)
    expected_loss, expected = loss_and_grads(theirs, model, guide, args, kwargs)
    loss, grads = loss_and_grads(ours, model, guide, args, kwargs)
    assert isinstance(loss, float)
    assert loss == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_entry_points_agree(case):
    model, guide, args, kwargs, theirs, ours = _setup(case)
    pyro.set_rng_seed(5)
    expected = theirs.differentiable_loss(model, guide, *args, **kwargs)
    pyro.set_rng_seed(5)
    differentiable = ours.differentiable_loss(model, guide, *args, **kwargs)
    pyro.set_rng_seed(5)
    loss = ours.loss(model, guide, *args, **kwargs)
    pyro.set_rng_seed(5)
    with_grads, _ = loss_and_grads(ours, model, guide, args, kwargs, seed=5)
    assert isinstance(differentiable, torch.Tensor) and differentiable.dim() == 0
    torch.testing.assert_close(differentiable, expected, rtol=1e-12, atol=1e-12)
    assert loss == pytest.approx(differentiable.item(), rel=1e-12) == pytest.approx(with_grads, rel=1e-12)


def test_differentiable_loss_makes_no_host_read_and_pyros_makes_one_per_site():
    pyro.enable_validation(False)  # validation checks read values on the host by design
    model, guide, args, kwargs, theirs, ours = _setup("AutoNormal MLP")
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    model_trace = poutine.trace(poutine.replay(model, guide_trace)).get_trace(*args, **kwargs)
    sites = sum(s["type"] == "sample" and n != "data" for t in (model_trace, guide_trace) for n, s in t.nodes.items())
    with HostSyncCounter() as ours_syncs:
        ours.differentiable_loss(model, guide, *args, **kwargs).backward()
    with HostSyncCounter() as pyro_syncs:
        theirs.loss_and_grads(model, guide, *args, **kwargs)
    assert ours_syncs.count == 0, ours_syncs.report()
    assert pyro_syncs.count >= sites  # the baseline this replaces: a read per model site and per guide site
    with HostSyncCounter() as syncs:
        ours.loss_and_grads(model, guide, *args, **kwargs)
    assert syncs.count == 1, syncs.report()  # the float handed back


def test_nan_warning_of_differentiable_loss_only_under_validation():
    def model():  # factors +inf and -inf: a NaN loss (a NaN argument would fail the argument checks first)
        pyro.factor("up", torch.tensor(float("inf")))
        pyro.factor("down", torch.tensor(-float("inf")))

    def guide():
        pass

    for validation in (True, False):
        pyro.enable_validation(validation)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = TensorTrace_ELBO().differentiable_loss(model, guide)
        assert torch.isnan(loss)
        # without validation no warning: it would be a host read at every step
        assert any("Encountered NaN: loss" in str(w.message) for w in caught) == validation
