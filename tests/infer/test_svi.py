"""TensorSVI: Pyro's SVI whose step returns the loss as a device tensor — the same trajectory as SVI.step, no host
read per step."""

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_flat.infer import KLBallELBO, SharpnessAwareELBO, TensorSVI, TensorTrace_ELBO
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.testing import HostSyncCounter


def _fit(svi_class, loss, steps=4, **options):
    pyro.clear_param_store()
    torch.manual_seed(1)
    model = BayesianMLP(5, 3, hidden=(8,))
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=0.05)
    svi = svi_class(model, guide, pyro.optim.Adam({"lr": 0.01}), loss, **options)
    pyro.set_rng_seed(7)
    losses = [svi.step(x, y, subsample_size=8) for _ in range(steps)]
    return losses, {name: value.detach().clone() for name, value in pyro.get_param_store().items()}, svi, (x, y)


@pytest.mark.parametrize("make", [Trace_ELBO, lambda: SharpnessAwareELBO(0.1), lambda: KLBallELBO(0.05)],
                         ids=["Trace_ELBO", "SharpnessAwareELBO", "KLBallELBO"])
def test_same_trajectory_as_svi(make):
    expected_losses, expected, _, _ = _fit(SVI, make())
    losses, params, _, _ = _fit(TensorSVI, make())
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in losses)
    torch.testing.assert_close(torch.stack(losses), torch.tensor(expected_losses), rtol=1e-10, atol=1e-10)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10)


def test_gradients_set_to_none_give_the_same_trajectory_and_hold_no_gradient():
    expected_losses, expected, _, _ = _fit(SVI, Trace_ELBO())
    losses, params, _, _ = _fit(TensorSVI, Trace_ELBO(), set_grads_to_none=True)
    torch.testing.assert_close(torch.stack(losses), torch.tensor(expected_losses), rtol=1e-10, atol=1e-10)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-10)
    assert all(p.grad is None for _, p in pyro.get_param_store().named_parameters())
    _fit(TensorSVI, Trace_ELBO(), steps=1)
    zeros = [p.grad for _, p in pyro.get_param_store().named_parameters()]  # Pyro's fresh zeros
    assert all(g is not None and not g.any() for g in zeros)


def test_a_step_makes_no_host_read():
    pyro.enable_validation(False)
    _, _, svi, (x, y) = _fit(TensorSVI, TensorTrace_ELBO(), steps=1)
    with HostSyncCounter() as syncs:
        for _ in range(3):
            svi.step(x, y, subsample_size=8)
    assert syncs.count == 0, syncs.report()
    _, _, svi, _ = _fit(SVI, TensorTrace_ELBO(), steps=1)
    with HostSyncCounter() as syncs:
        for _ in range(3):
            svi.step(x, y, subsample_size=8)
    assert syncs.count == 3, syncs.report()  # SVI.step reads the loss once, to hand back a float


def test_callable_loss():
    def loss(model, guide, *args, **kwargs):
        return TensorTrace_ELBO().differentiable_loss(model, guide, *args, **kwargs)

    expected_losses, _, _, _ = _fit(SVI, Trace_ELBO(), steps=2)
    losses, _, _, _ = _fit(TensorSVI, loss, steps=2)
    torch.testing.assert_close(torch.stack(losses), torch.tensor(expected_losses), rtol=1e-10, atol=1e-10)
