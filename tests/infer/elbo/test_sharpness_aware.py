"""SharpnessAwareELBO / SharpnessAwareMeanFieldELBO: exact algebra against hand-derived formulas (float64, one
particle, fixed seed: no Monte-Carlo tolerance), the rho = 0 limit, and the entry-point invariants."""

import copy
import math
import random

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.distributions.testing.fakes import NonreparameterizedNormal
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal, init_to_value
from torch import nn

from pyro_flat.infer import NothingToPerturbWarning, SharpnessAwareELBO, SharpnessAwareMeanFieldELBO
from pyro_flat.nn import BayesianMLP, init_to_network
from pyro_flat.transforms import sharpness_aware
from pyro_flat.transforms.sharpness_aware_model import SharpnessAwareModel

X = torch.tensor([-0.5, 2.0, 0.3, 1.1], dtype=torch.float64)


def gaussian_model(x):
    with pyro.plate("data", len(x)):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def gaussian_guide(x):
    loc = pyro.param("loc", torch.tensor([0.1, -0.2, 0.3, 0.0]))
    scale = pyro.param("scale", torch.tensor([0.9, 1.1, 0.7, 1.3]))
    with pyro.plate("data", len(x)):
        pyro.sample("z", dist.Normal(loc, scale))


def guide_draw(seed, guide, *args, **kwargs):
    pyro.set_rng_seed(seed)
    return poutine.trace(guide).get_trace(*args, **kwargs)


def loss_and_param_grads(elbo, model, guide, *args, **kwargs):
    with poutine.trace(param_only=True) as tr:
        loss = elbo.loss_and_grads(model, guide, *args, **kwargs)
    params = {name: site["value"].unconstrained() for name, site in tr.trace.nodes.items()}
    grads = {name: p.grad.clone() for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return loss, grads


def mlp_setup(dropout=0.2):
    torch.manual_seed(1)
    model = BayesianMLP(5, 3, hidden=(8,), dropout=dropout)
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=0.05)
    return model, guide, (x, y), {"subsample_size": 8}


# ------------------------------------------------------------------------------------------------ exact algebra


def test_gaussian_closed_form_gradient():
    # model: z_i ~ N(0,1), x_i ~ N(z_i,1), guide z = loc + scale * e. With the SAM step
    # eps = rho * g/|g|, g = z - x (gradient of the NLL 1/2 sum (x-z)^2), and the likelihood at z + eps:
    #   d(-ELBO)/dloc_i   = (z_i + eps_i - x_i) + z_i
    #   d(-ELBO)/dscale_i = (2 z_i + eps_i - x_i) e_i - 1/scale_i
    rho = 0.3
    z = guide_draw(7, gaussian_guide, X).nodes["z"]["value"].detach()
    loc, scale = pyro.param("loc").detach(), pyro.param("scale").detach()
    pyro.set_rng_seed(7)
    loss, grads = loss_and_param_grads(SharpnessAwareELBO(rho), gaussian_model, gaussian_guide, X)
    g = z - X
    eps = rho * g / g.norm()
    e = (z - loc) / scale
    expected_loss = -(
        dist.Normal(z + eps, 1.0).log_prob(X).sum()
        + dist.Normal(0.0, 1.0).log_prob(z).sum()
        - dist.Normal(loc, scale).log_prob(z).sum()
    )
    assert loss == pytest.approx(expected_loss.item(), abs=1e-10)
    torch.testing.assert_close(grads["loc"], 2 * z + eps - X, atol=1e-10, rtol=0)
    torch.testing.assert_close(grads["scale"], (2 * z + eps - X) * e - 1 / scale, atol=1e-10, rtol=0)


def test_rho_zero_is_trace_elbo_on_a_network():
    # the general two-pass code with eps = 0 (no early return): same loss and gradients as Trace_ELBO, with dropout,
    # in-model subsampling and two particles (the random stream must continue exactly as Trace_ELBO's)
    model, guide, args, kwargs = mlp_setup()
    pyro.set_rng_seed(3)
    guide(*args, **kwargs)
    results = []
    for elbo in (Trace_ELBO(num_particles=2), SharpnessAwareELBO(0.0, num_particles=2)):
        pyro.set_rng_seed(11)
        results.append(loss_and_param_grads(elbo, model, guide, *args, **kwargs))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, abs=1e-12, rel=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-12, rtol=0)


