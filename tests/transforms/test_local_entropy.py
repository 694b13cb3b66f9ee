import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive

from pyro_flat.data import BayesianLinearRegression, GaussianTarget
from pyro_flat.transforms import local_entropy, local_entropy_draws, local_entropy_potential


def _log_joint(model, values, *args, **kwargs):
    return poutine.trace(poutine.condition(model, values)).get_trace(*args, **kwargs).log_prob_sum()


def test_adds_an_anchor_and_a_coupling_per_latent_site():
    blr = BayesianLinearRegression.generate(20, 3)
    trace = poutine.trace(local_entropy(blr.model, 0.5)).get_trace(subsample_size=5)
    names = [n for n, s in trace.nodes.items() if s["type"] == "sample"]
    assert names == ["w", "w_anchor", "w_coupling", "data", "obs"]
    # the anchor starts as a copy of the site's value (the authors' initialisation) and has log density 0
    assert torch.equal(trace.nodes["w_anchor"]["value"], trace.nodes["w"]["value"])
    assert not trace.nodes["w_anchor"]["is_observed"]
    assert trace.nodes["w_anchor"]["fn"].log_prob(torch.randn(3)).item() == 0.0


def test_log_joint_is_the_model_plus_the_coupling():
    blr = BayesianLinearRegression.generate(20, 3)
    w, anchor = torch.randn(3), torch.randn(3)
    eta = 0.3
    original = _log_joint(blr.model, {"w": w})
    flat = _log_joint(local_entropy(blr.model, eta), {"w": w, "w_anchor": anchor})
    assert torch.allclose(flat, original - ((w - anchor) ** 2).sum() / (2 * eta))


def test_anchors_survive_an_outer_condition_and_receive_gradients():
    # an MCMC potential conditions every latent from outside; the anchor must still be coupled to it
    blr = BayesianLinearRegression.generate(20, 2)
    w, anchor = torch.zeros(2, requires_grad=True), torch.ones(2, requires_grad=True)
    value = _log_joint(local_entropy(blr.model, 0.1), {"w": w, "w_anchor": anchor})
    (g_anchor,) = torch.autograd.grad(value, [anchor])
    assert torch.allclose(g_anchor, -(anchor - w).detach() / 0.1)


def test_marginals_of_a_gaussian_are_exact():
    # For U = -log N(mu, Sigma) the transformed joint is Gaussian with precision [[A + I/eta, -I/eta], [-I/eta, I/eta]]
    # (A = Sigma^-1): read it off the Hessian of the transformed model's log joint and check the derived facts
    # theta ~ N(mu, Sigma) and theta_a ~ N(mu, Sigma + eta I) exactly.
    cov = torch.tensor([[2.0, 0.6], [0.6, 1.0]])
    target = GaussianTarget(torch.tensor([1.0, -2.0]), cov)
    eta = 0.7
    model = local_entropy(target.model, eta)

    def neg_log_joint(z):
        return -_log_joint(model, {"theta": z[:2], "theta_anchor": z[2:]})

    z0 = torch.zeros(4)
    precision = torch.autograd.functional.hessian(neg_log_joint, z0)
    joint_cov = torch.linalg.inv(precision)
    assert torch.allclose(joint_cov[:2, :2], cov, atol=1e-10)
    assert torch.allclose(joint_cov[2:, 2:], cov + eta * torch.eye(2), atol=1e-10)
    grad = torch.autograd.functional.jacobian(neg_log_joint, z0)
    mean = -torch.linalg.solve(precision, grad)
    assert torch.allclose(mean, torch.tensor([1.0, -2.0, 1.0, -2.0]), atol=1e-10)


def test_sites_in_plates_get_batched_anchors():
    def model():
        with pyro.plate("groups", 4):
            loc = pyro.sample("loc", dist.Normal(torch.zeros(4, 2), 1.0).to_event(1))
        pyro.sample("obs", dist.Normal(loc.sum(), 1.0), obs=torch.tensor(0.5))

    trace = poutine.trace(local_entropy(model, 0.5)).get_trace()
    trace.compute_log_prob()
    assert trace.nodes["loc_anchor"]["value"].shape == (4, 2)
    assert trace.nodes["loc_coupling"]["log_prob"].shape == (4,)


