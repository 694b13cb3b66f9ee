"""Compiled evaluation (pyro_flat.infer.compiled): the captured step is the eager step — with TorchInductor and
``aot_eager`` on the harness networks (BatchNorm, dropout, in-model subsampling), with the captured graph on the rest —
it is re-captured when the shapes or modes change, and what cannot be captured runs eagerly after one clear warning.

Compilation is slow (seconds per graph even for tiny networks), so the compiled runs are module-scoped fixtures shared
by the tests that check them, on networks of a few units."""

from __future__ import annotations

import pickle
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import MCMC, SVI, JitTrace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_flat.infer import (
    CompilationFallbackWarning,
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    JitTensorTrace_ELBO,
    KLBallELBO,
    SharpnessAwareELBO,
    TensorTrace_ELBO,
)
from pyro_flat.infer.compiled import CaptureError, CompiledCalls, capture
from pyro_flat.infer.mcmc import SGLD, EntropyMCMC
from pyro_flat.nn import BayesianCNN, BayesianMLP, init_to_network
from pyro_flat.transforms import sharpness_aware

STEPS = 5  # eager, eager after the guide's set-up, captured, compiled (first call compiles), compiled


def _data(shape, n=24, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


def _cnn():
    torch.manual_seed(1)
    return BayesianCNN((1, 6, 6), 3, channels=(2, 3), norm="batch", dropout=0.2).double()


def _mlp():
    torch.manual_seed(1)
    return BayesianMLP(5, 3, hidden=(6,), dropout=0.2).double()


def _svi(model_factory, loss, x, y, *, steps=STEPS, guide=AutoNormal, **kwargs):
    """SVI steps from seed 0 on a fresh model: losses, parameters, BatchNorm buffers, the next random number."""
    pyro.clear_param_store()
    model = model_factory()
    svi = SVI(model, guide(model, init_loc_fn=init_to_network(model)), pyro.optim.Adam({"lr": 0.01}), loss)
    pyro.set_rng_seed(0)
    losses = [svi.step(x, y, **kwargs) for _ in range(steps)]
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers() if "running" in k or "num_batches" in k}
    return {"losses": losses, "params": params, "buffers": buffers, "next": torch.rand(()), "loss": loss}


def _assert_same_run(got, want, rtol=1e-9):
    assert got["losses"] == pytest.approx(want["losses"], rel=rtol)
    for part in ("params", "buffers"):
        assert got[part].keys() == want[part].keys()
        for name in want[part]:
            torch.testing.assert_close(got[part][name], want[part][name], rtol=rtol, atol=1e-12)
    assert got["next"] == want["next"]


# ----------------------------------------------------------------------------------------- TorchInductor, aot_eager