def test_rho_zero_is_trace_elbo_vectorized():
    results = []
    for elbo in (Trace_ELBO(num_particles=3, vectorize_particles=True, max_plate_nesting=1),
                 SharpnessAwareELBO(0.0, num_particles=3, vectorize_particles=True, max_plate_nesting=1)):
        pyro.set_rng_seed(5)
        results.append(loss_and_param_grads(elbo, gaussian_model, gaussian_guide, X))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, abs=1e-12, rel=0)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-12, rtol=0)


def quadratic_model(a_matrix):
    def model():
        theta = pyro.sample("theta", dist.ImproperUniform(dist.constraints.real, (), (3,)))
        pyro.factor("loss", -0.5 * theta @ a_matrix @ theta)

    return model


A = torch.tensor([[2.0, 0.3, 0.0], [0.3, 1.0, 0.1], [0.0, 0.1, 0.5]], dtype=torch.float64)
THETA0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_step_on_quadratic(adaptive):
    # one SAM step on L = 1/2 theta^T A theta with lr eta and radius rho is
    #   theta - eta * A (theta + eps),  eps = rho A theta / |A theta|   (ASAM: rho theta^2 A theta / |theta A theta|)
    eta, rho = 0.1, 0.2
    model = quadratic_model(A)
    guide = AutoDelta(model, init_loc_fn=init_to_value(values={"theta": THETA0.clone()}))
    svi = SVI(model, guide, pyro.optim.SGD({"lr": eta}), SharpnessAwareELBO(rho, adaptive=adaptive))
    loss = svi.step()
    g = A @ THETA0
    eps = rho * THETA0**2 * g / (THETA0.abs() * g).norm() if adaptive else rho * g / g.norm()
    expected = THETA0 - eta * A @ (THETA0 + eps)
    torch.testing.assert_close(guide.median()["theta"], expected, atol=1e-12, rtol=0)
    assert loss == pytest.approx((0.5 * (THETA0 + eps) @ A @ (THETA0 + eps)).item(), abs=1e-12)


def test_norm_is_global_over_sites():
    # two sites with curvatures a, b: eps_i = rho g_i / |(g_1, g_2)|, not rho g_i / |g_i|
    a, b, rho = 3.0, 0.5, 0.4
    t1, t2 = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 2.0, -1.0])

    def model():
        u = pyro.sample("u", dist.ImproperUniform(dist.constraints.real, (), (2,)))
        v = pyro.sample("v", dist.ImproperUniform(dist.constraints.real, (), (3,)))
        pyro.factor("loss", -0.5 * a * u @ u - 0.5 * b * v @ v)

    guide = AutoDelta(model, init_loc_fn=init_to_value(values={"u": t1.clone(), "v": t2.clone()}))
    loss = SharpnessAwareELBO(rho).loss(model, guide)
    g1, g2 = a * t1, b * t2
    norm = torch.cat([g1, g2]).norm()

    def objective(e1, e2):
        return (0.5 * a * (t1 + e1) @ (t1 + e1) + 0.5 * b * (t2 + e2) @ (t2 + e2)).item()

    assert loss == pytest.approx(objective(rho * g1 / norm, rho * g2 / norm), abs=1e-12)
    per_site = objective(rho * g1 / g1.norm(), rho * g2 / g2.norm())
    assert abs(loss - per_site) > 0.1


def test_vectorized_particles_norm_per_particle():
    # with vectorize_particles the norm is taken per particle: the loss is the mean of the per-particle SA losses
    rho, num = 0.5, 4
    elbo = SharpnessAwareELBO(rho, num_particles=num, vectorize_particles=True, max_plate_nesting=1)
    pyro.set_rng_seed(2)
    loss = elbo.loss(gaussian_model, gaussian_guide, X)
    pyro.set_rng_seed(2)
    with pyro.plate("num_particles_vectorized", num, dim=-2):
        z = poutine.trace(gaussian_guide).get_trace(X).nodes["z"]["value"]
    assert z.shape == (num, len(X))
    loc, scale = pyro.param("loc"), pyro.param("scale")

    def sa_loss(eps):
        log_lik = dist.Normal(z + eps, 1.0).log_prob(X).sum(-1)
        log_prior = dist.Normal(0.0, 1.0).log_prob(z).sum(-1)
        log_q = dist.Normal(loc, scale).log_prob(z).sum(-1)
        return -(log_lik + log_prior - log_q).mean().item()

    g = z - X
    assert loss == pytest.approx(sa_loss(rho * g / g.norm(dim=-1, keepdim=True)), abs=1e-10)
    assert abs(loss - sa_loss(rho * g / g.norm())) > 1e-3  # one norm over all particles would differ