def test_anchor_prior_scale_adds_a_gaussian_prior_on_the_anchors():
    blr = BayesianLinearRegression.generate(10, 2)
    w, anchor = torch.randn(2), torch.randn(2)
    plain = _log_joint(local_entropy(blr.model, 0.5), {"w": w, "w_anchor": anchor})
    decayed = _log_joint(local_entropy(blr.model, 0.5, anchor_prior_scale=3.0), {"w": w, "w_anchor": anchor})
    assert torch.allclose(decayed - plain, dist.Normal(0.0, 3.0).log_prob(anchor).sum())


@pytest.mark.parametrize("eta", [0.0, -1.0, float("inf"), float("nan"), "1", True])
def test_eta_must_be_positive(eta):
    with pytest.raises(ValueError, match="`eta` must be a finite number > 0"):
        local_entropy(lambda: None, eta)
    with pytest.raises(ValueError, match="eta"):
        local_entropy_potential(lambda p: 0.0, eta)


def test_anchor_prior_scale_must_be_positive():
    with pytest.raises(ValueError, match="anchor_prior_scale"):
        local_entropy(lambda: None, 1.0, anchor_prior_scale=0.0)


def test_discrete_latents_are_rejected_by_name():
    def model():
        pyro.sample("z", dist.Bernoulli(0.3))
        pyro.sample("x", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="site 'z' is discrete"):
        poutine.trace(local_entropy(model, 1.0)).get_trace()


def test_predictive_and_pickle():
    blr = BayesianLinearRegression.generate(20, 2)
    flat = local_entropy(blr.model, 0.5)
    samples = {"w": torch.randn(7, 2), "w_anchor": torch.randn(7, 2)}
    out = Predictive(flat, posterior_samples=samples, return_sites=["obs"])(blr.x)
    assert out["obs"].shape == (7, 20)
    clone = pickle.loads(pickle.dumps(flat))
    assert torch.allclose(_log_joint(clone, {"w": samples["w"][0], "w_anchor": samples["w_anchor"][0]}),
                          _log_joint(flat, {"w": samples["w"][0], "w_anchor": samples["w_anchor"][0]}))


def test_local_entropy_potential():
    target = GaussianTarget(torch.zeros(2), torch.eye(2))
    potential = local_entropy_potential(lambda p: target.potential(p["theta"]), 0.25)
    theta, anchor = torch.randn(2), torch.randn(2)
    value = potential({"theta": theta, "theta_anchor": anchor})
    assert torch.allclose(value, target.potential(theta) + ((theta - anchor) ** 2).sum() / 0.5)
    with pytest.raises(ValueError, match="not its anchor 'theta_anchor'"):
        potential({"theta": theta})


def test_local_entropy_draws():
    samples = {"a": torch.randn(5, 2), "a_anchor": torch.randn(5, 2), "b": torch.randn(5), "b_anchor": torch.randn(5)}
    theta = local_entropy_draws(samples, "theta")
    assert set(theta) == {"a", "b"} and torch.equal(theta["a"], samples["a"])
    anchors = local_entropy_draws(samples, "anchor")
    assert set(anchors) == {"a", "b"} and torch.equal(anchors["b"], samples["b_anchor"])
    both = local_entropy_draws(samples)
    assert both["a"].shape == (10, 2) and torch.equal(both["a"][5:], samples["a_anchor"])
    with pytest.raises(ValueError, match="no anchor site"):
        local_entropy_draws({"a": torch.randn(3)}, "anchor")
    with pytest.raises(ValueError, match="collect"):
        local_entropy_draws(samples, "all")


# ----------------------------------------------------------------------------------- constrained sites, outer handlers


def positive_model(y=None):
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    p = pyro.sample("p", dist.Dirichlet(torch.ones(3)))
    with pyro.plate("data", 4):
        pyro.sample("y", dist.Normal(p[0], s), obs=y)


