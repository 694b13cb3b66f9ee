"""pyro_flat.optim.SAM: the documented step on closed forms, m-sharpness, rho = 0, state round trips, Pyro use."""

import copy
import math
import random

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_flat.optim import SAM


def _quadratic(seed=0):
    """L = ½ θᵀAθ with θ split into two tensors (so the norm must be global)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=g))
    a = q @ torch.diag(torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0])) @ q.T
    theta = torch.randn(5, generator=g)
    params = [theta[:2].clone().requires_grad_(), theta[2:].clone().requires_grad_()]
    return a, theta, params


def _closure(a, params):
    def closure():
        t = torch.cat(params)
        loss = 0.5 * t @ a @ t
        loss.backward()
        return loss

    return closure


def test_one_step_is_the_documented_formula():
    # SAM's step in closed form: theta' = theta - lr A (theta + rho A theta / ||A theta||)
    a, theta, params = _quadratic()
    lr, rho = 0.1, 0.3
    opt = SAM(params, torch.optim.SGD, rho=rho, lr=lr)
    loss = opt.step(_closure(a, params))
    g = a @ theta
    expected = theta - lr * a @ (theta + rho * g / g.norm())
    torch.testing.assert_close(torch.cat(params).detach(), expected)
    torch.testing.assert_close(loss, 0.5 * theta @ a @ theta)  # the loss at the unperturbed point


def test_adaptive_step_is_the_asam_formula():
    a, theta, params = _quadratic(1)
    lr, rho = 0.05, 0.2
    SAM(params, torch.optim.SGD, rho=rho, adaptive=True, lr=lr).step(_closure(a, params))
    g = a @ theta
    eps = rho * theta.abs() ** 2 * g / (theta.abs() * g).norm()
    torch.testing.assert_close(torch.cat(params).detach(), theta - lr * a @ (theta + eps))


def test_rho_zero_is_the_base_optimizer():
    a, _, params = _quadratic(2)
    base_params = [p.detach().clone().requires_grad_() for p in params]
    sam = SAM(params, torch.optim.Adam, rho=0.0, lr=0.01, betas=(0.8, 0.99))
    adam = torch.optim.Adam(base_params, lr=0.01, betas=(0.8, 0.99))
    for _ in range(5):
        sam.step(_closure(a, params))
        adam.zero_grad()
        _closure(a, base_params)()
        adam.step()
    for p, q in zip(params, base_params, strict=True):
        torch.testing.assert_close(p, q)


def test_m_sharpness_averages_per_sub_batch_sam_gradients():
    # two sub-batch losses L_j = ½ θᵀA_jθ, each with its own perturbation; g = mean_j A_j(θ + ρ A_jθ/||A_jθ||)
    a1, theta, params = _quadratic(3)
    a2 = a1 @ a1 / 4 + torch.eye(5)
    lr, rho = 0.1, 0.25
    SAM(params, torch.optim.SGD, rho=rho, lr=lr).step([_closure(a1, params), _closure(a2, params)])
    grad = sum(aj @ (theta + rho * aj @ theta / (aj @ theta).norm()) for aj in (a1, a2)) / 2
    torch.testing.assert_close(torch.cat(params).detach(), theta - lr * grad)


def test_resumed_training_equals_uninterrupted():
    a, _, params = _quadratic(4)
    twin = [p.detach().clone().requires_grad_() for p in params]
    opt = SAM(params, torch.optim.Adam, rho=0.1, lr=0.05)
    for _ in range(6):
        opt.step(_closure(a, params))
    other = SAM(twin, torch.optim.Adam, rho=0.1, lr=0.05)
    for _ in range(3):
        other.step(_closure(a, twin))
    state = copy.deepcopy(other.state_dict())
    resumed_params = [p.detach().clone().requires_grad_() for p in twin]
    resumed = SAM(resumed_params, torch.optim.Adam, rho=0.1, lr=0.05)
    resumed.load_state_dict(state)
    assert resumed.base_optimizer.state[resumed_params[0]]["step"] == 3
    for _ in range(3):
        resumed.step(_closure(a, resumed_params))
    for p, q in zip(params, resumed_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_pyro_autodelta_closure_matches_manual_gradient():
    # MAP of a Bayesian linear regression through Pyro: the closure is Trace_ELBO / N on one fixed minibatch
    n, d = 20, 3
    x, w_true = torch.randn(n, d), torch.randn(d)
    y = x @ w_true + 0.1 * torch.randn(n)

    def model(x, y=None, num_data=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d), 1.0).to_event(1))
        with pyro.plate("data", num_data, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    guide = AutoDelta(model)
    guide(x[:1], y[:1], num_data=n)
    (w,) = list(guide.parameters())
    w0 = w.detach().clone()
    lr, rho = 0.05, 0.1
    opt = SAM(guide.parameters(), torch.optim.SGD, rho=rho, lr=lr)
    idx = torch.arange(8)
    elbo = Trace_ELBO()

    def closure():
        loss = elbo.differentiable_loss(model, guide, x[idx], y[idx], num_data=n) / n
        loss.backward()
        return loss

    opt.step(closure)

    def energy(v):  # -log p(y_B | w) N/B - log p(w), per datum
        ll = dist.Normal(x[idx] @ v, 0.5).log_prob(y[idx]).sum() * n / len(idx)
        return -(ll + dist.Normal(torch.zeros(d), 1.0).log_prob(v).sum()) / n

    g = torch.func.grad(energy)(w0)
    expected = w0 - lr * torch.func.grad(energy)(w0 + rho * g / g.norm())
    torch.testing.assert_close(w.detach(), expected)


@pytest.mark.parametrize("kwargs, match", [({"rho": -0.1}, "rho"), ({"rho": float("nan")}, "rho"),
                                           ({"adaptive": 1}, "adaptive")])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SAM([torch.zeros(2, requires_grad=True)], torch.optim.SGD, lr=0.1, **kwargs)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1, torch.tensor(float("nan"))], ids=repr)
@pytest.mark.parametrize("base", [torch.optim.SGD, torch.optim.Adam])
def test_a_learning_rate_that_is_not_a_finite_number_is_refused_like_rho(base, lr):
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"^SAM: `lr` must be a finite number >= 0, got "):
        SAM([p], base, lr=lr)
    with pytest.raises(ValueError, match=r"^SAM: `lr` must be a finite number >= 0, got "):
        SAM([{"params": [p], "lr": lr}], base, lr=0.1)
    opt = SAM([p], base, lr=0.1)
    with pytest.raises(ValueError, match=r"^SAM: `lr` must be a finite number >= 0, got "):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": lr})
    SAM([p], base, lr=torch.tensor(0.1))  # a tensor holding a good number is one, as torch's optimizers take it


def test_bad_closure_and_base():
    opt = SAM([torch.zeros(2, requires_grad=True)], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="closure"):
        opt.step()
    with pytest.raises(ValueError, match="closure"):
        opt.step([])
    with pytest.raises(ValueError, match="base_optimizer"):
        SAM([torch.zeros(2, requires_grad=True)], "sgd")


def test_sam_on_an_autodelta_equals_svi_on_the_sharpness_aware_model_when_the_prior_is_flat():
    # The harness's two SAMs: `sam_torch` (this optimizer on AutoDelta, closure = Trace_ELBO) ascends on the whole
    # loss, `sam` (SVI on sharpness_aware(model) with AutoDelta) on the likelihood only. With the prior masked out the
    # losses coincide, so k Adam steps of both must give the same point (only the summation order differs).
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoDelta
    from pyro.infer.autoguide.initialization import init_to_value

    from pyro_flat.transforms import sharpness_aware

    generator = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(20, 3, generator=generator), torch.tensor([1.0, -2.0, 0.5])
    y = x @ w_true + 0.1 * torch.randn(20, generator=generator)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1).mask(False))  # flat prior
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    def init():  # a fresh tensor per guide: AutoDelta trains the init_to_value tensor in place
        return init_to_value(values={"w": torch.zeros(3)})

    rho, lr, steps = 0.1, 0.05, 5
    pyro.clear_param_store()
    guide_svi = AutoDelta(model, init_loc_fn=init())
    svi = SVI(sharpness_aware(model, rho), guide_svi, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)
    via_svi = guide_svi.median()["w"].detach().clone()

    pyro.clear_param_store()
    guide = AutoDelta(model, init_loc_fn=init())
    guide(x, y)
    optimizer = SAM(guide.parameters(), torch.optim.Adam, rho=rho, lr=lr)
    elbo = Trace_ELBO()
    for _ in range(steps):
        optimizer.step(lambda: elbo.differentiable_loss(model, guide, x, y).backward())
    via_optimizer = guide.median()["w"].detach()
    torch.testing.assert_close(via_optimizer, via_svi, rtol=1e-10, atol=1e-12)
    assert (via_svi - torch.zeros(3)).abs().min() > 0.1  # both moved: the comparison is not vacuous


# ------------------------------------------------------- LookSAM, ESAM, RST against plain-torch re-implementations
# Per-example losses l_i = log cosh(x_i . theta - y_i) (non-quadratic, so g_s is not linear in eps), theta split into
# two tensors (the norms must be global); each method's step written again in plain torch from its paper.


def _regression(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=g), torch.randn(n, generator=g)
    theta = torch.randn(5, generator=g)
    return x, y, [theta[:2].clone().requires_grad_(), theta[2:].clone().requires_grad_()]


def _per_example(x, y, theta):
    return torch.log(torch.cosh(x @ theta - y))


def _mean_closure(x, y, params):
    def closure():
        loss = _per_example(x, y, torch.cat(params)).mean()
        loss.backward()
        return loss

    return closure


def _subset_closure(x, y, params):
    def closure(subset):
        xs, ys = (x, y) if subset is None else (x[subset], y[subset])
        return _per_example(xs, ys, torch.cat(params))

    return closure


def _mean_grad(x, y, theta):
    theta = theta.detach().requires_grad_()
    return torch.autograd.grad(_per_example(x, y, theta).mean(), theta)[0]


def _hand_sam_grad(x, y, theta, rho, gamma=1.0):
    """SAM's gradient; with gamma < 1 on ESAM's selection: the floor(gamma n) largest loss increases."""
    g = _mean_grad(x, y, theta)
    moved = theta + rho * g / (g.norm() + 1e-12)
    if gamma == 1:
        return g, _mean_grad(x, y, moved)
    increase = _per_example(x, y, moved) - _per_example(x, y, theta)
    keep = torch.topk(increase, max(1, math.floor(gamma * len(x) + 1e-9))).indices
    return g, _mean_grad(x[keep], y[keep], moved)


@pytest.mark.parametrize("options", [{"looksam_k": 3}, {"looksam_k": 2, "looksam_alpha": 2.0}, {"rst_p": 0.5},
                                     {"esam_gamma": 0.5}, {"esam_gamma": 0.3, "looksam_k": 2}, {"rst_p": 0.0}])
def test_steps_equal_a_plain_torch_reimplementation(options):
    x, y, params = _regression(4)
    lr, rho, steps = 0.1, 0.2, 7
    gamma, k = options.get("esam_gamma", 1.0), options.get("looksam_k", 1)
    alpha, p = options.get("looksam_alpha", 0.7), options.get("rst_p", 1.0)
    theta = torch.cat(params).detach()
    torch.manual_seed(8)
    opt = SAM(params, torch.optim.SGD, rho=rho, lr=lr, **options)
    closure = _subset_closure(x, y, params) if gamma < 1 else _mean_closure(x, y, params)
    for _ in range(steps):
        opt.step(closure)
    torch.manual_seed(8)
    rng = random.Random(int(torch.randint(2**62, ()))) if p < 1 else None
    kinds = []
    for t in range(steps):
        if k > 1:
            kind = "sam" if t % k == 0 else "reuse"
        else:
            kind = "sam" if rng is None or rng.random() < p else "base"
        kinds.append(kind)
        if kind == "sam":
            g, gs = _hand_sam_grad(x, y, theta, rho, gamma)
            gv = gs - (g @ gs) / (g @ g + 1e-12) * g
            step = gs
        elif kind == "reuse":
            g = _mean_grad(x, y, theta)
            step = g + alpha * g.norm() / (gv.norm() + 1e-12) * gv
        else:
            step = _mean_grad(x, y, theta)
        theta = theta - lr * step
    if 0 < p < 1:
        assert {"sam", "base"} <= set(kinds)
    torch.testing.assert_close(torch.cat(params).detach(), theta, atol=1e-12, rtol=0)


def test_looksam_with_m_sharpness_decomposes_the_sub_batch_means():
    x, y, params = _regression(5, n=12)
    halves = [(x[:6], y[:6]), (x[6:], y[6:])]
    theta = torch.cat(params).detach()
    lr, rho = 0.1, 0.15
    opt = SAM(params, torch.optim.SGD, rho=rho, lr=lr, looksam_k=2)
    for _ in range(4):
        opt.step([_mean_closure(xs, ys, params) for xs, ys in halves])
    for t in range(4):
        pairs = [_hand_sam_grad(xs, ys, theta, rho) for xs, ys in halves]
        g = sum(a for a, _ in pairs) / 2
        if t % 2 == 0:
            gs = sum(b for _, b in pairs) / 2
            gv = gs - (g @ gs) / (g @ g + 1e-12) * g
            step = gs
        else:
            step = g + 0.7 * g.norm() / (gv.norm() + 1e-12) * gv
        theta = theta - lr * step
    torch.testing.assert_close(torch.cat(params).detach(), theta, atol=1e-12, rtol=0)


@pytest.mark.parametrize("options", [{"looksam_k": 3}, {"rst_p": 0.5}, {"esam_gamma": 0.5}])
def test_resumed_cheaper_steps_equal_uninterrupted(options):
    x, y, init = _regression(6)

    def closure(params):
        return _subset_closure(x, y, params) if "esam_gamma" in options else _mean_closure(x, y, params)

    torch.manual_seed(2)
    full = [t.detach().clone().requires_grad_() for t in init]
    opt = SAM(full, torch.optim.Adam, rho=0.1, lr=0.05, **options)
    for _ in range(7):
        opt.step(closure(full))
    torch.manual_seed(2)
    half = [t.detach().clone().requires_grad_() for t in init]
    opt = SAM(half, torch.optim.Adam, rho=0.1, lr=0.05, **options)
    for _ in range(4):
        opt.step(closure(half))
    saved = copy.deepcopy({"opt": opt.state_dict(), "params": [p.detach() for p in half]})
    torch.manual_seed(99)  # another process: another seed for RST's generator until the state is loaded
    resumed = [t.clone().requires_grad_() for t in saved["params"]]
    opt = SAM(resumed, torch.optim.Adam, rho=0.1, lr=0.05, **options)
    opt.load_state_dict(saved["opt"])
    for _ in range(3):
        opt.step(closure(resumed))
    for p, q in zip(full, resumed, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_defaults_draw_nothing_and_esam_refuses_a_mean_closure():
    x, y, params = _regression(7)
    state = torch.get_rng_state()
    SAM(params, torch.optim.SGD, lr=0.1)
    assert torch.equal(torch.get_rng_state(), state)  # no RST seed drawn: the random stream is the defaults'
    opt = SAM(params, torch.optim.SGD, lr=0.1, esam_gamma=0.5)
    with pytest.raises(ValueError, match="returns one loss per example"):
        opt.step(lambda subset: _per_example(x, y, torch.cat(params)).mean())
    with pytest.raises(ValueError, match="`esam_gamma` must be a number in"):
        SAM(params, torch.optim.SGD, lr=0.1, esam_gamma=0.0)
    with pytest.raises(ValueError, match="use one of them"):
        SAM(params, torch.optim.SGD, lr=0.1, looksam_k=5, rst_p=0.5)
