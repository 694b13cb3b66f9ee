"""pyro_flat.optim.BayesianSAM: the documented step with fixed noise, rho = 0, fixed points on quadratics
(derived in pyro_flat.ops.bayesian_sam), the Pyro-facing form, posterior samples, state round trips, validation."""

import copy
import math
import random

import pytest
import torch
from pyro.infer.autoguide import AutoDelta

from pyro_flat.data import BayesianLinearRegression
from pyro_flat.metrics import model_loss_fn
from pyro_flat.optim import BayesianSAM


def _smooth_loss(params, weights):
    """A non-quadratic loss of two tensors, so gradients at the noisy and perturbed points differ."""
    a, b = params
    return (weights * torch.log1p((a - 0.3) ** 2)).sum() + torch.cosh(b).sum()


def _closure(params, weights):
    def closure():
        loss = _smooth_loss(params, weights)
        loss.backward()
        return loss

    return closure


def _grad(point, weights):
    point = [p.detach().clone().requires_grad_() for p in point]
    return list(torch.autograd.grad(_smooth_loss(point, weights), point))


@pytest.mark.parametrize("num_closures", [1, 2])
@pytest.mark.parametrize("rho", [0.0, 0.07])
def test_two_steps_with_fixed_noise_are_the_documented_formula(num_closures, rho):
    torch.manual_seed(0)
    params = [torch.randn(2, 3).requires_grad_(), torch.randn(4).requires_grad_()]
    m = [p.detach().clone() for p in params]
    weights = [torch.rand(2, 3) + 0.5 * j for j in range(num_closures)]
    hyper = dict(lr=0.3, num_data=40, rho=rho, prior_precision=2.0, damping=0.1, beta1=0.8, beta2=0.9,
                 init_scale=0.7)
    gen = torch.Generator().manual_seed(5)
    ref_gen = torch.Generator().manual_seed(5)
    opt = BayesianSAM(params, generator=gen, **hyper)
    n, delta = hyper["num_data"], hyper["prior_precision"] / hyper["num_data"]
    gm = [torch.zeros_like(t) for t in m]
    s = [torch.full_like(t, hyper["init_scale"]) for t in m]
    for _ in range(2):
        loss = opt.step([_closure(params, w) for w in weights])
        # the reference, written from the docstring
        g_eps = [torch.zeros_like(t) for t in m]
        g_s = [torch.zeros_like(t) for t in m]
        losses = []
        for w in weights:
            e = [torch.randn(t.shape, generator=ref_gen) for t in m]
            theta = [mi + ei / torch.sqrt(n * si) for mi, ei, si in zip(m, e, s, strict=True)]
            losses.append(_smooth_loss(theta, w))
            g = _grad(theta, w)
            g_pert = _grad([mi + hyper["rho"] * gi / si for mi, gi, si in zip(m, g, s, strict=True)], w)
            for i in range(2):
                g_eps[i] += g_pert[i] / num_closures
                g_s[i] += torch.sqrt(s[i] * g[i] ** 2) / num_closures
        b1, b2, lr, damping = hyper["beta1"], hyper["beta2"], hyper["lr"], hyper["damping"]
        gm = [b1 * a + (1 - b1) * (ge + delta * mi) for a, ge, mi in zip(gm, g_eps, m, strict=True)]
        m = [mi - lr * a / si for mi, a, si in zip(m, gm, s, strict=True)]
        s = [b2 * si + (1 - b2) * (c + damping + delta) for si, c in zip(s, g_s, strict=True)]
        for p, mi in zip(params, m, strict=True):
            torch.testing.assert_close(p.detach(), mi)
        for p, a, si in zip(params, gm, s, strict=True):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], a)
            torch.testing.assert_close(opt.state[p]["s"], si)
        torch.testing.assert_close(loss, torch.stack(losses).mean())  # the mean loss at the noisy samples
    assert all(int(opt.state[p]["step"]) == 2 for p in params)


