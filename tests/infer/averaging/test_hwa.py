"""HWA: the cyclical schedule, mean/variance of the snapshots of the guide means, the three variance rules, the
averaged guide under Predictive, state round trips, validation."""

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoNormal

from pyro_flat.infer.averaging import HWA, CyclicalLR, cyclical_lr, cyclical_lr_scheduler, guide_loc_scale
from pyro_flat.infer.averaging.hwa import VARIANCE_RULES


def _model(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(x @ w + b, 0.5), obs=y)


def _data(n=30):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 + 0.5 * torch.randn(n, generator=g)


def test_cyclical_rate_is_swa_schedule():
    c, high, low = 4, 1e-2, 1e-4
    # t = (mod(k - 1, c) + 1) / c: the cycle ends (rate = low) at k = 0, c, 2c, ...
    assert cyclical_lr(0, c, high, low) == pytest.approx(low)
    assert cyclical_lr(1, c, high, low) == pytest.approx(0.75 * high + 0.25 * low)
    assert cyclical_lr(3, c, high, low) == pytest.approx(0.25 * high + 0.75 * low)
    assert cyclical_lr(4, c, high, low) == pytest.approx(low)
    assert cyclical_lr(5, c, high, low) == pytest.approx(cyclical_lr(1, c, high, low))
    assert CyclicalLR(c, low / high)(2) == pytest.approx(cyclical_lr(2, c, high, low) / high)


