"""The networks users bring to make_bayesian (recurrent, attention, embedding, convolution and normalisation layers,
tied weights, torchvision classifiers), per weight tensor and packed: the model's log joint and its gradients are the
hand-written ones, prior plus likelihood in plain torch (``torch.func.functional_call`` on the untouched network,
which ties shared weights itself), and a SAM step (``SharpnessAwareELBO`` with ``AutoDelta``) gives the same loss and
gradients in both forms."""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta
from torch.distributions import Categorical, Normal
from torch.func import functional_call

from pyro_flat.infer import SharpnessAwareELBO
from pyro_flat.nn import BayesianClassifier, init_to_network, latent_init_values, make_bayesian, unpacked_sites

from .catalogue import NETWORK_CASES, NetworkCase

PRIOR_SCALE = 0.7
FORMS = {"per tensor": False, "packed": True}


def _networks(case: NetworkCase, packed: bool):
    """The plain network (its weights moved off their constant initial values, so that each tensor is told apart by
    its value), the Bayesian model of a copy, the inputs and labels."""
    if case.needs:
        pytest.importorskip(case.needs)
    plain = case.build()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    model = BayesianClassifier(make_bayesian(copy.deepcopy(plain), prior_scale=PRIOR_SCALE, packed=packed),
                               case.num_classes)
    x = case.inputs()
    y = torch.randint(0, case.num_classes, (len(x),), generator=generator)
    return plain, model, x, y


def _per_tensor_layout(model, packed: bool) -> dict[str, torch.Size]:
    """``{per-tensor site: shape}``, in the packed vector's order when packed."""
    if packed:
        (layout,) = unpacked_sites(model).values()
        return layout
    return {name: value.shape for name, value in latent_init_values(model).items()}


def _parameter_of_site(plain, model, packed: bool) -> dict[str, str]:
    """The plain network's parameter name of each per-tensor site: the one whose values the site starts at."""
    inits = latent_init_values(model)
    layout = _per_tensor_layout(model, packed)
    if packed:
        (flat,) = inits.values()
        inits = dict(zip(layout, (part.reshape(shape) for part, shape in zip(
            flat.split([s.numel() for s in layout.values()]), layout.values(), strict=True)), strict=True))
    parameters = dict(plain.named_parameters())
    return {site: next(name for name, p in parameters.items() if p.shape == init.shape and torch.equal(p, init))
            for site, init in inits.items()}


def _hand_written_log_joint(plain, theta, x, y):
    prior = sum(Normal(0.0, PRIOR_SCALE).log_prob(value).sum() for value in theta.values())
    return prior + Categorical(logits=functional_call(plain, theta, (x,))).log_prob(y).sum()


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", NETWORK_CASES, ids=[c.name for c in NETWORK_CASES])
def test_log_joint_and_gradients_are_the_hand_written_ones(case, form, outcome):
    outcome.check(f"make_bayesian ({form})", case.name, "log joint and its gradients = hand-written prior + likelihood "
                  "(functional_call); one latent per weight tensor")
    packed = FORMS[form]
    plain, model, x, y = _networks(case, packed)
    parameter = _parameter_of_site(plain, model, packed)
    assert sorted(parameter.values()) == sorted(name for name, _ in plain.named_parameters())  # each tensor once
    generator = torch.Generator().manual_seed(3)
    theta = {name: (p.detach() + 0.2 * torch.randn(p.shape, generator=generator)).requires_grad_()
             for name, p in plain.named_parameters()}
    torch.manual_seed(4)  # dropout and stochastic depth draw the same masks in both
    expected = _hand_written_log_joint(plain, theta, x, y)
    expected_grads = torch.autograd.grad(expected, list(theta.values()))

    layout = _per_tensor_layout(model, packed)
    if packed:
        (site,) = unpacked_sites(model)
        values = {site: torch.cat([theta[parameter[name]].detach().reshape(-1) for name in layout]).requires_grad_()}
    else:
        values = {name: theta[parameter[name]].detach().clone().requires_grad_() for name in layout}
    torch.manual_seed(4)
    with poutine.trace() as tracer, poutine.condition(data=values):
        model(x, y)
    sites = {n: s["is_observed"] for n, s in tracer.trace.nodes.items() if s["type"] == "sample"}
    assert sorted(n for n, observed in sites.items() if observed) == sorted([*values, "obs", "logits"])
    assert [n for n, observed in sites.items() if not observed] == ["data"]  # the plate only: nothing else drawn
    log_joint = tracer.trace.log_prob_sum()
    grads = dict(zip(values, torch.autograd.grad(log_joint, list(values.values())), strict=True))
    if packed:
        flat = grads.pop(site)
        grads = dict(zip(layout, (g.reshape(s) for g, s in zip(
            flat.split([s.numel() for s in layout.values()]), layout.values(), strict=True)), strict=True))
    torch.testing.assert_close(log_joint, expected, rtol=1e-12, atol=1e-9)
    by_parameter = dict(zip(theta, expected_grads, strict=True))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, by_parameter[parameter[name]], rtol=1e-10, atol=1e-10, msg=name)


def _sam_loss_and_grads(model, x, y):
    pyro.clear_param_store()
    guide = AutoDelta(model, init_loc_fn=init_to_network(model))
    guide(x, y)
    torch.manual_seed(5)  # the same dropout masks (replayed in the perturbed pass)
    with poutine.trace(param_only=True) as tracer:
        loss = SharpnessAwareELBO(0.05).loss_and_grads(model, guide, x, y)
    return loss, {name: site["value"].unconstrained().grad for name, site in tracer.trace.nodes.items()}


@pytest.mark.parametrize("case", NETWORK_CASES, ids=[c.name for c in NETWORK_CASES])
def test_sam_step_is_the_same_packed_and_per_tensor(case, outcome):
    outcome.check("SharpnessAwareELBO (AutoDelta): packed = per tensor", case.name,
                  "same loss and gradients (SAM on the MAP objective: two passes, the second replayed)")
    _, per_tensor, x, y = _networks(case, packed=False)
    _, packed, _, _ = _networks(case, packed=True)
    loss, grads = _sam_loss_and_grads(per_tensor, x, y)
    packed_loss, packed_grads = _sam_loss_and_grads(packed, x, y)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-12, atol=1e-9)
    (site, layout), = unpacked_sites(packed).items()
    flat = torch.cat([grads["AutoDelta." + name].reshape(-1) for name in layout])
    torch.testing.assert_close(packed_grads["AutoDelta." + site], flat, rtol=1e-10, atol=1e-10)
