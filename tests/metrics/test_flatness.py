"""Flatness adapters: network_loss_fn / model_loss_fn against hand-written losses and dense Hessians."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_flat.metrics import (
    hessian_eigenvalues,
    hessian_trace,
    model_loss_fn,
    network_loss_fn,
    sam_sharpness,
)
from pyro_flat.ops import hessian as ops
from pyro_flat.ops.tree import flatten, unflatten_like


def _dense_hessian(loss_of_list, params):
    """Dense Hessian of a list-of-tensors loss by torch.autograd.functional (independent of pyro_flat.ops).

    (torch.func.hessian would do too, but its forward-mode AD emits a torch.jit FutureWarning under torch 2.14.)
    """
    flat = flatten(params).detach()
    dense = torch.autograd.functional.hessian(lambda theta: loss_of_list(unflatten_like(theta, params)), flat)
    return (dense + dense.T) / 2


# ---------------------------------------------------------------------------------------------------------------------
# networks
# ---------------------------------------------------------------------------------------------------------------------


def _mlp(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(100, 5)
    y = torch.randint(0, 3, (100,))
    return net, x, y


def test_network_loss_fn_value_and_parameter_order():
    net, x, y = _mlp()
    loss_fn, params = network_loss_fn(net, x, y)
    assert [p.shape for p in params] == [p.shape for p in net.parameters()]
    assert all(not p.requires_grad for p in params)
    torch.testing.assert_close(loss_fn(params), nn.functional.cross_entropy(net(x), y))
    # the function really depends on its argument, not on the module's own parameters
    doubled = [2 * p for p in params]
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(2)
    torch.testing.assert_close(loss_fn(doubled), nn.functional.cross_entropy(net(x), y))


def test_network_loss_fn_mse_and_frozen_parameters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    net[0].weight.requires_grad_(False)
    x, target = torch.randn(30, 3), torch.randn(30, 2)
    loss_fn, params = network_loss_fn(net, x, target, loss="mse")
    assert len(params) == 3  # the frozen weight is excluded
    torch.testing.assert_close(loss_fn(params), ((net(x) - target) ** 2).mean())


def test_network_hessian_metrics_match_dense():
    net, x, y = _mlp()
    loss_fn, params = network_loss_fn(net, x, y)
    dense = _dense_hessian(loss_fn, params)
    eigenvalues = torch.linalg.eigvalsh(dense).flip(0)
    got = hessian_eigenvalues(loss_fn, params, k=3, tol=1e-8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, eigenvalues[:3], rtol=1e-6, atol=1e-9)
    # Hutchinson: z-test against the exact trace with the exact probe variance (z < 4.5)
    num_samples = 400
    trace = hessian_trace(loss_fn, params, num_samples=num_samples, generator=torch.Generator().manual_seed(0))
    variance = 2 * (dense.square().sum() - dense.diagonal().square().sum())
    assert abs(float((trace - dense.trace()) / (variance / num_samples).sqrt())) < 4.5
    torch.testing.assert_close(sam_sharpness(loss_fn, params), ops.sam_sharpness(loss_fn, params, 0.05))


def test_network_loss_fn_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).train()
    x, y = torch.randn(50, 4), torch.randint(0, 2, (50,))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    loss_fn, params = network_loss_fn(net, x, y)
    hessian_eigenvalues(loss_fn, params, k=1, num_iters=5)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    torch.testing.assert_close(loss_fn(params), nn.functional.cross_entropy(net(x), y))  # train-mode batch stats


def test_network_loss_fn_validation():
    net, x, y = _mlp()
    with pytest.raises(ValueError, match=r"`loss` must be one of \['cross_entropy', 'mse'\], got 'nll'"):
        network_loss_fn(net, x, y, loss="nll")
    with pytest.raises(ValueError, match="same number of rows, got 100 and 99"):
        network_loss_fn(net, x, y[1:])
    with pytest.raises(ValueError, match="no trainable parameters"):
        network_loss_fn(net.requires_grad_(False), x, y)


# ---------------------------------------------------------------------------------------------------------------------
# Pyro models
# ---------------------------------------------------------------------------------------------------------------------


def _data(n=60, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.5, -2.0, 0.5]) + 0.3), generator=g)
    return x, y


def logistic_regression(x, y, subsample_size=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as index:
        pyro.sample("obs", dist.Bernoulli(logits=x[index] @ w + b), obs=y[index])


def _bce(theta, x, y):
    return nn.functional.binary_cross_entropy_with_logits(x @ theta["w"] + theta["b"], y)


def test_model_loss_fn_is_the_mean_bce_and_its_hessian_is_exact():
    x, y = _data()
    theta = {"w": torch.tensor([0.3, -0.2, 0.1]), "b": torch.tensor(0.05)}
    loss_fn = model_loss_fn(logistic_regression, x, y)
    torch.testing.assert_close(loss_fn(theta), _bce(theta, x, y))
    names = list(theta)
    dense = _dense_hessian(lambda values: _bce(dict(zip(names, values, strict=True)), x, y), list(theta.values()))
    expected = torch.linalg.eigvalsh(dense).flip(0)
    torch.testing.assert_close(hessian_eigenvalues(loss_fn, theta, k=2), expected[:2], rtol=1e-8, atol=1e-12)
    values, vectors = hessian_eigenvalues(loss_fn, theta, k=1, eigenvectors=True)
    assert set(vectors[0]) == {"w", "b"} and vectors[0]["b"].shape == ()
    v = torch.cat([vectors[0]["w"], vectors[0]["b"][None]])
    torch.testing.assert_close(dense @ v, values[0] * v, rtol=0, atol=1e-10)
    # SAM sharpness of the dict loss equals that of the hand-written loss on a list
    list_loss = lambda values: _bce(dict(zip(names, values, strict=True)), x, y)  # noqa: E731
    torch.testing.assert_close(
        sam_sharpness(loss_fn, theta, rho=0.1), ops.sam_sharpness(list_loss, list(theta.values()), 0.1)
    )
    assert float(hessian_trace(loss_fn, theta, num_samples=2)) > 0


def test_model_loss_fn_subsampled_plate_is_not_rescaled_and_is_frozen():
    x, y = _data(n=60)
    theta = {"w": torch.tensor([0.3, -0.2, 0.1]), "b": torch.tensor(0.05)}
    pyro.set_rng_seed(123)
    loss_fn = model_loss_fn(logistic_regression, x, y, subsample_size=10)
    value = loss_fn(theta)
    # the indices drawn at the first call: replay the same random draw
    pyro.set_rng_seed(123)
    trace = poutine.trace(poutine.condition(logistic_regression, data=theta)).get_trace(x, y, 10)
    index = trace.nodes["data"]["value"]
    assert index.shape == (10,) and trace.nodes["obs"]["scale"] == 6.0  # Pyro scales by N/B = 6 ...
    torch.testing.assert_close(value, _bce(theta, x[index], y[index]))  # ... model_loss_fn does not
    # later calls replay the same minibatch, so the Hessian is that of one fixed loss
    for _ in range(3):
        assert torch.equal(loss_fn(theta), value)
    names = list(theta)
    dense = _dense_hessian(
        lambda values: _bce(dict(zip(names, values, strict=True)), x[index], y[index]), list(theta.values())
    )
    torch.testing.assert_close(
        hessian_eigenvalues(loss_fn, theta, k=1), torch.linalg.eigvalsh(dense)[-1:], rtol=1e-8, atol=1e-12
    )


def test_model_loss_fn_ignores_deterministic_sites():
    x, y = _data(n=20)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        logits = pyro.deterministic("logits", x @ w)  # an observed-looking site with a zero log-density
        with pyro.plate("data", 20):
            pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)

    theta = {"w": torch.tensor([0.3, -0.2, 0.1])}
    expected = nn.functional.binary_cross_entropy_with_logits(x @ theta["w"], y)
    torch.testing.assert_close(model_loss_fn(model, x, y)(theta), expected)


def test_model_loss_fn_honours_masks():
    x, y = _data(n=20)
    keep = torch.arange(20) % 3 != 0

    def masked_model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", 20), poutine.mask(mask=keep):
            pyro.sample("obs", dist.Bernoulli(logits=x @ w), obs=y)

    theta = {"w": torch.tensor([0.3, -0.2, 0.1])}
    expected = nn.functional.binary_cross_entropy_with_logits(x[keep] @ theta["w"], y[keep])
    torch.testing.assert_close(model_loss_fn(masked_model, x, y)(theta), expected)


def test_model_loss_fn_validation():
    x, y = _data()
    loss_fn = model_loss_fn(logistic_regression, x, y)
    with pytest.raises(ValueError, match=r"`theta` names \['v'\], which the model does not sample"):
        loss_fn({"w": torch.zeros(3), "b": torch.tensor(0.0), "v": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"`theta` must give a value to every latent site; missing: \['b'\]"):
        model_loss_fn(logistic_regression, x, y)({"w": torch.zeros(3)})

    def prior_only():
        pyro.sample("w", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="the model has no observed sample sites"):
        model_loss_fn(prior_only)({"w": torch.tensor(0.0)})