def test_rho_zero_takes_the_mean_gradient_at_the_mean():
    # with rho = 0 the documented variant: g_eps = grad at m itself, the curvature at the noisy sample
    torch.manual_seed(1)
    params = [torch.randn(2, 3).requires_grad_(), torch.randn(4).requires_grad_()]
    m0 = [p.detach().clone() for p in params]
    w = torch.rand(2, 3) + 0.5
    opt = BayesianSAM(params, lr=0.1, num_data=10, rho=0.0, prior_precision=0.0, damping=0.1,
                      generator=torch.Generator().manual_seed(3))
    opt.step(_closure(params, w))
    e = [torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) for t in m0[:1]]
    g_mean = _grad(m0, w)
    for p, mi, gi in zip(params, m0, g_mean, strict=True):
        torch.testing.assert_close(p.detach(), mi - 0.1 * 0.1 * gi / 1.0)  # lr (1 - beta1) g / s_init
    # the curvature used the gradient at the noisy sample m + e / sqrt(N s), not at m
    e_full = []
    gen = torch.Generator().manual_seed(3)
    for t in m0:
        e_full.append(torch.randn(t.shape, generator=gen))
    torch.testing.assert_close(e_full[0], e[0])
    g_noisy = _grad([mi + ei / math.sqrt(10) for mi, ei in zip(m0, e_full, strict=True)], w)
    s_expected = 0.999 * 1.0 + 0.001 * (g_noisy[0].abs() + 0.1)
    torch.testing.assert_close(opt.state[params[0]]["s"], s_expected)


def _quadratic_run(rho, delta_prior, steps, *, seed, lr=0.05, beta2=0.99, num_data=50, per_block=300, start=None):
    """bSAM on mean loss ½ Σ h_i (θ_i - a_i)², blocks of coordinates with h = 0.5, 2, 8, from θ = 0 or from
    a + start * noise."""
    g = torch.Generator().manual_seed(seed)
    h = torch.tensor([0.5, 2.0, 8.0]).repeat_interleave(per_block)
    a = torch.randn(len(h), generator=g)
    init = torch.zeros(len(h)) if start is None else a + start * torch.randn(len(h), generator=g)
    theta = init.clone().requires_grad_()
    opt = BayesianSAM([theta], lr=lr, num_data=num_data, rho=rho, prior_precision=delta_prior, damping=0.1,
                      beta2=beta2, generator=g)

    def closure():
        loss = 0.5 * (h * (theta - a) ** 2).sum()
        loss.backward()
        return loss

    trace_m, trace_s = [], []
    for _ in range(steps):
        opt.step(closure)
        trace_m.append(theta.detach().clone())
        trace_s.append(opt.state[theta]["s"].clone())
    return h, a, torch.stack(trace_m), torch.stack(trace_s)


def test_mean_converges_to_the_map_with_a_prior():
    # rho = 0: g_eps = h(m - a) exactly, so the fixed point h(m - a) + delta m = 0, m* = h a / (h + delta), is the
    # MAP of the mean loss plus (delta/2)||m||², whatever the noise does to s
    n, prior = 50, 5.0
    h, a, ms, _ = _quadratic_run(0.0, prior, 1500, seed=0, num_data=n)
    delta = prior / n
    torch.testing.assert_close(ms[-1], h * a / (h + delta), rtol=1e-8, atol=1e-8)