@pytest.fixture(scope="module")
def mlp_sa_runs():
    """F-VI on a BayesianMLP with dropout, minibatches drawn in the model: eager and TorchInductor."""
    x, y = _data((5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        eager = _svi(_mlp, SharpnessAwareELBO(0.05), x, y, subsample_size=8)
        compiled = _svi(_mlp, JitSharpnessAwareELBO(0.05), x, y, subsample_size=8)
    return eager, compiled


def test_inductor_sa_elbo_is_the_eager_one(mlp_sa_runs):
    eager, compiled = mlp_sa_runs
    (captured,) = compiled["loss"].captures()
    assert captured.compile_seconds is not None  # it was compiled (and the compiled steps ran)
    # the same losses and parameters (hence gradients), and the compiled steps drew the same minibatches, guide noise
    # and dropout masks (the random stream continues identically); TorchInductor reorders float64 reductions
    _assert_same_run(compiled, eager)
    assert [d.func.__name__ for d in captured.draws].count("bernoulli_.float") == 1  # one mask, used by both passes


def test_captured_step_reports_its_capture_and_compile_times(mlp_sa_runs):
    (captured,) = mlp_sa_runs[1]["loss"].captures()
    assert captured.capture_seconds > 0 and captured.compile_seconds > 0


@pytest.fixture(scope="module")
def mlp_sgld_runs():
    """SGLD (minibatches and dropout in the model) eager and compiled by TorchInductor, same seed."""
    x, y = _data((5,))

    def run(**options):
        model = _mlp()
        kernel = SGLD(model, step_size=1e-3, init_strategy=init_to_network(model), **options)
        pyro.set_rng_seed(0)
        mcmc = MCMC(kernel, num_samples=STEPS, warmup_steps=1, disable_progbar=True)
        mcmc.run(x, y, subsample_size=8)
        return mcmc.get_samples(), torch.rand(()), kernel

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        return run(), run(jit_compile=True)


def test_inductor_sgld_draws_are_the_eager_draws(mlp_sgld_runs):
    (eager, eager_next, _), (compiled, compiled_next, kernel) = mlp_sgld_runs
    (captured,) = kernel._compiled.captures()
    assert captured.compile_seconds is not None
    for name in eager:  # the Langevin noise is drawn outside the graph, as the eager kernel draws it
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-9, atol=1e-12)
    assert compiled_next == eager_next


def test_compiled_kernel_pickles_without_its_graphs(mlp_sgld_runs):
    kernel = mlp_sgld_runs[1][2]
    clone = pickle.loads(pickle.dumps(kernel))  # what MCMC(num_chains > 1) sends to its worker processes
    assert clone.jit_compile and not clone._compiled.entries and kernel._compiled.entries


@pytest.mark.slow
def test_aot_eager_kl_ball_on_a_batchnorm_cnn_and_the_elbo_module_path():
    """KLBallELBO on a BayesianCNN with BatchNorm and dropout through torch.compile's aot_eager backend (the BatchNorm
    updates functionalised, the Fisher step in the graph), trained by a torch optimiser on Pyro's ELBOModule
    (differentiable_loss): the same values, parameters and BatchNorm statistics as eagerly."""
    x, y = _data((1, 6, 6))

    def run(loss):
        pyro.clear_param_store()
        model = _cnn()
        guide = AutoNormal(model, init_loc_fn=init_to_network(model))
        pyro.set_rng_seed(0)
        guide(x, y, subsample_size=8)
        module = loss(model, guide)
        optim = torch.optim.Adam(module.parameters(), lr=0.01)
        values = []
        for _ in range(STEPS):
            optim.zero_grad()
            value = module(x, y, subsample_size=8)
            value.backward()
            optim.step()
            values.append(value.item())
        tensors = [p.detach().clone() for p in module.parameters()] + [b.clone() for b in model.buffers()]
        return values, tensors, torch.rand(())

    # three conjugate-gradient iterations for the Fisher solve (the graph unrolls each; the identity does not depend
    # on their number)
    want = run(KLBallELBO(0.01, cg_iterations=3))
    elbo = JitKLBallELBO(0.01, cg_iterations=3, jit_options={"backend": "aot_eager"})
    got = run(elbo)
    assert elbo.captures()[0].compile_seconds is not None
    assert got[0] == pytest.approx(want[0], rel=1e-10)
    for a, b in zip(got[1], want[1], strict=True):  # parameters, then BatchNorm statistics
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert got[2] == want[2]


@pytest.mark.cuda
def test_compiled_steps_on_cuda_are_the_eager_steps():
    """On a GPU: TorchInductor's Triton kernels, CUDA generators (the subsample, guide noise and the fused dropout
    mask drawn outside the graph), no host synchronisation added by the compiled step."""
    x, y = (t.cuda() for t in _data((5,)))
    for eager, jit in ((SharpnessAwareELBO, JitSharpnessAwareELBO), (KLBallELBO, JitKLBallELBO)):
        want = _svi(lambda: _mlp().cuda(), eager(0.05), x, y, subsample_size=8)
        got = _svi(lambda: _mlp().cuda(), jit(0.05), x, y, subsample_size=8)
        assert got["loss"].captures()[0].compile_seconds is not None
        _assert_same_run(got, want)


# ----------------------------------------------------------------------------------------- harness networks, graph


@pytest.mark.parametrize("network", ["mlp", "cnn"])
@pytest.mark.parametrize("objective", ["sa", "kl_ball"])
def test_harness_networks_captured_steps_are_the_eager_steps(network, objective):
    """The harness's networks (BayesianMLP, BayesianCNN with BatchNorm; dropout in both) under the captured graph."""
    factory, shape = (_mlp, (5,)) if network == "mlp" else (_cnn, (1, 6, 6))
    x, y = _data(shape)
    eager, jit = (SharpnessAwareELBO, JitSharpnessAwareELBO) if objective == "sa" else (KLBallELBO, JitKLBallELBO)
    want = _svi(factory, eager(0.05), x, y, subsample_size=8)
    got = _svi(factory, jit(0.05, jit_options={"backend": None}), x, y, subsample_size=8)
    assert len(got["loss"].captures()) == 1
    _assert_same_run(got, want)


@pytest.mark.parametrize("guide", [AutoNormal, AutoDelta])
def test_compiled_base_elbo_through_training_mode_batchnorm_is_the_eager_one(guide):
    # the loss's autograd graph runs through BatchNorm layers that update their statistics (the flat objectives' runs
    # freeze them in their second pass): restoring the statistics after the capture must not invalidate that graph
    x, y = _data((1, 6, 6))
    want = _svi(_cnn, TensorTrace_ELBO(), x, y, guide=guide, subsample_size=8)
    got = _svi(_cnn, JitTensorTrace_ELBO(jit_options={"backend": None}), x, y, guide=guide, subsample_size=8)
    assert got["loss"].captures()
    _assert_same_run(got, want)


def test_sam_with_autodelta_on_a_network_is_the_eager_sam():
    x, y = _data((5,))
    want = _svi(_mlp, SharpnessAwareELBO(0.05), x, y, guide=AutoDelta, subsample_size=8)
    got = _svi(_mlp, JitSharpnessAwareELBO(0.05, jit_options={"backend": None}), x, y, guide=AutoDelta,
               subsample_size=8)
    _assert_same_run(got, want)


def test_f_sgld_and_entropy_mcmc_on_a_network_are_the_eager_chains():
    """SGLD on the sharpness-aware transform (an inner gradient inside the potential) and Entropy-MCMC."""
    x, y = _data((5,))

    def run(build, **options):
        model = _mlp()
        pyro.set_rng_seed(0)
        mcmc = MCMC(build(model, **options), num_samples=4, warmup_steps=1, disable_progbar=True)
        mcmc.run(x, y, subsample_size=8)
        return mcmc.get_samples()

    for build in (
        lambda m, **o: SGLD(sharpness_aware(m, 0.05), step_size=1e-3, init_strategy=init_to_network(m), **o),
        lambda m, **o: EntropyMCMC(m, eta=0.1, step_size=1e-3, collect="both", init_strategy=init_to_network(m), **o),
    ):
        want = run(build)
        got = run(build, jit_compile=True, jit_options={"backend": None})
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("options", [{"looksam_k": 3}, {"rst_p": 0.5}])
@pytest.mark.parametrize("guide", [AutoNormal, AutoDelta])
def test_looksam_and_rst_steps_are_the_eager_steps_one_capture_per_kind(options, guide):
    # 8 steps: every kind of step runs eagerly, is captured, then runs from its capture; LookSAM's directions are
    # written by the captured refreshes and read by the captured reuse steps
    x, y = _data((5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        pyro.set_rng_seed(3)
        want = _svi(_mlp, SharpnessAwareELBO(0.05, **options), x, y, steps=8, guide=guide, subsample_size=8)
        pyro.set_rng_seed(3)
        got = _svi(_mlp, JitSharpnessAwareELBO(0.05, jit_options={"backend": None}, **options), x, y, steps=8,
                   guide=guide, subsample_size=8)
    _assert_same_run(got, want)
    assert len(got["loss"].captures()) == 2  # one per kind of step: the ascent, and the reuse / base step


def test_a_kernel_on_a_scheduled_transform_runs_eagerly_and_says_why():
    # a kernel's capture cannot key on the transform's schedule, which decides at every call: it runs eagerly
    x, y = _data((5,))

    def run(**options):
        model = _mlp()
        pyro.set_rng_seed(0)
        kernel = SGLD(sharpness_aware(model, 0.05, rst_p=0.5), step_size=1e-3, init_strategy=init_to_network(model),
                      **options)
        mcmc = MCMC(kernel, num_samples=STEPS, warmup_steps=1, disable_progbar=True)
        mcmc.run(x, y, subsample_size=8)
        return mcmc.get_samples()

    want = run()
    with pytest.warns(CompilationFallbackWarning, match="decides at every call which passes to run"):
        got = run(jit_compile=True, jit_options={"backend": None})
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- keys and re-capture


def test_new_shapes_or_modes_are_captured_again():
    x, y = _data((5,))
    elbo = JitSharpnessAwareELBO(0.05, jit_options={"backend": None})
    model = _mlp()
    svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), elbo)
    for _ in range(3):
        svi.step(x, y, subsample_size=8)
    assert len(elbo.captures()) == 1
    for _ in range(3):
        svi.step(x, y, subsample_size=4)  # another minibatch shape: another graph
    assert len(elbo.captures()) == 2
    model.eval()  # dropout off: another program
    for _ in range(3):
        svi.step(x, y, subsample_size=4)
    assert len(elbo.captures()) == 3
    svi.step(x, y, subsample_size=8)  # back to a known key: no new capture
    assert len(elbo.captures()) == 3


def _regression(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x, 0.5), obs=y)


