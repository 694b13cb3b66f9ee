"""The model transforms and the stochastic-gradient kernels on every catalogue model: the local-entropy joint is the
model's plus the coupling, under SVI and MCMC every value (anchors included) stays in its support, handlers applied
outside a transform give the density of the transform applied outside them, and what cannot work is refused by name."""

from __future__ import annotations

import contextlib
import inspect

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import MCMC, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import biject_to

from pyro_flat.infer import NothingToPerturbWarning, at_latent_values, latent_supports
from pyro_flat.infer.mcmc import SGHMC, SGLD, EntropyMCMC, EntropySGD, EntropySGLD
from pyro_flat.transforms import local_entropy, sharpness_aware

from .catalogue import CASES, REPARAMETERISED, Case, X, Y, by_hand

MODELS = {}
for _case in CASES:  # one entry per distinct model (the guide of a case does not matter here)
    MODELS.setdefault(id(_case.model), _case)
MODEL_CASES = list(MODELS.values())
SUBSAMPLED_LOCAL = ("local", "model subsampling")


def _model_refusal(case: Case, method: str) -> str | None:
    if case.discrete:
        return r"'c'.* discrete"
    if method != "local_entropy (SVI)" and all(f in case.features for f in SUBSAMPLED_LOCAL) or (
        method != "local_entropy (SVI)" and "local" in case.features and case.kwargs.get("subsample_size")
    ):
        return "local latent inside the subsampled plate"
    return None


def _prior_values(model, case: Case) -> dict:
    pyro.set_rng_seed(1)
    trace = poutine.trace(model).get_trace(*case.args, **case.kwargs)
    return {n: s["value"] for n, s in trace.nodes.items()
            if s["type"] == "sample" and not s["is_observed"] and s["fn"].__class__.__name__ != "_Subsample"}


