"""The capture (pyro_flat.runtime.capture) on what a GPU run meets and a CPU test did not: channels-last networks under
bf16 autocast with BatchNorm in training mode and ``AdaptiveAvgPool2d`` (whose channels-last backward writes into an
``as_strided`` view: torch.compile refused the captured graph of every flat method), custom autograd Functions on the
differentiated path, and steps computed in low precision.

The compiled steps use torch.compile's ``aot_eager`` backend: AOTAutograd functionalises and differentiates the graph
exactly as TorchInductor's front end does (where the view-chain error arose), at a fraction of the compile time; its
kernels are the eager ones, so eager and compiled runs match to the last bit here."""

from __future__ import annotations

import warnings

import pyro
import pytest
import torch
from pyro.infer import MCMC, SVI
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch import nn

from pyro_flat.infer import (
    AutoLowRankPlusDiagonalNormal,
    CompilationFallbackWarning,
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    JitTensorTrace_ELBO,
    KLBallELBO,
    SharpnessAwareELBO,
    TensorTrace_ELBO,
)
from pyro_flat.infer.mcmc import SGHMC, SGLD, CyclicalStepSize, EntropyMCMC, EntropySGLD
from pyro_flat.nn import BayesianClassifier, init_to_network, make_bayesian
from pyro_flat.runtime.capture import CaptureError, capture

STEPS = 5  # eager, eager after the guide's set-up, captured, compiled (the first call compiles), compiled
AOT_EAGER = {"backend": "aot_eager"}


def _images(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 2, 4, 4, generator=generator, dtype=dtype).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 3, (24,), generator=generator)


def _pooled_cnn(dtype: torch.dtype, autocast: torch.dtype | None) -> BayesianClassifier:
    """conv -> BatchNorm -> ReLU -> AdaptiveAvgPool2d(1) -> linear, channels-last, packed: 4x4 maps pooled to 1x1 (the
    as_strided backward; a 1x1 map before the pool would not show it)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3))
    model = BayesianClassifier(make_bayesian(net, packed=True), 3, autocast=autocast)
    return model.to(dtype=dtype, memory_format=torch.channels_last)


def _low_rank(model, init_loc_fn):
    return AutoLowRankPlusDiagonalNormal(model, rank=2, init_loc_fn=init_loc_fn)


OBJECTIVES = {
    # name: (eager objective, compiled objective, guide)
    "MAP": (TensorTrace_ELBO, lambda: JitTensorTrace_ELBO(jit_options=AOT_EAGER), AutoDelta),
    "SAM": (lambda: SharpnessAwareELBO(0.05), lambda: JitSharpnessAwareELBO(0.05, jit_options=AOT_EAGER), AutoDelta),
    "F-VI": (lambda: SharpnessAwareELBO(0.05), lambda: JitSharpnessAwareELBO(0.05, jit_options=AOT_EAGER),
             AutoNormal),
    "KL ball": (lambda: KLBallELBO(0.05), lambda: JitKLBallELBO(0.05, jit_options=AOT_EAGER), AutoNormal),
    "SA-BMA (low rank)": (lambda: KLBallELBO(0.05), lambda: JitKLBallELBO(0.05, jit_options=AOT_EAGER), _low_rank),
}
KERNELS = {
    "SGLD": lambda m, **o: SGLD(m, step_size=1e-3, init_strategy=init_to_network(m), **o),
    "cSGLD": lambda m, **o: SGLD(m, step_size=CyclicalStepSize(1e-3, 4, exploration_fraction=0.5),
                                 init_strategy=init_to_network(m), **o),
    "SGHMC": lambda m, **o: SGHMC(m, step_size=1e-3, init_strategy=init_to_network(m), **o),
    "Entropy-SGLD": lambda m, **o: EntropySGLD(m, eta=0.1, step_size=1e-3, num_inner_steps=2,
                                               init_strategy=init_to_network(m), **o),
    "Entropy-MCMC": lambda m, **o: EntropyMCMC(m, eta=0.1, step_size=1e-3, init_strategy=init_to_network(m), **o),
}
PRECISIONS = {"float64": (torch.float64, None), "bf16 autocast": (torch.float32, torch.bfloat16)}


def _svi_run(loss, guide_class, precision: str) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    dtype, autocast = PRECISIONS[precision]
    x, y = _images(dtype)
    pyro.clear_param_store()
    model = _pooled_cnn(dtype, autocast)
    svi = SVI(model, guide_class(model, init_loc_fn=init_to_network(model)), pyro.optim.Adam({"lr": 0.01}), loss)
    pyro.set_rng_seed(0)
    losses = [svi.step(x, y, subsample_size=8) for _ in range(STEPS)]
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    params.update({k: v.clone() for k, v in model.named_buffers() if "running" in k})
    return losses, params, torch.rand(())


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_compiled_objective_on_a_channels_last_pooled_network_is_the_eager_one(name, precision):
    # the same losses, parameters (so gradients) and BatchNorm statistics after every step, and the same next random
    # number; with no fallback to the eager path or the uncompiled graph
    pyro.enable_validation(False)
    eager, compiled, guide = OBJECTIVES[name]
    want = _svi_run(eager(), guide, precision)
    loss = compiled()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        got = _svi_run(loss, guide, precision)
    (captured,) = loss.captures()
    assert captured.compile_seconds is not None
    # the low-rank guide's density is one fused autograd node eagerly and plain operations in the graph (a graph
    # keeps no custom backward): the same maths, rounded differently (float32: a few units of 1e-7, after Adam)
    rtol = 1e-5 if guide is _low_rank and PRECISIONS[precision][0] == torch.float32 else 1e-7
    assert got[0] == pytest.approx(want[0], rel=rtol)
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], rtol=rtol, atol=0)
    assert got[2] == want[2]


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(KERNELS))
def test_compiled_kernel_on_a_channels_last_pooled_network_is_the_eager_chain(name, precision):
    pyro.enable_validation(False)
    dtype, autocast = PRECISIONS[precision]
    x, y = _images(dtype)

    def run(**options):
        kernel = KERNELS[name](_pooled_cnn(dtype, autocast), **options)
        pyro.set_rng_seed(0)
        mcmc = MCMC(kernel, num_samples=4, warmup_steps=1, disable_progbar=True)
        mcmc.run(x, y, subsample_size=8)
        return mcmc.get_samples(), torch.rand(()), kernel

    want, want_next, _ = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        got, got_next, kernel = run(jit_compile=True, jit_options=AOT_EAGER)
    assert [c.compile_seconds is not None for c in kernel._compiled.captures()] == [True]
    for site in want:
        torch.testing.assert_close(got[site], want[site], rtol=1e-7, atol=0)
    assert got_next == want_next


# ----------------------------------------------------------------------------------------- custom autograd Functions


class _Doubled(torch.autograd.Function):
    """``2 x`` whose backward is ``3 g``: a backward that is not the derivative of its forward (a straight-through
    estimator is the common case)."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad


