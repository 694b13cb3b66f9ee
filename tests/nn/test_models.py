import copy
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_flat.infer.util import latent_sites
from pyro_flat.nn import (
    BayesianClassifier,
    BayesianCNN,
    BayesianMLP,
    BayesianRegressionMLP,
    head_module_name,
    init_to_network,
    latent_init_values,
    make_bayesian,
    refresh_batchnorm,
    unpacked_sites,
)


def _latents(model, *args, **kwargs):
    """Latent weights of a trace run without labels (so "obs" is sampled, not observed: leave it out)."""
    return {k: v for k, v in latent_sites(poutine.trace(model).get_trace(*args, **kwargs)).items() if k != "obs"}


def test_mlp_sites_shapes_and_prior():
    model = BayesianMLP(5, 3, hidden=(4,), prior_scale=0.5, packed=False)
    x = torch.randn(7, 5)
    trace = poutine.trace(model).get_trace(x, torch.zeros(7, dtype=torch.long))
    lat = latent_sites(trace)
    assert {k: tuple(v.shape) for k, v in lat.items()} == {
        "net.1.weight": (4, 5),
        "net.1.bias": (4,),
        "net.3.weight": (3, 4),
        "net.3.bias": (3,),
    }
    trace.compute_log_prob()
    expected = dist.Normal(0.0, 0.5).log_prob(lat["net.1.weight"]).sum()
    assert torch.allclose(trace.nodes["net.1.weight"]["log_prob_sum"], expected)
    # the logits are a deterministic function of the sampled weights
    h = torch.relu(x @ lat["net.1.weight"].T + lat["net.1.bias"])
    assert torch.allclose(trace.nodes["logits"]["value"], h @ lat["net.3.weight"].T + lat["net.3.bias"])


def test_subsampled_likelihood_is_scaled_by_n_over_b():
    model = BayesianMLP(3, 2, hidden=(4,))
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    trace = poutine.trace(model).get_trace(x, y, subsample_size=8)
    obs = trace.nodes["obs"]
    assert obs["value"].shape == (8,)
    assert obs["scale"] == pytest.approx(40 / 8)
    idx = trace.nodes["data"]["value"]
    assert torch.equal(obs["value"], y[idx])
    # external minibatch with num_data: same scale, the batch is used as is
    trace = poutine.trace(model).get_trace(x[:8], y[:8], num_data=40)
    assert trace.nodes["obs"]["scale"] == pytest.approx(5.0)
    assert torch.equal(trace.nodes["obs"]["value"], y[:8])
    # replaying a trace replays the minibatch
    replayed = poutine.trace(poutine.replay(model, trace=trace)).get_trace(x[:8], y[:8], num_data=40)
    assert torch.equal(replayed.nodes["logits"]["value"], trace.nodes["logits"]["value"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"subsample_size": 0}, "subsample_size"),
        ({"subsample_size": 11}, "subsample_size"),
        ({"num_data": 3}, "num_data"),
        ({"num_data": 20, "subsample_size": 2}, "either"),
    ],
)
def test_bad_plate_arguments(kwargs, match):
    model = BayesianMLP(3, 2, hidden=(4,))
    with pytest.raises(ValueError, match=match):
        model(torch.randn(10, 3), torch.zeros(10, dtype=torch.long), **kwargs)


def test_bad_labels():
    model = BayesianMLP(3, 2, hidden=(4,))
    with pytest.raises(ValueError, match="`y` must hold integer class labels"):
        model(torch.randn(10, 3), torch.zeros(10))
    with pytest.raises(ValueError, match=r"`y` must be a tensor of shape \[10\]"):
        model(torch.randn(10, 3), torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match="`x` must be a tensor"):
        model(torch.randn(10))


@pytest.mark.parametrize("kwargs, match", [({"prior_scale": 0}, "prior_scale"), ({"prior_loc": "mean"}, "prior_loc"),
                                           ({"rest": "drop"}, "rest"), ({"random": "some"}, "random"),
                                           ({"random": ["nope.weight"]}, "nope.weight"),
                                           ({"random": []}, "selected no parameter")])
def test_make_bayesian_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_bayesian(nn.Sequential(nn.Linear(2, 3)), **kwargs)


def _net_with_norm():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.LayerNorm(6),
                         nn.Linear(6, 3))


def test_norm_and_head_frozen_rest():
    net = _net_with_norm()
    original = {k: v.detach().clone() for k, v in net.named_parameters()}
    assert head_module_name(net) == "5"
    make_bayesian(net, random="norm_and_head", rest="frozen", prior_loc="current", prior_scale=0.1, packed=False)
    model = BayesianClassifier(net, 3)
    lat = _latents(model, torch.randn(5, 4))
    assert set(lat) == {"net.1.weight", "net.1.bias", "net.4.weight", "net.4.bias", "net.5.weight", "net.5.bias"}
    # frozen layers are buffers with the original values; nothing is learnable
    assert list(model.parameters()) == []
    assert torch.equal(net[0].weight, original["0.weight"])
    # the prior is centred at the pretrained values
    prior = net[5]._pyro_samples["weight"](net[5])
    assert torch.equal(prior.mean, original["5.weight"])
    assert torch.allclose(prior.stddev, torch.full_like(prior.stddev, 0.1))
    # frozen parameters do not appear as pyro.param sites
    with poutine.trace(param_only=True) as tr:
        model(torch.randn(5, 4))
    assert len(tr.trace.nodes) == 0