@pytest.mark.parametrize(("eager", "compiled", "option"), [
    (SharpnessAwareELBO, JitSharpnessAwareELBO, "rho"), (KLBallELBO, JitKLBallELBO, "radius"),
])
def test_an_option_changed_after_the_capture_is_honoured(eager, compiled, option):
    """The options are part of the capture's key (a graph bakes them in), and the eager SA-ELBO makes its transform
    again: the step after ``elbo.rho = ...`` is the eager step at the new value, compiled or not."""
    x = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64)
    y = 2 * x
    losses = []
    for cls, options in ((eager, {}), (compiled, {"jit_options": {"backend": None}})):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        elbo = cls(0.1, **options)
        svi = SVI(_regression, AutoNormal(_regression), pyro.optim.Adam({"lr": 0.01}), elbo)
        for _ in range(3):
            svi.step(x, y)
        setattr(elbo, option, 2.0)
        losses.append([svi.step(x, y) for _ in range(2)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-10)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    unchanged = eager(0.1)
    svi = SVI(_regression, AutoNormal(_regression), pyro.optim.Adam({"lr": 0.01}), unchanged)
    reference = [svi.step(x, y) for _ in range(5)][3:]
    assert losses[0] != pytest.approx(reference, rel=1e-6)  # the new value mattered


def test_a_kernel_option_changed_after_the_capture_is_honoured():
    x = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64)
    runs = []
    for jit in (False, True):
        pyro.set_rng_seed(0)
        kernel = EntropyMCMC(_regression, eta=0.5, step_size=1e-3, jit_compile=jit, jit_options={"backend": None})
        kernel.setup(10, x, 2 * x)
        params = kernel.initial_params
        for _ in range(3):
            params = kernel.sample(params)
        kernel.eta = 0.05
        for _ in range(2):
            params = kernel.sample(params)
        runs.append(params)
    for name in runs[0]:
        torch.testing.assert_close(runs[1][name], runs[0][name], rtol=1e-10, atol=1e-12)