def test_a_custom_function_on_the_differentiated_path_is_refused_by_name():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    outputs, captured = capture(lambda: _Doubled.apply(w).sum() + torch.randn(()), lambda: [w])
    assert isinstance(captured, CaptureError) and "_Doubled" in str(captured) and "custom_op" in str(captured)
    (grad,) = torch.autograd.grad(outputs, w)  # the eager step is kept, with its own backward
    torch.testing.assert_close(grad, torch.full((2,), 3.0))


def test_a_custom_function_inside_the_step_gradient_is_captured():
    # a kernel's gradient is computed inside the step: the Function's backward runs there and is recorded
    w = torch.tensor([1.0, 2.0], requires_grad=True)

    def step():
        with torch.enable_grad():
            leaf = w.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad((_Doubled.apply(leaf) ** 2).sum(), leaf)
        return grad

    outputs, captured = capture(step, lambda: [w])
    assert not isinstance(captured, CaptureError), captured
    with torch.no_grad():
        w.add_(1.0)
    torch.testing.assert_close(captured([w]), 3 * 2 * (2 * w.detach()))  # 3 g with g = d(y^2)/dy = 2y, y = 2w


# ----------------------------------------------------------------------------------------- precision of the check


def test_a_bf16_step_is_compared_at_bf16_precision_and_a_wrong_graph_still_refused():
    # the graph is replayed and compared with the eager step once, at capture. A GPU's kernels may sum in another
    # order from one call to the next (cuDNN's algorithm choice, atomics): at bf16 that moves results by a few units
    # of 2**-8, which a float32 tolerance (1e-5) called "not a pure function" (SGLD on an H200). A step that reads a
    # Python number which changes after the eager run is still refused.
    w = torch.randn(64, 64, dtype=torch.float32, requires_grad=True)  # autocast casts float32, not float64
    x = torch.randn(8, 64, dtype=torch.float32)
    calls = [0]

    def step():  # the bf16 rounding of the eager run differs from the replay's by a fraction of a unit
        calls[0] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = x @ (w * (1 + 1e-3 * (calls[0] > 1)))
        return out.float().sum(-1)

    _, captured = capture(step, lambda: [w])
    assert not isinstance(captured, CaptureError), captured
    bumps = [0.0]

    def impure():  # reads a Python number that the traced run sees changed: a 10 % change is not rounding
        bumps[0] += 0.1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ (w * (1 + bumps[0]))).float().sum(-1)

    _, captured = capture(impure, lambda: [w])
    assert isinstance(captured, CaptureError) and "not a pure function" in str(captured)