@pytest.mark.statistical
def test_precision_fixed_point_on_a_quadratic():
    # Derived (pyro_flat.ops.bayesian_sam): with delta = 0 and rho = 0 the mean reaches a exactly and
    # sqrt(s)|g| = h|e|/sqrt(N) is iid, so s is an AR(1) with E[s] = h sqrt(2/(pi N)) + damping and the time
    # average over T steps of P independent coordinates has standard error h sqrt((1 - 2/pi) / (N T P)).
    # 300 coordinates per h, T = 2000 steps after 1500 of burn-in (0.99^1500 ~ 3e-7 of transient), seed 1, k = 4.5.
    n, burn, steps = 50, 1500, 3500
    h, a, ms, ss = _quadratic_run(0.0, 0.0, steps, seed=1, num_data=n)
    torch.testing.assert_close(ms[-1], a, rtol=0, atol=1e-10)
    tail = ss[burn:]
    for value in (0.5, 2.0, 8.0):
        block = h == value
        expected = value * math.sqrt(2 / (math.pi * n)) + 0.1
        se = value * math.sqrt((1 - 2 / math.pi) / (n * tail.shape[0] * int(block.sum())))
        z = (tail[:, block].mean() - expected) / se
        assert abs(z) < 4.5, (value, float(tail[:, block].mean()), expected, float(z))
        # the sample variance 1/(N s) is therefore 1/(N (h sqrt(2/(pi N)) + damping)), not the Laplace 1/(N h)


@pytest.mark.statistical
def test_mean_is_unbiased_for_the_map_with_rho():
    # rho > 0, delta = 0: the recursion is symmetric under (e, m - a) -> (-e, -(m - a)), so at stationarity
    # E[m] = a (the MAP). Per-coordinate time averages over 2000 steps are independent across the 900 coordinates;
    # z-test of their mean against 0 with the across-coordinate standard error, seed 2, k = 4.5. The run starts
    # near a: far from it |g| is large, s grows like g² and the mean moves slowly (s ~ sqrt(s)|g|).
    h, a, ms, _ = _quadratic_run(0.05, 0.0, 3000, seed=2, lr=0.01, start=0.1)
    per_coord = (ms[1000:] - a).mean(0)
    z = per_coord.mean() / (per_coord.std() / math.sqrt(len(per_coord)))
    assert abs(z) < 4.5
    # and the mean is close to a on the scale of the posterior standard deviation 1/sqrt(N s) (s >= 0.1)
    assert per_coord.abs().max() < 0.1 / math.sqrt(50 * 0.1)