def test_learned_rest_are_pyro_params():
    net = make_bayesian(_net_with_norm(), random=["5.weight"], rest="learned", packed=False)
    model = BayesianClassifier(net, 3)
    with poutine.trace(param_only=True) as tr:
        model(torch.randn(5, 4))
    assert "net.0.weight" in tr.trace.nodes and "net.5.bias" in tr.trace.nodes
    assert set(_latents(model, torch.randn(5, 4))) == {"net.5.weight"}


def test_predicate_selection():
    net = make_bayesian(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), random=lambda m, sub, p: p == "bias",
                        packed=False)
    assert set(_latents(BayesianClassifier(net, 2), torch.randn(4, 2))) == {"net.0.bias", "net.1.bias"}


def test_init_to_network_starts_at_torch_init():
    torch.manual_seed(3)
    model = BayesianMLP(3, 2, hidden=(4,), packed=False)
    init = latent_init_values(model)
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-6)
    x = torch.randn(6, 3)
    guide(x, torch.zeros(6, dtype=torch.long))
    assert torch.allclose(guide.median()["net.1.weight"], init["net.1.weight"])
    # torch's Linear init is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), not a N(0, 1) prior draw
    assert init["net.1.weight"].abs().max() <= 3**-0.5


def test_model_moves_device_and_dtype_with_prior():
    model = BayesianMLP(3, 2, hidden=(4,)).to(torch.float32)
    lat = _latents(model, torch.randn(5, 3, dtype=torch.float32))
    assert all(v.dtype == torch.float32 for v in lat.values())
    model = model.to(torch.float64)
    lat = _latents(model, torch.randn(5, 3))
    assert all(v.dtype == torch.float64 for v in lat.values())


def test_pickle_and_deepcopy():
    model = BayesianMLP(3, 2, hidden=(4,))
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert set(_latents(clone, torch.randn(5, 3))) == set(_latents(model, torch.randn(5, 3)))


def test_predictive_returns_logits():
    model = BayesianMLP(3, 4, hidden=(5,))
    guide = AutoNormal(model, init_loc_fn=init_to_network(model))
    x = torch.randn(6, 3)
    guide(x, torch.zeros(6, dtype=torch.long))
    out = Predictive(model, guide=guide, num_samples=7)(x)
    assert out["logits"].shape == (7, 6, 4)
    assert out["obs"].shape == (7, 6)


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 40)])
def test_cnn_shapes(shape):
    model = BayesianCNN(shape, 10, channels=(4, 6))
    assert model(torch.randn(3, *shape)).shape == (3, 10)
    with pytest.raises(ValueError, match="input_shape"):
        BayesianCNN((8,), 10)


def _per_tensor(model, draw):
    """``draw`` with each packed site split into its per-tensor values (the layout of :func:`unpacked_sites`)."""
    values = dict(draw)
    for site, layout in unpacked_sites(model).items():
        chunks = values.pop(site).split([shape.numel() for shape in layout.values()])
        values.update({n: c.reshape(shape) for (n, shape), c in zip(layout.items(), chunks, strict=True)})
    return values


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per tensor"])
def test_refresh_batchnorm_recomputes_statistics_at_the_draw(packed):
    model = BayesianCNN((1, 8, 8), 3, channels=(4, 4), norm="batch", packed=packed)
    x = torch.randn(50, 1, 8, 8)
    draw = _latents(model, x)
    assert list(draw) == ["net.weights"] if packed else "net.0.weight" in draw
    refresh_batchnorm(model, draw, x, batch_size=50)
    # expected statistics: the mean/variance of the first conv's output at the drawn weights, over the data
    weights = _per_tensor(model, draw)
    pre = torch.nn.functional.conv2d(x, weights["net.0.weight"], weights["net.0.bias"], padding=1)
    bn = model.net[1]
    assert torch.allclose(bn.running_mean, pre.mean(dim=(0, 2, 3)), atol=1e-10)
    assert torch.allclose(bn.running_var, pre.var(dim=(0, 2, 3), unbiased=True), atol=1e-10)
    assert model.training


def test_regression_heteroscedastic():
    model = BayesianRegressionMLP(1, hidden=(8,))
    x, y = torch.randn(9, 1), torch.randn(9)
    trace = poutine.trace(model).get_trace(x, y)
    assert trace.nodes["loc"]["value"].shape == (9,)
    assert (trace.nodes["scale"]["value"] > 0).all()
    fixed = BayesianRegressionMLP(1, hidden=(8,), obs_scale=0.3)
    trace = poutine.trace(fixed).get_trace(x, y)
    assert torch.allclose(trace.nodes["scale"]["value"], torch.full((9,), 0.3))
    with pytest.raises(ValueError, match="obs_scale"):
        BayesianRegressionMLP(1, obs_scale=-1.0)


def test_pyro_svi_step_runs_on_subsampled_model():
    model = BayesianMLP(3, 2, hidden=(4,))
    guide = AutoNormal(model, init_loc_fn=init_to_network(model))
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), pyro.infer.Trace_ELBO())
    x, y = torch.randn(30, 3), torch.randint(0, 2, (30,))
    losses = [svi.step(x, y, subsample_size=10) for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