def test_num_particles_is_the_mean_of_single_particles():
    model, guide, args, kwargs = mlp_setup()
    pyro.set_rng_seed(0)
    guide(*args, **kwargs)
    pyro.set_rng_seed(4)
    loss = SharpnessAwareELBO(0.1, num_particles=3).loss(model, guide, *args, **kwargs)
    pyro.set_rng_seed(4)
    single = SharpnessAwareELBO(0.1)
    losses = [single.loss(model, guide, *args, **kwargs) for _ in range(3)]
    assert loss == pytest.approx(sum(losses) / 3, abs=1e-10)


def test_mean_field_variant_uses_the_analytic_kl():
    rho = 0.3
    z = guide_draw(8, gaussian_guide, X).nodes["z"]["value"].detach()
    loc, scale = pyro.param("loc").detach(), pyro.param("scale").detach()
    pyro.set_rng_seed(8)
    loss, grads = loss_and_param_grads(SharpnessAwareMeanFieldELBO(rho), gaussian_model, gaussian_guide, X)
    g = z - X
    eps = rho * g / g.norm()
    kl = torch.distributions.kl_divergence(dist.Normal(loc, scale), dist.Normal(0.0, 1.0)).sum()
    assert loss == pytest.approx((kl - dist.Normal(z + eps, 1.0).log_prob(X).sum()).item(), abs=1e-10)
    # d/dloc: (z + eps - x) through z, plus dKL/dloc = loc
    torch.testing.assert_close(grads["loc"], (z + eps - X) + loc, atol=1e-10, rtol=0)


# --------------------------------------------------------------------------------------- entry points, equivalence


@pytest.mark.parametrize("elbo_class", [SharpnessAwareELBO, SharpnessAwareMeanFieldELBO])
def test_loss_differentiable_loss_and_loss_and_grads_agree(elbo_class):
    model, guide, args, kwargs = mlp_setup()
    pyro.set_rng_seed(0)
    guide(*args, **kwargs)
    elbo = elbo_class(0.1)
    pyro.set_rng_seed(9)
    loss = elbo.loss(model, guide, *args, **kwargs)
    pyro.set_rng_seed(9)
    value, grads = loss_and_param_grads(elbo, model, guide, *args, **kwargs)
    pyro.set_rng_seed(9)
    with poutine.trace(param_only=True) as tr:
        surrogate = elbo.differentiable_loss(model, guide, *args, **kwargs)
    params = {name: site["value"].unconstrained() for name, site in tr.trace.nodes.items()}
    diff_grads = dict(zip(params, torch.autograd.grad(surrogate, list(params.values())), strict=True))
    assert value == pytest.approx(loss, abs=1e-10)
    assert surrogate.item() == pytest.approx(loss, abs=1e-10)
    for name in grads:
        torch.testing.assert_close(diff_grads[name], grads[name], atol=1e-10, rtol=0)
    with torch.no_grad():  # the no-grad path (SVI.evaluate_loss) computes the ascent with an extra pass
        pyro.set_rng_seed(9)
        assert elbo.loss(model, guide, *args, **kwargs) == pytest.approx(loss, abs=1e-10)


@pytest.mark.parametrize("elbo_class, base_class", [(SharpnessAwareELBO, Trace_ELBO),
                                                    (SharpnessAwareMeanFieldELBO, TraceMeanField_ELBO)])