# ----------------------------------------------------------------------------------------------- local_entropy


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_local_entropy_joint_is_the_model_plus_the_coupling(case, outcome):
    outcome.check("local_entropy", case.name, "log joint = model + coupling + anchor Jacobian")
    eta = 0.3
    flat = local_entropy(case.model, eta)
    if case.discrete:
        with pytest.raises(ValueError, match=r"'c' is discrete"):
            poutine.trace(flat).get_trace(*case.args, **case.kwargs)
        outcome.refused()
        return
    supports = latent_supports(case.model, *case.args, **case.kwargs)
    values = _prior_values(case.model, case)
    values = {n: v for n, v in values.items() if n in supports}
    anchors = {}
    for name, value in values.items():
        t = biject_to(supports[name]).inv
        anchors[f"{name}_anchor"] = t.inv(t(value) + 0.1 * torch.randn_like(t(value)))
    pyro.set_rng_seed(2)
    joint = poutine.trace(at_latent_values(flat, {**values, **anchors})).get_trace(*case.args, **case.kwargs)
    pyro.set_rng_seed(2)
    base = poutine.trace(at_latent_values(case.model, values)).get_trace(*case.args, **case.kwargs)
    extra = 0.0
    for name, value in values.items():
        # per element of the site's batch, -||t(x) - t(x_a)||^2 / (2 eta) + log|det J_t(x_a)|, with the site's plate
        # scale and mask (a local latent of a subsampled plate, the unobserved part of an obs_mask site)
        t = biject_to(supports[name]).inv
        z, u = t(value), t(anchors[f"{name}_anchor"])
        squared = (z - u) ** 2
        if t.codomain.event_dim:  # (a sum over an empty tuple of dims would sum everything)
            squared = squared.sum(tuple(range(-t.codomain.event_dim, 0)))
        term = -squared / (2 * eta) + t.log_abs_det_jacobian(anchors[f"{name}_anchor"], u)
        site = base.nodes[name]
        term = term * site["scale"]
        if site["mask"] is not None:
            term = torch.where(site["mask"], term, torch.zeros_like(term))
        extra = extra + term.sum()
    torch.testing.assert_close(joint.log_prob_sum(), base.log_prob_sum() + extra, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_local_entropy_under_svi_keeps_anchors_in_the_support(case, outcome):
    outcome.check("local_entropy", case.name, "SVI + Predictive in the supports (anchors too)")
    flat = local_entropy(case.model, 0.3)
    guide = AutoNormal(flat)
    if case.discrete:
        with pytest.raises(ValueError, match=r"discrete sample site 'c'"):  # Pyro's autoguide refuses it by name
            guide(*case.args, **case.kwargs)
        outcome.refused()
        return
    svi = SVI(flat, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    svi.step(*case.args, **case.kwargs)
    draws = Predictive(flat, guide=guide, num_samples=3)(*case.args, **case.kwargs)
    for name, support in latent_supports(case.model, *case.args, **case.kwargs).items():
        for site in (name, f"{name}_anchor"):
            assert bool(support.check(draws[site]).all()), site


# ------------------------------------------------------------------------------------- handlers outside a transform

OBSERVED = [c for c in MODEL_CASES if "y" in inspect.signature(c.model).parameters and not c.discrete
            and inspect.signature(c.model).parameters["y"].default is None]


def _density(program, values, case: Case, with_y: bool) -> torch.Tensor:
    args = case.args if with_y else case.args[:-1]
    pyro.set_rng_seed(4)
    return poutine.trace(at_latent_values(program, values)).get_trace(*args, **case.kwargs).log_prob_sum()


@pytest.mark.parametrize("case", OBSERVED, ids=[c.name for c in OBSERVED])
@pytest.mark.parametrize("transform", ["sharpness_aware", "local_entropy"])
def test_outer_condition_is_the_same_density_as_inside(transform, case, outcome):
    outcome.check(f"{transform}: outer pyro.condition", case.name, "same density as conditioning inside")
    make = (lambda m: sharpness_aware(m, 0.2)) if transform == "sharpness_aware" else (lambda m: local_entropy(m, 0.3))
    y = {"y": case.args[-1]}
    values = _prior_values(case.model, case)
    values = {n: v for n, v in values.items() if n in latent_supports(case.model, *case.args, **case.kwargs)}
    if transform == "local_entropy":
        values.update({f"{n}_anchor": v for n, v in values.items()})
    outside = _density(pyro.condition(make(case.model), y), values, case, with_y=False)
    inside = _density(make(pyro.condition(case.model, y)), values, case, with_y=False)
    passed = _density(make(case.model), values, case, with_y=True)
    torch.testing.assert_close(outside, inside, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(inside, passed, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", OBSERVED, ids=[c.name for c in OBSERVED])
@pytest.mark.parametrize("transform", ["sharpness_aware", "local_entropy"])
def test_outer_do_is_refused_by_name(transform, case, outcome):
    outcome.check(f"{transform}: outer poutine.do", case.name, "refused by name (apply it inside)")
    make = (lambda m: sharpness_aware(m, 0.2)) if transform == "sharpness_aware" else (lambda m: local_entropy(m, 0.3))
    name, value = next(iter(_prior_values(case.model, case).items()))
    with pytest.raises(ValueError, match=f"poutine.do intervenes on site '{name}'"):
        poutine.trace(poutine.do(make(case.model), {name: value})).get_trace(*case.args, **case.kwargs)
    outcome.refused()


@pytest.mark.parametrize("case", OBSERVED, ids=[c.name for c in OBSERVED])
@pytest.mark.parametrize("transform", ["sharpness_aware", "local_entropy"])
def test_outer_selective_block_is_the_same_density_as_inside(transform, case, outcome):
    outcome.check(f"{transform}: outer poutine.block", case.name, "same density as blocking inside")
    make = (lambda m: sharpness_aware(m, 0.2)) if transform == "sharpness_aware" else (lambda m: local_entropy(m, 0.3))
    supports = latent_supports(case.model, *case.args, **case.kwargs)
    values = {n: v for n, v in _prior_values(case.model, case).items() if n in supports}
    first = next(iter(values))
    for hidden in ([first], ["y"]):  # a latent site (drawn from its prior, invisible) and the observations
        kept = {n: v for n, v in values.items() if n not in hidden}
        if transform == "local_entropy":
            kept.update({f"{n}_anchor": v for n, v in list(kept.items())})
        # hiding the only latent from sharpness_aware leaves nothing to perturb, and a model whose observations are
        # blocked inside observes nothing: each says so (a block of the observations outside is deliberate, as in an
        # autoguide's prototype run: silent)
        flat = transform == "sharpness_aware"
        with _warns("no latent site") if flat and hidden != ["y"] and not kept else contextlib.nullcontext():
            outside = _trace(poutine.block(make(case.model), hide=hidden), kept, case)
        with _warns("no latent site|observes nothing") if flat and (hidden == ["y"] or not kept) else (
                contextlib.nullcontext()):
            inside = _trace(make(poutine.block(case.model, hide=hidden)), kept, case)
        assert _sample_sites(outside) == _sample_sites(inside)  # e.g. no anchor for a site hidden outside
        torch.testing.assert_close(outside.log_prob_sum(), inside.log_prob_sum(), rtol=1e-10, atol=1e-10)


def _warns(match: str):
    return pytest.warns(NothingToPerturbWarning, match=match)


def _trace(program, values, case: Case):
    pyro.set_rng_seed(4)
    return poutine.trace(at_latent_values(program, values)).get_trace(*case.args, **case.kwargs)


def _sample_sites(trace) -> set[str]:
    return {name for name, site in trace.nodes.items() if site["type"] == "sample"}


# ------------------------------------------------------------------------------------------------------ kernels

KERNELS = {
    "SGLD": lambda m: SGLD(m, step_size=1e-4),
    "SGHMC": lambda m: SGHMC(m, step_size=1e-4),
    "EntropyMCMC": lambda m: EntropyMCMC(m, eta=0.3, step_size=1e-4, collect="both"),
    "EntropySGD": lambda m: EntropySGD(m, eta=0.3, step_size=1e-4, num_inner_steps=2),
    "EntropySGLD": lambda m: EntropySGLD(m, eta=0.3, step_size=1e-4, num_inner_steps=2),
    "SGLD on local_entropy": lambda m: SGLD(local_entropy(m, 0.3), step_size=1e-4),
    "SGLD on sharpness_aware (F-SGLD)": lambda m: SGLD(sharpness_aware(m, 0.05), step_size=1e-4),
}


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_samples_stay_in_the_support_and_predict(kernel, case, outcome):
    outcome.check(kernel, case.name, "MCMC samples in the supports, Predictive")
    mcmc = MCMC(KERNELS[kernel](case.model), num_samples=4, warmup_steps=2, disable_progbar=True)
    refusal = _model_refusal(case, kernel)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            mcmc.run(*case.args, **case.kwargs)
        outcome.refused()
        return
    mcmc.run(*case.args, **case.kwargs)
    samples = mcmc.get_samples()
    supports = latent_supports(case.model, *case.args, **case.kwargs)
    for name, value in samples.items():
        support = supports[name.removesuffix("_anchor")]
        assert bool(support.check(value).all()), name
    draws = {n: v for n, v in samples.items() if n in supports}
    out = Predictive(case.model, posterior_samples=draws)(*case.args, **case.kwargs)
    assert out


@pytest.mark.parametrize("reparam", list(REPARAMETERISED))
def test_f_sgld_on_a_reparameterised_model_is_the_chain_of_the_model_reparameterised_by_hand(reparam):
    # issue 20 item 2: F-SGLD on a poutine.reparam model was plain SGLD
    model, latent = REPARAMETERISED[reparam]
    chains = []
    for program in (sharpness_aware(model, 0.5), sharpness_aware(by_hand(latent), 0.5), model):
        pyro.set_rng_seed(0)
        mcmc = MCMC(SGLD(program, step_size=1e-3), num_samples=20, warmup_steps=0, disable_progbar=True)
        mcmc.run(X, Y)
        chains.append(mcmc.get_samples()[latent])
    torch.testing.assert_close(chains[0], chains[1], rtol=1e-10, atol=1e-12)
    assert (chains[0] - chains[2]).abs().max() > 1e-3
