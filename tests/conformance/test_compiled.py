"""The compiled objectives and kernels on every catalogue case: their steps are the eager steps — the same losses,
gradients, parameters and draws from the same seed, and the random stream continues as after the eager run — and
what the eager path refuses, the compiled one refuses with the same error.

The captured graph is run without ``torch.compile`` here (``{"backend": None}``: the capture is what carries the
semantics, and compiling each of these tiny models would cost seconds); ``tests/infer/test_compiled.py`` compiles a
few with TorchInductor and ``aot_eager``.
"""

from __future__ import annotations

import copy
import warnings

import pyro
import pytest
import torch
from pyro.infer import MCMC, SVI

from pyro_flat.infer import (
    CompilationFallbackWarning,
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    JitSharpnessAwareMeanFieldELBO,
    KLBallELBO,
    SharpnessAwareELBO,
    SharpnessAwareMeanFieldELBO,
)
from pyro_flat.infer.mcmc import SGHMC, SGLD, EntropyMCMC, EntropySGD, EntropySGLD

from .catalogue import CASES, FEATURE_NET, Case
from .test_objectives import expected_refusal
from .test_transforms_and_kernels import MODEL_CASES, _model_refusal

GRAPH = {"backend": None}
STEPS = 4  # the first step runs eagerly, the second is captured, the third and fourth run the graph

OBJECTIVES = {
    "SharpnessAwareELBO": (SharpnessAwareELBO, JitSharpnessAwareELBO),
    "SharpnessAwareMeanFieldELBO": (SharpnessAwareMeanFieldELBO, JitSharpnessAwareMeanFieldELBO),
    # three conjugate-gradient iterations where the Fisher direction is solved (not closed form): the captured graph
    # unrolls each one, and the identity checked here does not depend on their number
    "KLBallELBO (Fisher)": (
        lambda r, **kw: KLBallELBO(r, cg_iterations=3, **kw),
        lambda r, **kw: JitKLBallELBO(r, cg_iterations=3, **kw),
    ),
    "KLBallELBO (normalised score)": (
        lambda r, **kw: KLBallELBO(r, direction="normalized_score", **kw),
        lambda r, **kw: JitKLBallELBO(r, direction="normalized_score", **kw),
    ),
}
# SharpnessAwareELBO and KLBallELBO on every case; the mean-field SA-ELBO and the normalised-score direction (their
# own particle loss / perturbation, the same capture) on cases covering hand-written, amortised, autoguide, network
# and particle shapes
REPRESENTATIVE = ("normal/hand-written", "linear regression/AutoNormal", "local latents/amortised",
                  "BayesianMLP/AutoNormal", "normal/AutoNormal, 3 particles", "linear regression/vectorised particles",
                  "linear regression/AutoDelta")
PAIRS = [
    (m, c) for m in OBJECTIVES for c in CASES
    if (c.mean_field or m != "SharpnessAwareMeanFieldELBO")
    and (m in ("SharpnessAwareELBO", "KLBallELBO (Fisher)") or c.name in REPRESENTATIVE)
]


def _svi_run(elbo, case: Case):
    """STEPS SVI steps from seed 0: the losses, the parameters after each step, the next random number."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = case.guide()
    svi = SVI(case.model, guide, pyro.optim.Adam({"lr": 0.05}), elbo)
    losses, params = [], []
    network = copy.deepcopy(FEATURE_NET.state_dict())  # pyro.module trains the catalogue's network in place
    try:
        for _ in range(STEPS):
            losses.append(svi.step(*case.args, **case.kwargs))
            params.append({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    finally:
        FEATURE_NET.load_state_dict(network)
    return losses, params, torch.rand(())


@pytest.mark.parametrize(("method", "case"), PAIRS, ids=[f"{m}-{c.name}" for m, c in PAIRS])
def test_compiled_objective_steps_are_the_eager_steps(method, case, outcome):
    outcome.check(f"Jit{method}", case.name, "compiled steps = eager steps")
    eager, compiled = OBJECTIVES[method]
    refusal = expected_refusal(method, case)
    if refusal is not None:  # the first step is the eager one: the same clear error
        with pytest.raises(ValueError, match=refusal), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Found vars in model but not guide")
            _svi_run(compiled(0.05, jit_options=GRAPH, **case.elbo_kwargs), case)
        outcome.refused()
        return
    ref_losses, ref_params, ref_next = _svi_run(eager(0.05, **case.elbo_kwargs), case)
    elbo = compiled(0.05, jit_options=GRAPH, **case.elbo_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)  # every case here can be captured
        losses, params, next_random = _svi_run(elbo, case)
    assert len(elbo.captures()) == 1
    assert losses == pytest.approx(ref_losses, rel=1e-10, abs=1e-10)
    for got, want in zip(params, ref_params, strict=True):
        assert got.keys() == want.keys()
        for name in want:  # the parameters after each step: the gradients were the eager ones
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    assert next_random == ref_next  # the compiled steps drew the eager steps' random numbers, no more


KERNELS = {
    "SGLD": lambda m, **kw: SGLD(m, step_size=1e-3, **kw),
    "SGHMC": lambda m, **kw: SGHMC(m, step_size=1e-3, friction=0.3, **kw),
    "EntropyMCMC": lambda m, **kw: EntropyMCMC(m, eta=0.5, step_size=1e-3, collect="both", **kw),
    "EntropySGD": lambda m, **kw: EntropySGD(m, eta=0.5, step_size=1e-3, num_inner_steps=2, **kw),
    "EntropySGLD": lambda m, **kw: EntropySGLD(m, eta=0.5, step_size=1e-3, num_inner_steps=2, **kw),
}
# SGLD on every model; the other kernels share its captured gradient evaluation (EntropyMCMC its own), so they run on
# the models that exercise constraints, subsampling and a network
KERNEL_PAIRS = [("SGLD", c) for c in MODEL_CASES] + [
    (k, c) for k in KERNELS if k != "SGLD" for c in MODEL_CASES
    if c.name.split("/")[0] in ("linear regression", "BayesianMLP", "LKJ Cholesky")
]


def _mcmc_run(kernel, case: Case):
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=STEPS, warmup_steps=1, disable_progbar=True)
    mcmc.run(*case.args, **case.kwargs)
    return mcmc.get_samples(), torch.rand(())


@pytest.mark.parametrize(("kernel", "case"), KERNEL_PAIRS, ids=[f"{k}-{c.name}" for k, c in KERNEL_PAIRS])
def test_compiled_kernel_draws_are_the_eager_draws(kernel, case, outcome):
    outcome.check(f"{kernel} (jit_compile=True)", case.name, "compiled draws = eager draws")
    refusal = _model_refusal(case, kernel)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            _mcmc_run(KERNELS[kernel](case.model, jit_compile=True, jit_options=GRAPH), case)
        outcome.refused()
        return
    ref_samples, ref_next = _mcmc_run(KERNELS[kernel](case.model), case)
    compiled = KERNELS[kernel](case.model, jit_compile=True, jit_options=GRAPH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        samples, next_random = _mcmc_run(compiled, case)
    assert len(compiled._compiled.captures()) == 1
    assert samples.keys() == ref_samples.keys()
    for name in ref_samples:  # the same Langevin noise, minibatches and dropout masks: the same chain
        torch.testing.assert_close(samples[name], ref_samples[name], rtol=1e-9, atol=1e-12)
    assert next_random == ref_next