def test_elbo_equals_base_elbo_on_the_transform(elbo_class, base_class):
    model, guide, args, kwargs = mlp_setup()
    pyro.set_rng_seed(0)
    guide(*args, **kwargs)
    results = []
    for m, elbo in ((model, elbo_class(0.07, num_particles=2)),
                    (sharpness_aware(model, 0.07), base_class(num_particles=2))):
        pyro.set_rng_seed(21)
        results.append(loss_and_param_grads(elbo, m, guide, *args, **kwargs))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-12)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-12, rtol=0)


def test_elbo_module_route_gives_the_sam_gradient():
    # Pyro's ELBOModule (elbo(model, guide)) calls differentiable_loss: the gradient is the SA-ELBO's
    model, guide, args, kwargs = mlp_setup(dropout=0.0)
    pyro.set_rng_seed(0)
    guide(*args, **kwargs)
    elbo = SharpnessAwareELBO(0.2)
    pyro.set_rng_seed(1)
    _, grads = loss_and_param_grads(elbo, model, guide, *args, **kwargs)
    module = elbo(model, guide)
    pyro.set_rng_seed(1)
    module(*args, **kwargs).backward()
    for name, p in pyro.get_param_store().named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-12, rtol=0)
        p.grad = None
    pyro.set_rng_seed(1)
    _, plain = loss_and_param_grads(Trace_ELBO(), model, guide, *args, **kwargs)
    assert any((plain[k] - grads[k]).abs().max() > 1e-6 for k in grads)


def test_training_then_predictive():
    model, guide, args, kwargs = mlp_setup()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), SharpnessAwareELBO(0.05))
    losses = [svi.step(*args, **kwargs) for _ in range(30)]
    assert all(math.isfinite(v) for v in losses)
    assert svi.evaluate_loss(*args, **kwargs) < losses[0]
    x = args[0]
    samples = Predictive(model, guide=guide, num_samples=4, return_sites=["logits", "obs"])(x)
    assert samples["logits"].shape == (4, 40, 3)
    assert samples["obs"].shape == (4, 40)


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("rho", [-0.1, float("nan"), float("inf"), "0.1", torch.ones(2)])
def test_bad_rho(rho):
    with pytest.raises(ValueError, match="rho"):
        SharpnessAwareELBO(rho)
    with pytest.raises(ValueError, match="rho"):
        SharpnessAwareMeanFieldELBO(rho)


@pytest.mark.parametrize("option", ["adaptive", "freeze_batchnorm"])
def test_bad_flags(option):
    with pytest.raises(ValueError, match=option):
        SharpnessAwareELBO(0.1, **{option: 1})


def test_model_without_latent_site_is_trace_elbo_and_warns_once():
    # nothing to perturb: the objective is Trace_ELBO's (the SA posterior of no latent is the likelihood), and it says
    # so once (issue 20 item 5: it was silent)
    def model(x):
        pyro.sample("x", dist.Normal(0.0, 1.0).expand([4]).to_event(1), obs=x)

    def guide(x):
        pass

    elbo = SharpnessAwareELBO(0.1)
    with pytest.warns(NothingToPerturbWarning, match="no latent site") as caught:
        losses = [elbo.loss(model, guide, X) for _ in range(2)]
    assert len(caught) == 1
    assert losses == pytest.approx([Trace_ELBO().loss(model, guide, X)] * 2)


def test_a_step_without_the_observations_warns_once():
    # issue 20 item 5: svi.step(x) without y scores no likelihood at all: Trace_ELBO's objective, not silently
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    def guide(x, y=None):
        pyro.sample("w", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(0.0, pyro.param("s", torch.tensor(1.0), constraint=dist.constraints.positive)))

    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), SharpnessAwareELBO(0.1))
    with pytest.warns(NothingToPerturbWarning, match="observes nothing .* e.g. `y`") as caught:
        for _ in range(3):
            svi.step(X)
    assert len(caught) == 1


def test_non_reparameterised_guide():
    def guide(x):
        with pyro.plate("data", len(x)):
            pyro.sample("z", NonreparameterizedNormal(torch.zeros(4), torch.ones(4)))

    with pytest.raises(ValueError, match="'z'.*not reparameterisable"):
        SharpnessAwareELBO(0.1).loss(gaussian_model, guide, X)