def test_parameter_statements_reach_the_handlers_with_their_values():
    """A compiled step makes the eager step's parameter statements (SVI collects its parameters there), with the
    constrained values; a handler that replaces a parameter's value is refused (the graph used the stored one)."""
    x, y = _data((5,))
    model = _mlp()
    guide = AutoNormal(model)
    guide(x, y, subsample_size=8)
    elbo = JitSharpnessAwareELBO(0.05, jit_options={"backend": None})
    for _ in range(2):  # eager, captured
        elbo.loss_and_grads(model, guide, x, y, subsample_size=8)
    store = pyro.get_param_store()
    with poutine.trace(param_only=True) as params:
        elbo.loss_and_grads(model, guide, x, y, subsample_size=8)  # the compiled step
    assert elbo.captures() and set(params.trace.nodes) == set(store.keys())
    for name, site in params.trace.nodes.items():
        torch.testing.assert_close(site["value"], store[name])
        assert site["value"].unconstrained() is store._params[name]
    name = next(n for n in store.keys() if "scale" in n)
    with pytest.raises(NotImplementedError, match=f"replaced the value of parameter '{name}'"):
        with poutine.substitute(data={name: torch.ones_like(store[name])}):
            elbo.loss_and_grads(model, guide, x, y, subsample_size=8)


# ----------------------------------------------------------------------------------------- what cannot be captured

X = torch.randn(6, dtype=torch.float64)


def branching(x):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    loc = w if w > 0 else -w  # Python control flow on a latent value
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(loc, 1.0), obs=x)


def changing_sites(x):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    if w.item() > 0:  # the set of sites depends on a latent value
        pyro.sample("v", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(w, 1.0), obs=x)


def reseeding(x):
    torch.manual_seed(0)
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(w + 0.01 * torch.randn(()), 1.0), obs=x)


GENERATOR = torch.Generator().manual_seed(0)


def own_generator(x):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(w + 0.01 * torch.randn((), generator=GENERATOR), 1.0), obs=x)


