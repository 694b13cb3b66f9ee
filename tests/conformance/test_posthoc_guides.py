"""The post-hoc Gaussian guides (SWAG from a MAP trajectory, HWA of an SVI guide, Bayesian SAM's posterior) on every
catalogue model: the median is the collected mean mapped into each support, and Predictive's draws stay in the
supports; what cannot work is refused by name."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch.distributions import biject_to

from pyro_flat.infer import HWA, SWAGCollector, latent_supports
from pyro_flat.optim import BayesianSAM

from .catalogue import CASES, Case

MODELS = {}
for _case in CASES:
    MODELS.setdefault(id(_case.model), _case)
MODEL_CASES = list(MODELS.values())


def _refusal(case: Case) -> str | None:
    if case.discrete:
        return r"discrete sample site 'c'"  # Pyro's autoguides refuse it by name
    return None


def _subsampled_local(case: Case) -> bool:
    return "local" in case.features and bool(case.kwargs.get("subsample_size"))


def _check_predictive(model, guide, case: Case, outcome) -> None:
    """Predictive's draws in the supports; a post-hoc guide over local latents of a subsampled plate refuses the
    minibatch call by name and predicts on the full data."""
    kwargs = dict(case.kwargs)
    if _subsampled_local(case):
        with pytest.raises(ValueError, match="site 'z' is a local latent of the subsampled plate 'data'"):
            Predictive(model, guide=guide, num_samples=3)(*case.args, **kwargs)
        outcome.refused()
        kwargs.pop("subsample_size")
    draws = Predictive(model, guide=guide, num_samples=3)(*case.args, **kwargs)
    for name, support in latent_supports(model, *case.args, **kwargs).items():
        assert bool(support.check(draws[name]).all()), name


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_swag_of_a_map_trajectory(case, outcome):
    outcome.check("AutoSWAG (SWAGCollector)", case.name, "median = collected mean, Predictive in the supports")
    refusal = _refusal(case)
    pyro.set_rng_seed(0)
    delta = AutoDelta(case.model)
    if refusal is not None:
        with pytest.raises((ValueError, NotImplementedError, RuntimeError), match=refusal):
            delta(*case.args, **case.kwargs)
            collector = SWAGCollector(max_rank=3, supports=latent_supports(delta))
            collector.collect(delta.median())
            collector.guide(case.model, diagonal_only=True)(*case.args, **case.kwargs)
        outcome.refused()
        return
    svi = SVI(case.model, delta, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    svi.step(*case.args, **case.kwargs)
    if _subsampled_local(case):
        # delta.median() of a subsampled plate holds one minibatch's rows of the local latent: refused by name
        collector = SWAGCollector(max_rank=3, supports=latent_supports(delta))
        for _ in range(3):
            collector.collect(delta.median())
        with pytest.raises(ValueError, match=r"site 'z' has unconstrained shape \(8,\) in the model, \(3,\)"):
            Predictive(case.model, guide=collector.guide(case.model), num_samples=2)(*case.args)
        outcome.refused()
        return
    collector = SWAGCollector(max_rank=3, supports=latent_supports(delta))
    iterates = []
    for _ in range(3):
        svi.step(*case.args, **case.kwargs)
        collector.collect(delta.median())
        iterates.append({k: v.detach().clone() for k, v in delta.median().items()})
    guide = collector.guide(case.model, scale=0.5)
    _check_predictive(case.model, guide, case, outcome)
    median = guide.median(*case.args, **{k: v for k, v in case.kwargs.items() if k != "subsample_size"})
    for name, support in latent_supports(delta).items():
        t = biject_to(support)
        expected = t(torch.stack([t.inv(it[name]) for it in iterates]).mean(0))
        torch.testing.assert_close(median[name], expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_hwa_of_an_svi_guide(case, outcome):
    outcome.check("HWA", case.name, "Predictive in the supports (every variance rule)")
    refusal = _refusal(case)
    pyro.set_rng_seed(0)
    guide = AutoNormal(case.model)
    if refusal is not None:
        with pytest.raises((ValueError, NotImplementedError, RuntimeError), match=refusal):
            guide(*case.args, **case.kwargs)
            hwa = HWA(guide)
            hwa.collect()
            hwa.averaged_guide(case.model)(*case.args, **case.kwargs)
        outcome.refused()
        return
    svi = SVI(case.model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    svi.step(*case.args, **case.kwargs)
    hwa = HWA(guide)
    for _ in range(3):
        svi.step(*case.args, **case.kwargs)
        hwa.collect()
    for rule in ("means", "total", "scales"):
        _check_predictive(case.model, hwa.averaged_guide(case.model, variance=rule), case, outcome)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_bayesian_sam_posterior(case, outcome):
    outcome.check("BayesianSAM.guide", case.name, "moments = (m, 1/(N s)), Predictive in the supports")
    refusal = _refusal(case)
    pyro.set_rng_seed(0)
    delta = AutoDelta(case.model)
    if refusal is not None:
        with pytest.raises((ValueError, NotImplementedError, RuntimeError), match=refusal):
            delta(*case.args, **case.kwargs)
            BayesianSAM(delta.parameters(), num_data=8).guide(case.model, delta)(*case.args, **case.kwargs)
        outcome.refused()
        return
    delta(*case.args, **case.kwargs)
    opt = BayesianSAM(delta.parameters(), lr=0.05, num_data=8, rho=0.01)

    def closure():  # the mean negative log-likelihood at the guide's values
        guide_trace = poutine.trace(delta).get_trace(*case.args, **case.kwargs)
        trace = poutine.trace(poutine.replay(case.model, trace=guide_trace)).get_trace(*case.args, **case.kwargs)
        trace.compute_log_prob()
        loss = -sum(s["log_prob_sum"] for s in trace.nodes.values() if s["type"] == "sample" and s["is_observed"]) / 8
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    if "simplex" in case.features:  # AutoDelta keeps a simplex as softmax logits, not bijective coordinates
        with pytest.raises(ValueError, match="site 'p' .* not the bijective ones"):
            opt.guide(case.model, delta)
        outcome.refused()
        return
    guide = opt.guide(case.model, delta)
    _check_predictive(case.model, guide, case, outcome)
    full = {k: v for k, v in case.kwargs.items() if k != "subsample_size"}
    assert bool((guide.get_posterior(*case.args, **full).variance > 0).all())