def test_discrete_latent():
    def model():
        c = pyro.sample("c", dist.Bernoulli(0.3))
        pyro.sample("x", dist.Normal(c, 1.0), obs=torch.tensor(0.5))

    def guide():
        pyro.sample("c", dist.Bernoulli(0.5))

    with pytest.raises(ValueError, match=r"\['c'\] have discrete support"):
        SharpnessAwareELBO(0.1).loss(model, guide)


# ------------------------------------------------------------------------------------- batch norm in the passes


class BatchNormModel(nn.Module):
    """A tiny network with BatchNorm as a Pyro model (only the head is random)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = pyro.nn.PyroModule[nn.Linear](6, 2)
        self.head.weight = pyro.nn.PyroSample(dist.Normal(0.0, 1.0).expand([2, 6]).to_event(2))

    def forward(self, x, y=None):
        logits = self.head(self.body(x))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


@pytest.mark.parametrize("freeze, expected_updates", [(True, 1), (False, 2)])
def test_batchnorm_running_stats_frozen_in_the_perturbed_pass(freeze, expected_updates):
    torch.manual_seed(3)
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    model = BatchNormModel()
    bn = model.body[1]
    guide = AutoNormal(model)
    pyro.set_rng_seed(0)
    guide(x, y)  # sets the guide up (one model pass)
    bn.reset_running_stats()
    Trace_ELBO().loss(model, guide, x, y)  # one ordinary pass
    after_one = bn.running_mean.clone(), bn.running_var.clone()
    bn.reset_running_stats()
    SharpnessAwareELBO(0.5, freeze_batchnorm=freeze).loss(model, guide, x, y)
    assert int(bn.num_batches_tracked) == expected_updates
    if freeze:
        torch.testing.assert_close(bn.running_mean, after_one[0], atol=0, rtol=0)
        torch.testing.assert_close(bn.running_var, after_one[1], atol=0, rtol=0)
    assert bn.track_running_stats  # restored


# ------------------------------------------------------------------------- the mean-field variant: what is analytic


def test_mean_field_with_autonormal_is_the_sampled_estimator():
    # AutoNormal samples an auxiliary site and maps it through a Delta: Pyro's mean-field ELBO is not analytic there,
    # and for real-valued latents it is exactly the SA-ELBO (same loss, same gradients)
    model, guide, args, kwargs = mlp_setup()
    guide(*args, **kwargs)
    results = []
    for elbo in (SharpnessAwareELBO(0.1), SharpnessAwareMeanFieldELBO(0.1)):
        pyro.set_rng_seed(3)
        results.append(loss_and_param_grads(elbo, model, guide, *args, **kwargs))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    for name in results[0][1]:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], atol=1e-12, rtol=1e-10)


@pytest.mark.statistical
def test_mean_field_lowers_the_gradient_variance_with_a_hand_written_guide():
    # over 200 draws: the analytic KL removes the KL's Monte-Carlo noise from the loc gradient (only the likelihood
    # term stays random). The two variances differ by far more than their sampling error (F-test at 200 draws: a
    # ratio below 0.6 has probability < 1e-4 if the variances were equal)
    pyro.clear_param_store()
    gaussian_guide(X)
    grads = {SharpnessAwareELBO: [], SharpnessAwareMeanFieldELBO: []}
    for seed in range(200):
        for elbo_class, out in grads.items():
            pyro.set_rng_seed(seed)
            out.append(loss_and_param_grads(elbo_class(0.1), gaussian_model, gaussian_guide, X)[1]["scale"])
    var = {k: torch.stack(v).var(0).sum() for k, v in grads.items()}
    assert var[SharpnessAwareMeanFieldELBO] < 0.6 * var[SharpnessAwareELBO]


def test_mean_field_refuses_a_constrained_latent_behind_a_delta():
    def model(y):
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        pyro.sample("y", dist.Normal(0.0, s).expand([len(y)]).to_event(1), obs=y)

    y = torch.tensor([0.3, 1.2, 0.8])
    with pytest.raises(ValueError, match="site 's' through a Delta with a Jacobian"):
        SharpnessAwareMeanFieldELBO(0.1).loss(model, AutoNormal(model), y)


# ------------------------------------------------------------------------------ LookSAM and RST, against plain torch
# A linear-Gaussian regression with two latent sites (the norms must be global) and in-model subsampling; the Pyro
# objective trained with SGD against a hand re-implementation of each paper's step in plain torch, from the same seed
# (the same minibatches, guide noise and RST choices): float64, no tolerance beyond rounding.

N_DATA, BATCH, LR, RHO = 24, 8, 0.01, 0.3


def regression_data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N_DATA, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 + 0.5 * torch.randn(N_DATA, generator=g)
    return x, y


def regression_model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x), subsample_size=BATCH) as idx:
        pyro.sample("y", dist.Normal(torch.tanh(x[idx] @ w) + b, 0.5), obs=None if y is None else y[idx])


W0, B0 = torch.tensor([0.2, -0.1, 0.4], dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)


def regression_guide(x, y):  # mean field with constrained (exp) scales
    for name, loc in (("w", W0), ("b", B0)):
        scale = pyro.param(f"{name}_scale", torch.full_like(loc, 0.2), constraint=dist.constraints.positive)
        pyro.sample(name, dist.Normal(pyro.param(f"{name}_loc", loc.clone()), scale).to_event(loc.dim()))


def nll(x, y, idx, w, b):
    return -(N_DATA / BATCH) * dist.Normal(torch.tanh(x[idx] @ w) + b, 0.5).log_prob(y[idx]).sum()


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def hand_kinds(steps, looksam_k=1, rst_p=1.0):
    """The step kinds of LookSAM / RST, the RST choices from a Python Random seeded from torch's generator."""
    rng = random.Random(int(torch.randint(2**62, ()))) if rst_p < 1 else None
    if looksam_k > 1:
        return ["sam" if t % looksam_k == 0 else "reuse" for t in range(steps)]
    return ["sam" if rng is None or rng.random() < rst_p else "base" for _ in range(steps)]