def gamma_model(x):
    s = pyro.sample("s", dist.Gamma(2.0, 2.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(0.0, s), obs=x)


def gamma_guide(x):
    a = pyro.param("a", torch.tensor(2.0), constraint=dist.constraints.positive)
    pyro.sample("s", dist.Gamma(a, 2.0))


UNCAPTURABLE = [
    ("branching", branching, lambda: AutoNormal(branching), "read on the host at .*loc = w if w > 0 else -w"),
    ("changing sites", changing_sites, None, r"read on the host at .*if w.item\(\) > 0"),
    ("reseeding", reseeding, lambda: AutoNormal(reseeding), "reseeds the generator"),
    ("own generator", own_generator, lambda: AutoNormal(own_generator), "uses its own torch.Generator"),
    ("gamma guide", gamma_model, lambda: gamma_guide, "depend on the values of its tensor arguments"),
]


@pytest.mark.parametrize(("name", "model", "guide", "reason"), [u for u in UNCAPTURABLE if u[2] is not None],
                         ids=[u[0] for u in UNCAPTURABLE if u[2] is not None])
@pytest.mark.parametrize("objective", ["sa", "kl_ball"])
def test_uncapturable_objective_warns_once_and_runs_eagerly(name, model, guide, reason, objective):
    eager, jit = (SharpnessAwareELBO, JitSharpnessAwareELBO) if objective == "sa" else (KLBallELBO, JitKLBallELBO)

    def run(elbo):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        GENERATOR.manual_seed(0)
        svi = SVI(model, guide(), pyro.optim.Adam({"lr": 0.01}), elbo)
        return [svi.step(X) for _ in range(STEPS)], torch.rand(())

    want = run(eager(0.05))
    with pytest.warns(CompilationFallbackWarning, match=f"runs its eager path .*{reason}") as record:
        got = run(jit(0.05, jit_options={"backend": None}))
    assert sum(issubclass(w.category, CompilationFallbackWarning) for w in record) == 1
    assert got == want  # the eager path's results, draw for draw


@pytest.mark.parametrize(("name", "model", "guide", "reason"), [u for u in UNCAPTURABLE if u[0] != "gamma guide"],
                         ids=[u[0] for u in UNCAPTURABLE if u[0] != "gamma guide"])
def test_uncapturable_kernel_warns_once_and_runs_eagerly(name, model, guide, reason):
    def run(**options):
        pyro.set_rng_seed(0)
        GENERATOR.manual_seed(0)
        mcmc = MCMC(SGLD(model, step_size=1e-3, **options), num_samples=STEPS, disable_progbar=True)
        mcmc.run(X)
        return mcmc.get_samples()

    want = run()
    with pytest.warns(CompilationFallbackWarning, match=f"SGLD runs its eager path .*{reason}") as record:
        got = run(jit_compile=True, jit_options={"backend": None})
    assert sum(issubclass(w.category, CompilationFallbackWarning) for w in record) == 1
    for site in want:
        torch.testing.assert_close(got[site], want[site], rtol=0, atol=0)


def test_capture_reports_the_reason_and_keeps_the_eager_result():
    w = torch.tensor(0.3, requires_grad=True)
    outputs, captured = capture(lambda: w * 2 if w > 0 else w, lambda: [w])
    assert isinstance(captured, CaptureError) and "read on the host" in str(captured)
    assert outputs.item() == pytest.approx(0.6)


def test_the_random_stream_of_a_capture_is_the_eager_one():
    """Draws repeated after a generator reset are one draw (a replay); the graph takes them as inputs."""
    w = torch.randn(3)

    def step():
        state = torch.get_rng_state()
        a = w + torch.randn(3)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        b = w * torch.randn(3)  # the same numbers: a replay
        torch.set_rng_state(after)
        return a + b

    torch.manual_seed(5)
    want = [step() for _ in range(3)], torch.rand(())
    torch.manual_seed(5)
    first = step()
    outputs, captured = capture(step, lambda: [w])
    assert len(captured.draws) == 1
    got = [first, outputs, captured([w])], torch.rand(())
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[1] == want[1]


def test_compile_failure_keeps_the_captured_graph(monkeypatch):
    calls = CompiledCalls("test", {"backend": "inductor"})
    w = torch.tensor([1.0, 2.0])

    def broken(graph, **options):
        def run(*args):
            try:
                raise ValueError("the compiler's own error\nwith its second line")
            except ValueError as inner:
                raise RuntimeError("BackendCompilerFailed: backend='inductor' raised:") from inner
        return run

    monkeypatch.setattr(torch, "compile", broken)
    step = lambda: w * 3 + torch.randn(2)  # noqa: E731 (a step that draws random numbers)
    for _ in range(2):
        calls("key", step, lambda: [w])
    torch.manual_seed(5)
    expected, expected_next = step(), torch.rand(())
    torch.manual_seed(5)
    with pytest.warns(CompilationFallbackWarning, match="is not compiled: torch.compile failed") as caught:
        out = calls("key", step, lambda: [w])
    message = str(caught[0].message)  # the whole error, not its first line: the cause and every line of it
    assert "backend='inductor' raised:" in message and "the compiler's own error\nwith its second line" in message
    # the failed attempt's draws are not spent: the step has the eager numbers and the stream continues as after it
    torch.testing.assert_close(out, expected)
    assert torch.equal(torch.rand(()), expected_next)
    assert not calls.captures()[0].compiling


def test_cuda_steps_replay_a_cuda_graph_and_hand_back_their_own_outputs(monkeypatch):
    # on CUDA the default is torch.compile(mode="reduce-overhead"); each step marks a new CUDA-graph step and copies
    # its outputs out of the graph's memory (the next replay overwrites it). Checked on the CPU with a stand-in compiler
    w = torch.tensor([1.0, 2.0])
    _, captured = capture(lambda: w * 3 + torch.randn(2), lambda: [w])
    seen, marks, memory = [], [], torch.zeros(2)

    def graph_replay(graph, **options):
        seen.append(options)

        def run(*args):  # like a CUDA graph: the output lives in memory that the next replay reuses
            memory.copy_(graph(*args)[0])
            return [memory]
        return run

    monkeypatch.setattr(torch, "compile", graph_replay)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    captured.devices = {"cuda"}
    captured.compile({"backend": "inductor"})
    assert seen[-1]["mode"] == "reduce-overhead" and captured.cuda_graphs
    first = captured([w])
    kept = first.clone()
    second = captured([w])
    torch.testing.assert_close(first, kept)  # not overwritten by the second replay
    assert len(marks) == 2 and not torch.equal(first, second)
    captured.compile({"backend": "inductor", "mode": "max-autotune-no-cudagraphs"})  # the user's mode wins
    assert seen[-1]["mode"] == "max-autotune-no-cudagraphs" and not captured.cuda_graphs
    captured.devices = {"cpu"}
    captured.compile({"backend": "inductor"})
    assert "mode" not in seen[-1] and seen[-1]["options"] == {"layout_optimization": False}


@pytest.mark.cuda
def test_compiled_steps_on_cuda_replay_cuda_graphs():
    x, y = (t.cuda() for t in _data((5,)))
    got = _svi(lambda: _mlp().cuda(), JitSharpnessAwareELBO(0.05), x, y, subsample_size=8)
    assert got["loss"].captures()[0].cuda_graphs
    from torch._dynamo.utils import counters

    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


# ----------------------------------------------------------------------------------------- JitTrace_ELBO, options


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")  # torch < 2.14
def test_pyro_jit_trace_elbo_on_the_transform_points_to_the_compiled_objective():
    def model(x):
        s = pyro.sample("s", dist.HalfNormal(1.0))  # a constrained latent (the report)
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(0.0, s), obs=x)

    guide = AutoNormal(model)
    guide(X)
    with pytest.raises(NotImplementedError, match="JitSharpnessAwareELBO"):
        JitTrace_ELBO(ignore_jit_warnings=True).loss_and_grads(sharpness_aware(model, 0.1), guide, X)