def test_pyro_autodelta_form_reaches_the_blr_posterior_mean():
    # The Pyro-facing form: bSAM on AutoDelta's parameters, closure = mean NLL (model_loss_fn) at guide(), prior
    # through prior_precision = alpha. With rho = 0 the fixed point solves (beta XᵀX + alpha) m = beta Xᵀy exactly.
    blr = BayesianLinearRegression.generate(40, 3, alpha=2.0, beta=25.0, seed=0)
    guide = AutoDelta(blr.model)
    guide(blr.x, blr.y)
    opt = BayesianSAM(guide.parameters(), lr=0.02, num_data=blr.num_data, rho=0.0, prior_precision=blr.alpha,
                      generator=torch.Generator().manual_seed(0))
    nll = model_loss_fn(blr.model, blr.x, blr.y)

    def closure():
        loss = nll(guide())
        loss.backward()
        return loss

    for _ in range(800):  # measured: within 2e-12 of the fixed point after 500 steps, 1e-16 after 750
        opt.step(closure)
    torch.testing.assert_close(guide.median()["w"], blr.posterior_mean, rtol=1e-6, atol=1e-6)
    # posterior draws for a BMA: m + z / sqrt(N s), the guide restored afterwards
    (m,) = [p.detach().clone() for p in guide.parameters()]
    (std,) = opt.posterior_std()
    draw = opt.sampled_draw(guide.median, generator=torch.Generator().manual_seed(9))
    z = torch.randn(3, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(draw["w"], m + z * std)
    torch.testing.assert_close(std, 1 / torch.sqrt(blr.num_data * opt.state[next(iter(guide.parameters()))]["s"]))
    torch.testing.assert_close(guide.median()["w"], m)


def test_autodelta_closure_on_a_constrained_latent_is_the_documented_step():
    # issue 20 item 7: the replayed closure got the first call's constrained AutoDelta value ("Trying to backward
    # through the graph a second time"). One step on the unconstrained parameters, written from the docstring
    import pyro
    import pyro.distributions as dist
    from torch.distributions import transform_to

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        s = pyro.sample("s", dist.HalfNormal(1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(w * x, s), obs=y)

    x = torch.linspace(-1.0, 1.0, 20)
    y = 0.5 * x + 0.3 * torch.randn(20, generator=torch.Generator().manual_seed(0))
    guide = AutoDelta(model)
    guide(x, y)
    params = [guide.w_unconstrained, guide.s_unconstrained]
    nll = model_loss_fn(model, x, y)
    hyper = dict(lr=0.1, num_data=20, rho=0.05, prior_precision=1.0)
    opt = BayesianSAM(params, generator=torch.Generator().manual_seed(2), **hyper)

    def closure():
        loss = nll(guide())
        loss.backward()
        return loss

    def loss_at(u):
        return nll({"w": u[0], "s": transform_to(dist.constraints.positive)(u[1])})

    def grad_at(u):
        u = [t.detach().clone().requires_grad_() for t in u]
        return torch.autograd.grad(loss_at(u), u)

    m = [p.detach().clone() for p in params]
    opt.step(closure)
    gen = torch.Generator().manual_seed(2)
    e = [torch.randn(t.shape, generator=gen) for t in m]
    g = grad_at([mi + ei / math.sqrt(hyper["num_data"]) for mi, ei in zip(m, e, strict=True)])  # s starts at 1
    g_eps = grad_at([mi + hyper["rho"] * gi for mi, gi in zip(m, g, strict=True)])
    delta = hyper["prior_precision"] / hyper["num_data"]
    for p, mi, gi in zip(params, m, g_eps, strict=True):
        torch.testing.assert_close(p.detach(), mi - hyper["lr"] * 0.1 * (gi + delta * mi))  # (1 - beta1) g_m / s


def test_sampled_params_context_restores_the_mean():
    p = torch.randn(5, requires_grad=True)
    opt = BayesianSAM([p], num_data=10, init_scale=0.5)
    m = p.detach().clone()
    with opt.sampled_params(torch.Generator().manual_seed(1)) as (sample,):
        torch.testing.assert_close(p.detach(), sample)
        assert not torch.equal(sample, m)
    torch.testing.assert_close(p.detach(), m)
    z = torch.randn(5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sample, m + z / math.sqrt(10 * 0.5))


def test_plain_torch_network_learns():
    torch.manual_seed(0)
    x = torch.randn(200, 2)
    y = (x[:, 0] + x[:, 1] > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = BayesianSAM(net.parameters(), lr=0.1, num_data=200, rho=0.05, prior_precision=1.0,
                      generator=torch.Generator().manual_seed(0))

    def closure():
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    first = float(opt.step(closure))
    for _ in range(300):
        last = float(opt.step(closure))
    assert last < 0.3 * first
    assert [s.shape for s in opt.posterior_std()] == [p.shape for p in net.parameters()]


def test_resumed_training_equals_uninterrupted():
    w = torch.rand(2, 3) + 0.5

    def run(params, opt, k):
        for _ in range(k):
            opt.step(_closure(params, w))

    torch.manual_seed(0)
    init = [torch.randn(2, 3), torch.randn(4)]
    full = [t.clone().requires_grad_() for t in init]
    run(full, BayesianSAM(full, lr=0.2, num_data=30, generator=torch.Generator().manual_seed(4)), 6)

    half = [t.clone().requires_grad_() for t in init]
    gen = torch.Generator().manual_seed(4)
    opt = BayesianSAM(half, lr=0.2, num_data=30, generator=gen)
    run(half, opt, 3)
    saved = copy.deepcopy({"opt": opt.state_dict(), "params": [p.detach() for p in half], "rng": gen.get_state()})

    resumed = [t.clone().requires_grad_() for t in saved["params"]]
    gen2 = torch.Generator()
    gen2.set_state(saved["rng"])
    opt2 = BayesianSAM(resumed, lr=0.2, num_data=30, generator=gen2)
    opt2.load_state_dict(saved["opt"])
    run(resumed, opt2, 3)
    for p, q in zip(full, resumed, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rho": -0.01}, "rho"),
        ({"prior_precision": -1.0}, "prior_precision"),
        ({"damping": -0.1}, "damping"),
        ({"num_data": 0}, "num_data"),
        ({"num_data": -5}, "num_data"),
        ({"lr": 0.0}, "lr"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"rho": float("inf")}, "rho"),
        ({"lr": float("nan")}, "lr"),
        ({"lr": torch.tensor(float("inf"))}, "lr"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = {"num_data": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        BayesianSAM([torch.zeros(2, requires_grad=True)], **args)


def test_numbers_given_as_tensors_are_kept_as_the_numbers_they_hold():
    opt = BayesianSAM([torch.zeros(2, requires_grad=True)], lr=torch.tensor(0.1), num_data=torch.tensor(10))
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]["num_data"]) is float


def test_bad_param_group_and_closure():
    opt = BayesianSAM([torch.zeros(2, requires_grad=True)], num_data=10)
    with pytest.raises(ValueError, match="damping"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "damping": -1.0})
    with pytest.raises(ValueError, match="closure"):
        opt.step()


def test_guide_is_the_posterior_gaussian_of_the_optimizer_and_predicts_in_the_support():
    # bSAM on an AutoDelta's unconstrained parameters: the guide is N(m, 1/(N s)) per site, mapped to the supports
    import pyro
    import pyro.distributions as dist
    from pyro.infer import Predictive

    def model(y=None):
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", 8):
            pyro.sample("y", dist.Normal(w.sum(), s), obs=y)

    y = torch.linspace(-1.0, 1.0, 8)
    delta = AutoDelta(model)
    delta(y)
    opt = BayesianSAM(delta.parameters(), lr=0.1, num_data=8, rho=0.01)

    def closure():
        loss = -pyro.poutine.trace(pyro.poutine.replay(model, trace=pyro.poutine.trace(delta).get_trace(y))) \
            .get_trace(y).nodes["y"]["fn"].log_prob(y).mean()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    guide = opt.guide(model, delta)
    posterior = guide.get_posterior(y)
    m = torch.cat([delta.s_unconstrained.detach().reshape(1), delta.w_unconstrained.detach()])
    params = [delta.s_unconstrained, delta.w_unconstrained]
    std = dict(zip([id(p) for p in opt.param_groups[0]["params"]], opt.posterior_std(), strict=True))
    variance = torch.cat([std[id(p)].square().reshape(-1) for p in params])
    torch.testing.assert_close(posterior.mean, m)
    torch.testing.assert_close(posterior.variance, variance)
    draws = Predictive(model, guide=guide, num_samples=50)(y)
    assert (draws["s"] > 0).all() and draws["w"].shape[0] == 50 and draws["w"].shape[-1] == 2  # Pyro adds a plate dim
    with pytest.raises(ValueError, match="AutoDelta that has run once"):
        opt.guide(model, AutoDelta(model))


# ------------------------------------------------------- LookSAM, ESAM, RST against a plain-torch re-implementation


def _per_example(x, y, theta):
    return torch.log(torch.cosh(x @ theta - y))


@pytest.mark.parametrize("options", [{"looksam_k": 2}, {"looksam_k": 3, "looksam_alpha": 1.2}, {"rst_p": 0.5},
                                     {"esam_gamma": 0.5}])
def test_cheaper_steps_equal_a_plain_torch_reimplementation(options):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 5, generator=g), torch.randn(10, generator=g)
    init = torch.randn(5, generator=g)
    params = [init[:2].clone().requires_grad_(), init[2:].clone().requires_grad_()]
    hyper = dict(lr=0.3, num_data=40, rho=0.05, prior_precision=2.0, damping=0.1, beta1=0.8, beta2=0.9)
    gamma, k = options.get("esam_gamma", 1.0), options.get("looksam_k", 1)
    alpha, p = options.get("looksam_alpha", 0.7), options.get("rst_p", 1.0)
    steps = 6
    torch.manual_seed(4)
    opt = BayesianSAM(params, generator=torch.Generator().manual_seed(5), **hyper, **options)
    for _ in range(steps):
        if gamma < 1:
            opt.step(lambda subset: _per_example(x if subset is None else x[subset],
                                                 y if subset is None else y[subset], torch.cat(params)))
        else:
            def closure():
                loss = _per_example(x, y, torch.cat(params)).mean()
                loss.backward()
                return loss

            opt.step(closure)
    torch.manual_seed(4)
    rng = random.Random(int(torch.randint(2**62, ()))) if p < 1 else None
    noise_gen = torch.Generator().manual_seed(5)
    n, delta = hyper["num_data"], hyper["prior_precision"] / hyper["num_data"]
    m, gm, s = init.clone(), torch.zeros(5), torch.ones(5)

    def grad(point, rows=slice(None)):
        point = point.detach().requires_grad_()
        return torch.autograd.grad(_per_example(x[rows], y[rows], point).mean(), point)[0]

    kinds = []
    for t in range(steps):
        kind = ("sam" if t % k == 0 else "reuse") if k > 1 else ("sam" if rng is None or rng.random() < p else "base")
        kinds.append(kind)
        e = torch.cat([torch.randn(2, generator=noise_gen), torch.randn(3, generator=noise_gen)])
        theta = m + e / torch.sqrt(n * s)
        g_noisy = grad(theta)
        if kind == "sam":
            perturbed = m + hyper["rho"] * g_noisy / s
            rows = slice(None)
            if gamma < 1:
                increase = _per_example(x, y, perturbed) - _per_example(x, y, theta)
                rows = torch.topk(increase, math.floor(gamma * len(x))).indices
            g_eps = grad(perturbed, rows)
            gv = g_eps - (g_noisy @ g_eps) / (g_noisy @ g_noisy + 1e-12) * g_noisy
        elif kind == "reuse":
            g_eps = g_noisy + alpha * g_noisy.norm() / (gv.norm() + 1e-12) * gv
        else:
            g_eps = g_noisy
        gm = hyper["beta1"] * gm + (1 - hyper["beta1"]) * (g_eps + delta * m)
        m = m - hyper["lr"] * gm / s
        s = hyper["beta2"] * s + (1 - hyper["beta2"]) * (torch.sqrt(s) * g_noisy.abs() + hyper["damping"] + delta)
    if 0 < p < 1:
        assert {"sam", "base"} <= set(kinds)
    torch.testing.assert_close(torch.cat(params).detach(), m, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat([opt.state[q]["s"] for q in params]), s, atol=1e-12, rtol=0)


@pytest.mark.parametrize("options", [{"looksam_k": 3}, {"rst_p": 0.5}])
def test_resumed_cheaper_steps_equal_uninterrupted(options):
    w = torch.rand(2, 3) + 0.5

    def run(params, opt, k):
        for _ in range(k):
            opt.step(_closure(params, w))

    torch.manual_seed(0)
    init = [torch.randn(2, 3), torch.randn(4)]
    full = [t.clone().requires_grad_() for t in init]
    torch.manual_seed(1)
    run(full, BayesianSAM(full, lr=0.2, num_data=30, generator=torch.Generator().manual_seed(4), **options), 7)
    torch.manual_seed(1)
    half = [t.clone().requires_grad_() for t in init]
    gen = torch.Generator().manual_seed(4)
    opt = BayesianSAM(half, lr=0.2, num_data=30, generator=gen, **options)
    run(half, opt, 4)
    saved = copy.deepcopy({"opt": opt.state_dict(), "params": [p.detach() for p in half], "rng": gen.get_state()})
    torch.manual_seed(77)
    resumed = [t.clone().requires_grad_() for t in saved["params"]]
    gen2 = torch.Generator()
    gen2.set_state(saved["rng"])
    opt2 = BayesianSAM(resumed, lr=0.2, num_data=30, generator=gen2, **options)
    opt2.load_state_dict(saved["opt"])
    run(resumed, opt2, 3)
    for p, q in zip(full, resumed, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