def hand_likelihood_gradient(kind, x, y, idx, theta, state, alpha=0.7):
    """The gradient of the likelihood term in (w, b): SAM's, LookSAM's or the plain one, in plain torch."""
    leaves = [t.detach().requires_grad_() for t in theta]
    g = torch.autograd.grad(nll(x, y, idx, *leaves), leaves)
    if kind == "base":
        return list(g)
    if kind == "reuse":
        gv = state["gv"]
        scale = alpha * flat(g).norm() / (flat(gv).norm() + 1e-12)
        return [gi + scale * vi for gi, vi in zip(g, gv, strict=True)]
    gflat = flat(g)
    moved = [(t + RHO * gi / (gflat.norm() + 1e-12)).detach().requires_grad_() for t, gi in zip(theta, g, strict=True)]
    gs = torch.autograd.grad(nll(x, y, idx, *moved), moved)
    coefficient = (gflat @ flat(gs)) / (gflat @ gflat + 1e-12)
    state["gv"] = [si - coefficient * gi for gi, si in zip(g, gs, strict=True)]
    return list(gs)


def hand_map(steps, kinds):
    """MAP (AutoDelta) with SGD: the likelihood gradient above plus the N(0, 1) prior's."""
    x, y = regression_data()
    theta = [W0.clone(), B0.clone()]
    state = {}
    for kind in kinds:
        idx = torch.randperm(N_DATA)[:BATCH]
        grads = hand_likelihood_gradient(kind, x, y, idx, theta, state)
        theta = [t - LR * (gi + t) for t, gi in zip(theta, grads, strict=True)]
    return theta


def pyro_map(steps, seed, **options):
    """MAP with the SA-ELBO and SGD, from ``seed`` set after the guide's set-up (the hand loops have none)."""
    x, y = regression_data()
    pyro.clear_param_store()
    guide = AutoDelta(regression_model, init_loc_fn=init_to_value(values={"w": W0.clone(), "b": B0.clone()}))
    guide(x, y)
    pyro.set_rng_seed(seed)
    svi = SVI(regression_model, guide, pyro.optim.SGD({"lr": LR}), SharpnessAwareELBO(RHO, **options))
    for _ in range(steps):
        svi.step(x, y)
    median = guide.median()
    return [median["w"], median["b"]]


@pytest.mark.parametrize("options", [{"looksam_k": 3}, {"looksam_k": 2, "looksam_alpha": 1.5}, {"rst_p": 0.5},
                                     {"rst_p": 0.0}, {"looksam_k": 1}, {"rst_p": 1.0}])