def test_pyro_scheduler_follows_the_schedule_and_hwa_collects_at_cycle_ends():
    x, y = _data()
    guide = AutoNormal(_model)
    svi = SVI(_model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(20):
        svi.step(x, y)
    scheduler = cyclical_lr_scheduler(torch.optim.SGD, {"lr": 0.01}, cycle_length=3, lr_low=0.001)
    svi = SVI(_model, guide, scheduler, Trace_ELBO())
    hwa = HWA(guide)
    callback = hwa.callback(3, scheduler=scheduler)
    rates, snapshots = [], []
    for k in range(10):
        svi.step(x, y)
        rates.append(next(iter(scheduler.optim_objs.values())).optimizer.param_groups[0]["lr"])
        before = hwa.num_collected
        callback(k)
        if hwa.num_collected > before:
            snapshots.append(k)
    assert rates == pytest.approx([cyclical_lr(k, 3, 0.01, 0.001) for k in range(10)])
    assert snapshots == [0, 3, 6, 9]  # mod(k, c) == 0, right after the lowest-rate step


def _hwa_run(guide_class, steps=40, cycle=5, seed=0):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    x, y = _data()
    guide = guide_class(_model)
    svi = SVI(_model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    svi.step(x, y)
    hwa = HWA(guide, max_rank=4)
    snapshots = []
    callback = hwa.callback(cycle)
    for k in range(steps):
        svi.step(x, y)
        callback(k)
        if k % cycle == 0:
            snapshots.append(guide_loc_scale(guide))
    return x, guide, hwa, snapshots


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_mean_and_variances_are_those_of_the_snapshots(guide_class):
    _, _, hwa, snapshots = _hwa_run(guide_class)
    assert hwa.num_collected == len(snapshots) == 8
    for site in ("w", "b"):
        mus = torch.stack([loc[site] for loc, _ in snapshots])
        sigmas = torch.stack([scale[site] for _, scale in snapshots])
        torch.testing.assert_close(hwa.mean()[site], mus.mean(0))
        spread = mus.var(0, unbiased=False)
        torch.testing.assert_close(hwa.variance("means")[site], spread)  # the draft: m2 - mean²
        torch.testing.assert_close(hwa.variance("total")[site], spread + sigmas.square().mean(0))
        torch.testing.assert_close(hwa.variance("scales")[site], sigmas.mean(0).square())
    assert int(hwa.num_clamped()) == 0


@pytest.mark.parametrize("rule", VARIANCE_RULES)
def test_averaged_guide_has_the_rule_s_moments_and_works_with_predictive(rule):
    x, _, hwa, _ = _hwa_run(AutoNormal)
    guide = hwa.averaged_guide(_model, variance=rule)
    samples = Predictive(_model, guide=guide, num_samples=5)(x)
    assert samples["w"].reshape(5, 3).shape == (5, 3) and samples["obs"].shape == (5, len(x))
    posterior = guide.get_posterior()
    torch.testing.assert_close(posterior.loc, torch.cat([hwa.mean()["w"], hwa.mean()["b"].reshape(1)]))
    variance = hwa.variance(rule)
    torch.testing.assert_close(posterior.variance, torch.cat([variance["w"], variance["b"].reshape(1)]))
    torch.testing.assert_close(guide.median()["w"], hwa.mean()["w"])


def test_low_rank_option_of_the_mean_iterates():
    x, _, hwa, _ = _hwa_run(AutoNormal)
    guide = hwa.averaged_guide(_model, variance="means", diagonal_only=False)
    guide(x)
    assert guide.get_posterior().cov_factor.shape == (4, 4)  # P = 4 coordinates, K = 4 columns
    with pytest.raises(ValueError, match="diagonal"):
        hwa.averaged_guide(_model, variance="scales", diagonal_only=False)


def _train(x, y, steps, *, start_step=0, saved=None):
    """SVI + HWA for ``steps`` steps from step ``start_step``, optionally resumed from ``saved``."""
    optim = pyro.optim.Adam({"lr": 0.05})
    guide = AutoNormal(_model)
    svi = SVI(_model, guide, optim, Trace_ELBO())
    if saved is None:
        pyro.set_rng_seed(0)
        svi.step(x, y)
    else:
        pyro.get_param_store().set_state(saved["params"])
        optim.set_state(saved["optim"])
        guide(x, y)
    hwa = HWA(guide, max_rank=3)
    if saved is not None:
        hwa.load_state_dict(saved["hwa"])
        torch.set_rng_state(saved["rng"])
    callback = hwa.callback(4)
    for k in range(start_step, start_step + steps):
        svi.step(x, y)
        callback(k)
    state = {"params": pyro.get_param_store().get_state(), "optim": optim.get_state(), "hwa": hwa.state_dict(),
             "rng": torch.get_rng_state()}
    return hwa, copy.deepcopy(state)


def test_resumed_training_equals_uninterrupted():
    x, y = _data()
    full, _ = _train(x, y, 20)
    pyro.clear_param_store()
    _, saved = _train(x, y, 9)
    pyro.clear_param_store()
    resumed, _ = _train(x, y, 11, start_step=9, saved=saved)
    assert resumed.num_collected == full.num_collected == 5
    for rule in VARIANCE_RULES:
        for site in ("w", "b"):
            torch.testing.assert_close(resumed.variance(rule)[site], full.variance(rule)[site], rtol=0, atol=0)
    torch.testing.assert_close(resumed.mean()["w"], full.mean()["w"], rtol=0, atol=0)
    torch.testing.assert_close(resumed.means.deviation_matrix(), full.means.deviation_matrix(), rtol=0, atol=0)


def test_bad_input():
    x, y = _data()
    with pytest.raises(ValueError, match="run the guide once"):
        HWA(AutoNormal(_model))
    delta = AutoDelta(_model)
    delta(x, y)
    with pytest.raises(ValueError, match="AutoNormal or AutoContinuous"):
        HWA(delta)
    guide = AutoNormal(_model)
    guide(x, y)
    hwa = HWA(guide)
    with pytest.raises(ValueError, match="nothing has been collected"):
        hwa.variance()
    hwa.collect()
    with pytest.raises(ValueError, match="variance"):
        hwa.variance("median")
    with pytest.raises(ValueError, match="cycle_length"):
        hwa.callback(0)
    with pytest.raises(ValueError, match="lr_low"):
        cyclical_lr_scheduler(torch.optim.SGD, {"lr": 0.01}, cycle_length=2, lr_low=0.1)
    with pytest.raises(ValueError, match="'lr'"):
        cyclical_lr_scheduler(torch.optim.SGD, {}, cycle_length=2, lr_low=0.1)
    with pytest.raises(ValueError, match="low_ratio"):
        CyclicalLR(2, 0.0)


@pytest.mark.parametrize("rule", VARIANCE_RULES)
def test_averaged_guide_on_constrained_latents_predicts_inside_the_support(rule):
    # issue 11 item 4: the unconstrained means were passed as constrained starting values, so Predictive raised
    # "Expected parameter scale ... Normal(loc: 0.0, scale: -0.60)" under Pyro's default validation
    def model(y=None):
        scale = pyro.sample("scale", dist.HalfNormal(1.0))
        p = pyro.sample("p", dist.Dirichlet(torch.ones(3)))
        with pyro.plate("data", 5):
            pyro.sample("y", dist.Normal(p[0], scale), obs=y)

    y = torch.tensor([0.1, 0.5, -0.2, 0.3, 0.0])
    guide = AutoNormal(model, init_scale=0.3)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    svi.step(y)
    hwa = HWA(guide)
    for _ in range(4):
        svi.step(y)
        hwa.collect()
    averaged = hwa.averaged_guide(model, variance=rule)
    draws = Predictive(model, guide=averaged, num_samples=100)(y)
    assert (draws["scale"] > 0).all() and (draws["p"] > 0).all()
    torch.testing.assert_close(draws["p"].sum(-1), torch.ones_like(draws["p"][..., 0]))
    locs, _ = guide_loc_scale(guide)  # the median maps the averaged unconstrained mean into the support
    torch.testing.assert_close(averaged.median(y)["scale"], hwa.mean()["scale"].exp())
    assert locs["p"].shape == (2,)
