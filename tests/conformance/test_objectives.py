"""Every flat objective on every catalogue case: at zero radius it is its base objective draw for draw; at a positive
radius its three entry points agree, its loss differs from the zero-radius one (the perturbation reaches the
likelihood), SVI steps and Predictive draws stay in the supports; what it cannot do it refuses with an error naming the
site."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_flat.infer import KLBallELBO, latent_supports
from pyro_flat.infer import elbo as objectives
from pyro_flat.transforms import sharpness_aware

from .catalogue import CASES, REPARAMETERISED, Case, X, Y, by_hand


class TraceOnSharpnessAware(Trace_ELBO):
    """``Trace_ELBO`` run on ``sharpness_aware(model, rho)``: the transform as a user applies it."""

    def __init__(self, rho: float, **kwargs):
        self.rho = rho
        super().__init__(**kwargs)

    def _get_traces(self, model, guide, args, kwargs):
        return super()._get_traces(sharpness_aware(model, self.rho), guide, args, kwargs)


def exported_objectives() -> dict[str, tuple]:
    """Every flat objective :mod:`pyro_flat.infer.elbo` exports, ``{name: (class, the Pyro ELBO it is at radius 0)}``
    (not the on-device bases of ``trace_elbo.py`` nor the compiled twins of ``jit.py``, which ``test_compiled.py``
    covers): a new objective is in this suite once it is exported. Its first argument is its radius."""
    found = {}
    for name in objectives.__all__:
        cls = getattr(objectives, name)
        if cls.__module__.rsplit(".", 1)[-1] not in ("trace_elbo", "jit"):
            found[name] = (cls, next(c for c in cls.__mro__ if c.__module__.startswith("pyro.infer.")))
    return found


VARIANTS = {
    "KLBallELBO": {"KLBallELBO (Fisher)": (KLBallELBO, Trace_ELBO),
                   "KLBallELBO (normalised score)": (
                       lambda r, **kw: KLBallELBO(r, direction="normalized_score", **kw), Trace_ELBO)},
}
"""The objectives run under several names, one per option (the rest run under their own name only)."""

OBJECTIVES = {
    **{variant: entry for name, objective in exported_objectives().items()
       for variant, entry in VARIANTS.get(name, {name: objective}).items()},
    "Trace_ELBO on sharpness_aware": (TraceOnSharpnessAware, Trace_ELBO),
}


def expected_refusal(method: str, case: Case) -> str | None:
    """The error (a regex) a method must raise on a case, or ``None`` if it must work."""
    if case.discrete:
        return r"'c'.*(discrete|not reparameterisable|enumeration)|discrete support"
    if method.startswith("KLBallELBO") and "point mass" in case.features:
        return "point mass"
    if method == "SharpnessAwareMeanFieldELBO" and not isinstance(case.guide(), AutoDelta) and any(
        f in case.features for f in ("positive", "simplex", "correlation")
    ) and "hand-written guide" not in case.features:
        return "through a Delta with a Jacobian"
    return None


def refused(match: str, method: str, case: Case):
    """``pytest.raises`` for a refusal; on the enumerated case the KL ball runs Pyro's own validation first (as
    Trace_ELBO does: the site is "in the model but not the guide", a warning), then refuses."""
    if case.name.startswith("enumerated") and method.startswith("KLBallELBO"):
        return _both(pytest.warns(UserWarning, match="Found vars in model but not guide"), pytest.raises(
            ValueError, match=match))
    return pytest.raises(ValueError, match=match)


class _both:
    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        suppressed = self.inner.__exit__(*exc)
        self.outer.__exit__(None, None, None)
        return suppressed


def applies(method: str, case: Case) -> bool:
    return case.mean_field or method != "SharpnessAwareMeanFieldELBO"


def test_the_suite_finds_the_exported_objectives_and_their_bases():
    found = exported_objectives()
    assert {"SharpnessAwareELBO", "SharpnessAwareMeanFieldELBO", "KLBallELBO"} <= set(found)
    assert found["SharpnessAwareMeanFieldELBO"][1] is TraceMeanField_ELBO and found["KLBallELBO"][1] is Trace_ELBO
    assert not any(name.startswith(("Jit", "Tensor")) for name in found)


PAIRS = [(m, c) for m in OBJECTIVES for c in CASES if applies(m, c)]


def _loss_and_grads(elbo, case: Case, seed: int):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = case.guide()
    guide(*case.args, **case.kwargs)
    pyro.set_rng_seed(seed)
    loss = elbo.loss_and_grads(case.model, guide, *case.args, **case.kwargs)
    store = pyro.get_param_store()
    grads = {name: store._params[name].grad for name in store.keys() if store._params[name].grad is not None}
    return loss, grads, torch.rand(())


@pytest.mark.parametrize(("method", "case"), PAIRS, ids=[f"{m}-{c.name}" for m, c in PAIRS])
def test_zero_radius_is_the_base_objective_draw_for_draw(method, case, outcome):
    outcome.check(method, case.name, "zero radius = base objective")
    flat, base = OBJECTIVES[method]
    refusal = expected_refusal(method, case)
    if refusal is not None:
        with refused(refusal, method, case):
            _loss_and_grads(flat(0.0, **case.elbo_kwargs), case, 3)
        outcome.refused()
        return
    ref_loss, ref_grads, ref_next = _loss_and_grads(base(**case.elbo_kwargs), case, 3)
    loss, grads, next_random = _loss_and_grads(flat(0.0, **case.elbo_kwargs), case, 3)
    assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-10)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-8, atol=1e-10)
    assert next_random == ref_next  # the random stream continues as after the base objective


@pytest.mark.parametrize(("method", "case"), PAIRS, ids=[f"{m}-{c.name}" for m, c in PAIRS])
def test_positive_radius_entry_points_svi_and_predictive(method, case, outcome):
    outcome.check(method, case.name, "radius > 0: entry points, SVI, Predictive")
    flat, _ = OBJECTIVES[method]
    elbo = flat(0.05, **case.elbo_kwargs)
    refusal = expected_refusal(method, case)
    pyro.set_rng_seed(0)
    guide = case.guide()
    guide(*case.args, **case.kwargs)
    if refusal is not None:
        with refused(refusal, method, case):
            elbo.loss(case.model, guide, *case.args, **case.kwargs)
        outcome.refused()
        return
    values = []
    for entry in ("loss", "differentiable_loss", "loss_and_grads"):
        pyro.set_rng_seed(5)
        value = getattr(elbo, entry)(case.model, guide, *case.args, **case.kwargs)
        values.append(value.item() if torch.is_tensor(value) else value)
    assert values[0] == pytest.approx(values[1], rel=1e-10) == pytest.approx(values[2], rel=1e-10)
    pyro.set_rng_seed(5)
    unperturbed = flat(0.0, **case.elbo_kwargs).loss(case.model, guide, *case.args, **case.kwargs)
    assert values[0] != pytest.approx(unperturbed, rel=1e-6)  # the perturbation reaches the likelihood
    svi = SVI(case.model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    for _ in range(2):
        assert torch.isfinite(torch.tensor(svi.step(*case.args, **case.kwargs)))
    draws = Predictive(case.model, guide=guide, num_samples=3)(*case.args, **case.kwargs)
    for name, support in latent_supports(case.model, *case.args, **case.kwargs).items():
        assert bool(support.check(draws[name]).all()), name


@pytest.mark.parametrize("reparam", list(REPARAMETERISED))
@pytest.mark.parametrize("method", list(OBJECTIVES))
def test_a_reparameterised_model_is_the_model_reparameterised_by_hand(method, reparam):
    # issue 20 item 2: under poutine.reparam every flat objective equalled its base objective (the perturbed pass reused
    # the reparameterised site's first-pass value). Same loss as on the same model written by hand, not the base one
    model, latent = REPARAMETERISED[reparam]
    flat, base = OBJECTIVES[method]
    losses = []
    for program, elbo in ((model, flat(0.5)), (by_hand(latent), flat(0.5)), (model, base())):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(program)
        guide(X, Y)  # (a reparameterised site is initialised from the original one: start both guides alike)
        pyro.param(f"AutoNormal.locs.{latent}").unconstrained().data.fill_(0.2)
        pyro.set_rng_seed(1)
        losses.append(elbo.loss(program, guide, X, Y))
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)
    assert losses[0] != pytest.approx(losses[2], rel=1e-3)