def test_map_steps_equal_a_plain_torch_reimplementation(options):
    steps = 7
    ours = pyro_map(steps, 2, **options)
    pyro.set_rng_seed(2)
    kinds = hand_kinds(steps, options.get("looksam_k", 1), options.get("rst_p", 1.0))
    alpha = options.get("looksam_alpha", 0.7)
    x, y = regression_data()
    theta, state = [W0.clone(), B0.clone()], {}
    for kind in kinds:
        idx = torch.randperm(N_DATA)[:BATCH]
        grads = hand_likelihood_gradient(kind, x, y, idx, theta, state, alpha)
        theta = [t - LR * (gi + t) for t, gi in zip(theta, grads, strict=True)]
    if "rst_p" in options and 0 < options["rst_p"] < 1:
        assert {"sam", "base"} <= set(kinds)  # both kinds happen in these steps
    for a, b in zip(ours, theta, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_defaults_are_the_sam_objective_and_leave_the_random_stream_alone():
    default = pyro_map(4, 6)
    explicit = pyro_map(4, 6, looksam_k=1, rst_p=1.0)
    pyro.set_rng_seed(6)
    by_hand = hand_map(4, ["sam"] * 4)
    for a, b, c in zip(default, explicit, by_hand, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=1e-12, rtol=0)


@pytest.mark.parametrize("looksam_k", [2, 3])
def test_looksam_mean_field_steps_equal_a_plain_torch_reimplementation(looksam_k):
    # the LookSAM gradient reaches (loc, log scale) through the reparameterised sample, next to the prior and log q
    steps = 5
    x, y = regression_data()
    pyro.set_rng_seed(9)
    svi = SVI(regression_model, regression_guide, pyro.optim.SGD({"lr": LR}),
              SharpnessAwareELBO(RHO, looksam_k=looksam_k))
    for _ in range(steps):
        svi.step(x, y)
    ours = {name: pyro.param(name).detach() for name in ("w_loc", "w_scale", "b_loc", "b_scale")}
    pyro.set_rng_seed(9)
    locs = [W0.clone().requires_grad_(), B0.clone().requires_grad_()]
    logs = [torch.full_like(W0, 0.2).log().requires_grad_(), torch.tensor(0.2).log().requires_grad_()]
    state = {}
    for kind in hand_kinds(steps, looksam_k):
        theta = [torch.distributions.Normal(m, u.exp()).rsample() for m, u in zip(locs, logs, strict=True)]
        idx = torch.randperm(N_DATA)[:BATCH]
        lik_grads = hand_likelihood_gradient(kind, x, y, idx, theta, state)
        loss = sum((gi.detach() * t).sum() for gi, t in zip(lik_grads, theta, strict=True))
        loss = loss + sum(-torch.distributions.Normal(0.0, 1.0).log_prob(t).sum()
                          + torch.distributions.Normal(m, u.exp()).log_prob(t).sum()
                          for t, m, u in zip(theta, locs, logs, strict=True))
        grads = torch.autograd.grad(loss, locs + logs)
        with torch.no_grad():
            for p, gp in zip(locs + logs, grads, strict=True):
                p -= LR * gp
    expected = {"w_loc": locs[0], "b_loc": locs[1], "w_scale": logs[0].exp(), "b_scale": logs[1].exp()}
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value.detach(), atol=1e-12, rtol=0)


def test_one_kind_per_step_for_every_particle_and_loss_leaves_the_schedule_alone():
    x, y = regression_data()
    elbo = SharpnessAwareELBO(RHO, looksam_k=3, num_particles=2)
    kinds = []
    original = SharpnessAwareModel.step_kind

    def spy(self, kind):
        kinds.append(kind)
        return original(self, kind)

    guide = AutoDelta(regression_model)
    svi = SVI(regression_model, guide, pyro.optim.SGD({"lr": LR}), elbo)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SharpnessAwareModel, "step_kind", spy)
        for _ in range(4):
            svi.step(x, y)
            svi.evaluate_loss(x, y)
            elbo.loss(regression_model, guide, x, y)
    assert elbo.schedule.steps == 4  # two particles per step, and evaluations, advance it once per step
    assert kinds == ["sam", "sam", "sam", "reuse", "sam", "sam", "reuse", "sam", "sam", "sam", "sam", "sam"]