def test_log_joint_of_constrained_sites_couples_unconstrained_values():
    # log p(theta, theta_a) = log p(theta) + sum -||t(theta) - t(theta_a)||^2 / (2 eta) + log|det J_t(theta_a)|
    y = torch.tensor([0.1, 0.4, -0.3, 0.9])
    s, s_a = torch.tensor(0.7), torch.tensor(1.9)
    p, p_a = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.6, 0.1, 0.3])
    eta = 0.4
    values = {"s": s, "s_anchor": s_a, "p": p, "p_anchor": p_a}
    flat = _log_joint(local_entropy(positive_model, eta), values, y)
    original = _log_joint(positive_model, {"s": s, "p": p}, y)
    t_s, t_p = torch.distributions.biject_to(dist.LogNormal(0.0, 1.0).support).inv, \
        torch.distributions.biject_to(dist.Dirichlet(torch.ones(3)).support).inv
    coupling = -((t_s(s) - t_s(s_a)) ** 2 + ((t_p(p) - t_p(p_a)) ** 2).sum()) / (2 * eta)
    jacobian = t_s.log_abs_det_jacobian(s_a, t_s(s_a)) + t_p.log_abs_det_jacobian(p_a, t_p(p_a))
    torch.testing.assert_close(flat, original + coupling + jacobian)


def test_anchor_has_the_sites_shape_and_support_and_starts_as_a_copy():
    trace = poutine.trace(local_entropy(positive_model, 0.3)).get_trace(torch.zeros(4))
    for name in ("s", "p"):
        anchor = trace.nodes[f"{name}_anchor"]
        assert anchor["fn"].support is trace.nodes[name]["fn"].support
        assert torch.equal(anchor["value"], trace.nodes[name]["value"])


def test_outer_condition_of_an_observation_adds_no_anchor():
    # issue 11 item 5: pyro.condition(local_entropy(model), {"y": y}) added a spurious "y_anchor"
    y = torch.tensor([0.1, 0.4, -0.3, 0.9])

    def unobserved(y=None):
        positive_model(None)

    outside = poutine.trace(pyro.condition(local_entropy(unobserved, 0.3), {"y": y})).get_trace()
    inside = poutine.trace(local_entropy(pyro.condition(unobserved, {"y": y}), 0.3)).get_trace()
    assert "y_anchor" not in outside.nodes
    assert [n for n in outside.nodes if n.endswith("_anchor")] == [n for n in inside.nodes if n.endswith("_anchor")]
    values = {"s": torch.tensor(0.8), "s_anchor": torch.tensor(1.1), "p": torch.tensor([0.2, 0.5, 0.3]),
              "p_anchor": torch.tensor([0.3, 0.3, 0.4])}
    torch.testing.assert_close(
        _log_joint(pyro.condition(local_entropy(unobserved, 0.3), {"y": y}), values),
        _log_joint(local_entropy(pyro.condition(unobserved, {"y": y}), 0.3), values),
    )


def test_outer_do_and_a_block_hiding_only_the_anchor_are_refused():
    y = torch.zeros(4)
    with pytest.raises(ValueError, match="poutine.do intervenes on site 's'"):
        poutine.trace(poutine.do(local_entropy(positive_model, 0.3), {"s": torch.tensor(1.0)})).get_trace(y)
    with pytest.raises(ValueError, match="hides the anchor 's_anchor' while its site 's' stays visible"):
        poutine.trace(poutine.block(local_entropy(positive_model, 0.3), hide=["s_anchor"])).get_trace(y)


def test_outer_selective_block_of_a_site_is_as_inside():
    y = torch.zeros(4)
    outside = poutine.trace(poutine.block(local_entropy(positive_model, 0.3), hide=["p"])).get_trace(y)
    inside = poutine.trace(local_entropy(poutine.block(positive_model, hide=["p"]), 0.3)).get_trace(y)
    assert set(outside.nodes) == set(inside.nodes) and "p_anchor" not in inside.nodes
