"""The closure-based optimizers evaluate their closure a second time as it first ran (pyro_flat.infer.replay): the same
dropout masks, the same ``pyro.plate`` minibatch, BatchNorm statistics updated by the first evaluation only, and the
random stream continuing as after one evaluation."""

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from torch import nn

from pyro_flat.ops.sam import sam_perturbation
from pyro_flat.optim import SAM, BayesianSAM

OPTIMIZERS = {
    "SAM": lambda params: SAM(params, torch.optim.SGD, rho=0.5, lr=0.0),
    "BayesianSAM": lambda params: BayesianSAM(params, lr=0.01, num_data=50, rho=0.5),
}


def _network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)


def _closure(net, x, y):
    def closure():
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_second_evaluation_sees_the_same_dropout_mask_and_leaves_batchnorm_alone(name):
    net, (x, y) = _network(), _data()
    masks = []
    net[2].register_forward_hook(lambda module, args, out: masks.append(out != 0))
    torch.manual_seed(7)
    OPTIMIZERS[name](list(net.parameters())).step(_closure(net, x, y))
    assert len(masks) == 2
    torch.testing.assert_close(masks[0], masks[1], rtol=0, atol=0)
    assert int(net[1].num_batches_tracked) == 1  # BatchNorm: updated by the first evaluation only
    assert not bool(masks[0].all())  # dropout is active: the equality above is the replay's, not a trivial one


def test_sam_gradient_is_the_gradient_at_the_perturbed_weights_with_the_first_evaluations_randomness():
    net, (x, y) = _network(), _data()
    twin = copy.deepcopy(net)
    params, twin_params = list(net.parameters()), list(twin.parameters())
    torch.manual_seed(7)
    OPTIMIZERS["SAM"](params).step(_closure(net, x, y))
    after_step = torch.rand(())
    # by hand: the first evaluation at theta, then the second at theta + eps with the same random state and the
    # BatchNorm momentum at 0 (running statistics unchanged)
    torch.manual_seed(7)
    _closure(twin, x, y)()
    assert torch.equal(torch.rand(()), after_step)  # the stream continues as after one evaluation
    torch.testing.assert_close(net[1].running_mean, twin[1].running_mean, rtol=0, atol=0)
    with torch.no_grad():
        for p, e in zip(twin_params, sam_perturbation([p.grad for p in twin_params], 0.5), strict=True):
            p.add_(e)
            p.grad = None
    twin[1].momentum = 0.0
    torch.manual_seed(7)
    _closure(twin, x, y)()
    for p, ref in zip(params, twin_params, strict=True):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_second_evaluation_scores_the_same_pyro_minibatch(name):
    x, y = torch.randn(40, 3), torch.randn(40)
    minibatches = []

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", len(x), subsample_size=5) as idx:
            minibatches.append(idx)
            pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

    guide = AutoDelta(model)
    guide(x, y)
    minibatches.clear()
    elbo = Trace_ELBO()

    def closure():
        loss = elbo.differentiable_loss(model, guide, x, y) / len(x)
        loss.backward()
        return loss

    pyro.set_rng_seed(3)
    OPTIMIZERS[name](list(guide.parameters())).step(closure)
    assert len(minibatches) == 2
    torch.testing.assert_close(minibatches[0], minibatches[1], rtol=0, atol=0)