@pytest.mark.parametrize("options", [{"looksam_k": 3}, {"rst_p": 0.4}])
def test_resumed_training_equals_uninterrupted(options):
    x, y = regression_data()

    def train(steps, elbo, state=None):
        guide = AutoDelta(regression_model, init_loc_fn=init_to_value(values={"w": W0.clone(), "b": B0.clone()}))
        optim = pyro.optim.Adam({"lr": 0.05})
        svi = SVI(regression_model, guide, optim, elbo)
        if state is not None:
            guide(x, y)
            pyro.get_param_store().set_state(state["params"])
            optim.set_state(state["optim"])
            elbo.load_state_dict(state["elbo"])
            torch.set_rng_state(state["rng"])
        for _ in range(steps):
            svi.step(x, y)
        return {"params": pyro.get_param_store().get_state(), "optim": optim.get_state(),
                "elbo": copy.deepcopy(elbo.state_dict()), "rng": torch.get_rng_state()}

    pyro.set_rng_seed(1)
    straight = train(8, SharpnessAwareELBO(RHO, **options))["params"]["params"]
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    half = train(5, SharpnessAwareELBO(RHO, **options))
    pyro.clear_param_store()
    torch.manual_seed(123)  # a fresh process: another random state until the checkpoint is loaded
    resumed = train(3, SharpnessAwareELBO(RHO, **options, rst_seed=0 if "rst_p" in options else None), half)
    for name, value in straight.items():
        torch.testing.assert_close(resumed["params"]["params"][name], value, atol=1e-12, rtol=0)


def test_looksam_refuses_a_trainable_tensor_pyro_does_not_know_and_outer_conditions():
    x, y = regression_data()
    hidden = torch.tensor(0.3, requires_grad=True)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", len(x), subsample_size=BATCH) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w + hidden, 0.5), obs=y[idx])

    svi = SVI(model, AutoDelta(model), pyro.optim.SGD({"lr": LR}), SharpnessAwareELBO(RHO, looksam_k=2))
    with pytest.raises(ValueError, match="neither a latent value nor a Pyro parameter"):
        svi.step(x, y)

    def learned(x, y):  # the same tensor as a Pyro parameter: trained, with the plain gradient on reuse steps
        offset = pyro.param("offset", torch.tensor(0.3))
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", len(x), subsample_size=BATCH) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w + offset, 0.5), obs=y[idx])

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(learned)
    elbo = SharpnessAwareELBO(RHO, looksam_k=2)
    loss_and_param_grads(elbo, learned, guide, x, y)  # the refresh
    pyro.set_rng_seed(5)
    _, grads = loss_and_param_grads(elbo, learned, guide, x, y)  # a reuse step
    pyro.set_rng_seed(5)
    _, plain = loss_and_param_grads(Trace_ELBO(), learned, guide, x, y)
    torch.testing.assert_close(grads["offset"], plain["offset"], atol=1e-12, rtol=0)
    assert not torch.allclose(grads["AutoDelta.w"], plain["AutoDelta.w"])

    conditioned = pyro.condition(sharpness_aware(regression_model, RHO, looksam_k=2), data={"y": y})
    with pytest.raises(ValueError, match="conditioned outside the transformed model"):
        SVI(conditioned, AutoDelta(conditioned), pyro.optim.SGD({"lr": LR}), Trace_ELBO()).step(x, None)


@pytest.mark.parametrize("options, match", [
    ({"looksam_k": 0}, "`looksam_k` must be an int >= 1"),
    ({"looksam_k": 2.0}, "`looksam_k` must be an int >= 1"),
    ({"looksam_alpha": -0.1}, "`looksam_alpha` must be a finite number >= 0"),
    ({"rst_p": 1.5}, "`rst_p` must be a number in"),
    ({"looksam_k": 2, "rst_p": 0.5}, "use one of them"),
    ({"rst_p": 0.5, "distributed": True}, "not supported with distributed=True"),
])
def test_bad_cheaper_step_options(options, match):
    with pytest.raises(ValueError, match=match):
        SharpnessAwareELBO(RHO, **options)