def test_bad_jit_options_are_refused():
    with pytest.raises(ValueError, match="jit_options"):
        JitSharpnessAwareELBO(0.05, jit_options="inductor")
    with pytest.raises(ValueError, match="jit_compile"):
        SGLD(branching, step_size=0.1, jit_compile="yes")
    with pytest.raises(ValueError, match="jit_options"):
        SGLD(branching, step_size=0.1, jit_compile=True, jit_options=["inductor"])


def test_kernels_take_the_base_options_once():
    """Every kernel's own signature lists only its own options; the shared ones go to StochasticGradientKernel."""
    import inspect

    from pyro_flat.infer.mcmc import SGHMC, EntropySGD, EntropySGLD, StochasticGradientKernel

    shared = set(inspect.signature(StochasticGradientKernel).parameters) - {"model", "potential_fn"}
    for kernel in (SGHMC, EntropyMCMC, EntropySGD, EntropySGLD):
        own = set(inspect.signature(kernel).parameters) - {"model", "potential_fn", "kwargs"}
        assert not own & shared, kernel
        built = kernel(branching, step_size=0.1, jit_compile=True, thinning=2, **(
            {"eta": 0.1} if kernel is not SGHMC else {}))
        assert built.jit_compile and built.thinning == 2
    with pytest.raises(TypeError, match="step_size"):
        SGHMC(branching)

