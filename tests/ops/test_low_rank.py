"""pyro_flat.ops.low_rank: the Woodbury density, the draws and their hand-written gradients against torch's
``LowRankMultivariateNormal`` differentiated by autograd (float64: agreement to rounding)."""

from __future__ import annotations

import pyro
import pytest
import torch
from torch.distributions import LowRankMultivariateNormal

from pyro_flat.infer.autoguide.low_rank import ScaledLowRankMultivariateNormal
from pyro_flat.ops import low_rank
from pyro_flat.ops.low_rank import (
    low_rank_capacitance_tril,
    low_rank_log_prob,
    low_rank_rsample,
    low_rank_rsample_and_log_prob,
    low_rank_variance,
    row_dot,
)
from pyro_flat.testing import HostSyncCounter

P, K = 7, 3


def _parameters(batch=(), seed=0):
    generator = torch.Generator().manual_seed(seed)
    loc = torch.randn(*batch, P, generator=generator, dtype=torch.float64)
    diag = torch.rand(*batch, P, generator=generator, dtype=torch.float64) + 0.3
    factor = torch.randn(*batch, P, K, generator=generator, dtype=torch.float64)
    return [t.requires_grad_() for t in (loc, diag, factor)]


def _torch_log_prob(value, loc, diag, factor, relative):
    if relative:  # Sigma = diag(s)(I + V V^T)diag(s): W = diag(s) V, D = s^2 (Pyro's AutoLowRankMultivariateNormal)
        return LowRankMultivariateNormal(loc, factor * diag.unsqueeze(-1), diag.square()).log_prob(value)
    return LowRankMultivariateNormal(loc, factor, diag).log_prob(value)


def _grads(output, inputs):
    return torch.autograd.grad(output, inputs)


@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("value_batch, parameter_batch", [((), ()), ((4,), ()), ((4, 2), ()), ((3,), (3,)),
                                                           ((2, 3), (3,))])
def test_log_prob_and_its_gradients_equal_torch(relative, value_batch, parameter_batch):
    loc, diag, factor = _parameters(parameter_batch)
    value = torch.randn(*value_batch, P, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(torch.broadcast_shapes(value_batch, parameter_batch), dtype=torch.float64)
    inputs = (value, loc, diag, factor)
    ours = low_rank_log_prob(value, loc, diag, factor, relative=relative)
    expected = _torch_log_prob(value, loc, diag, factor, relative)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads((weights * ours).sum(), inputs), _grads((weights * expected).sum(), inputs),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("relative", [True, False])
def test_log_prob_gradients_for_a_subset_of_inputs(relative):
    loc, diag, factor = _parameters()
    value = torch.randn(5, P, dtype=torch.float64)
    for inputs in ((factor,), (diag,), (loc, factor)):
        got = _grads(low_rank_log_prob(value, loc, diag, factor, relative=relative).sum(), inputs)
        want = _grads(_torch_log_prob(value, loc, diag, factor, relative).sum(), inputs)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("relative", [True, False])
def test_draws_are_the_reparameterised_map_and_have_its_gradients(relative):
    loc, diag, factor = _parameters()
    z1, z2 = torch.randn(6, P, dtype=torch.float64), torch.randn(6, K, dtype=torch.float64)
    draw = low_rank_rsample(loc, diag, factor, z1, z2, relative=relative)
    if relative:
        expected = loc + diag * (z1 + z2 @ factor.T)
    else:
        expected = loc + diag.sqrt() * z1 + z2 @ factor.T
    torch.testing.assert_close(draw, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn(6, P, dtype=torch.float64)
    for g, w in zip(_grads((weights * draw).sum(), (loc, diag, factor)),
                    _grads((weights * expected).sum(), (loc, diag, factor)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sample_batch, parameter_batch", [((), ()), ((5,), ()), ((2, 3), ()), ((3,), (3,))])
def test_draw_scored_in_one_node_equals_draw_then_torch_density(sample_batch, parameter_batch):
    # an ELBO's use: f(theta) + log q(theta) at a reparameterised theta, both differentiated in (m, s, V)
    loc, scale, factor = _parameters(parameter_batch)
    shape = torch.broadcast_shapes(sample_batch, parameter_batch)
    z1, z2 = torch.randn(*shape, P, dtype=torch.float64), torch.randn(*shape, K, dtype=torch.float64)
    target = torch.randn(P, dtype=torch.float64)

    value, log_prob = low_rank_rsample_and_log_prob(loc, scale, factor, z1, z2)
    expected_value = loc + scale * (z1 + (factor @ z2.unsqueeze(-1)).squeeze(-1))
    expected_log_prob = _torch_log_prob(expected_value, loc, scale, factor, True)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(log_prob, expected_log_prob, rtol=1e-12, atol=1e-12)

    def objective(v, lp):
        return ((v - target).square().sum(-1) * lp.detach().exp() + 0.7 * lp + lp.square()).sum()

    for g, w in zip(_grads(objective(value, log_prob), (loc, scale, factor)),
                    _grads(objective(expected_value, expected_log_prob), (loc, scale, factor)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_blocked_reductions_equal_the_direct_ones(monkeypatch):
    monkeypatch.setattr(low_rank, "BLOCK_BYTES", 2 * K * 8)  # two float64 rows a block: several, the last one partial
    _, diag, factor = (t.detach() for t in _parameters())
    other = torch.randn(P, K, dtype=torch.float64)
    torch.testing.assert_close(row_dot(factor, other), (factor * other).sum(-1))
    torch.testing.assert_close(low_rank_variance(diag, factor), diag.square() * (1 + factor.square().sum(-1)))
    torch.testing.assert_close(low_rank_variance(diag, factor, relative=False), diag + factor.square().sum(-1))
    capacitance = torch.eye(K, dtype=torch.float64) + (factor / diag.unsqueeze(-1)).T @ factor
    tril = low_rank_capacitance_tril(factor, diag)
    torch.testing.assert_close(tril @ tril.T, capacitance)
    value = torch.randn(4, P, dtype=torch.float64)
    torch.testing.assert_close(low_rank_log_prob(value, torch.zeros(P, dtype=torch.float64), diag, factor,
                                                 relative=False),
                               LowRankMultivariateNormal(torch.zeros(P, dtype=torch.float64), factor, diag)
                               .log_prob(value))


def test_only_the_factor_itself_is_kept_for_the_backward_pass():
    # the memory claim: a draw scored in one node keeps no P x K tensor but the factor for its backward pass, where
    # torch's LowRankMultivariateNormal at W = diag(s) V keeps W, W / D and more
    big_p, rank = 4096, 8
    loc = torch.zeros(big_p, requires_grad=True)
    scale = torch.full((big_p,), 0.1, requires_grad=True)
    factor = (0.1 * torch.randn(big_p, rank)).requires_grad_()
    sizes = []

    def record(tensor):
        sizes.append(tensor.numel())
        return tensor

    z1, z2 = torch.randn(big_p), torch.randn(rank)
    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        value, log_prob = low_rank_rsample_and_log_prob(loc, scale, factor, z1, z2)
    assert max(sizes) == big_p * rank and sizes.count(big_p * rank) == 1  # only the factor itself is saved
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        expected = low_rank_rsample(loc, scale, factor, z1, z2)
        _torch_log_prob(expected, loc, scale, factor, True)
    assert sizes.count(big_p * rank) >= 3  # what the lean node avoids


def test_gradients_reach_tensors_swapped_by_a_torch_function_mode():
    # KLBallELBO's perturbed pass swaps the guide's parameters for phi + delta with a TorchFunctionMode, which does not
    # reach a custom autograd Function's inputs: the backward pass must still use the swapped tensors
    from pyro_flat.infer.replay import substituted_tensors

    loc, scale, factor = _parameters()
    moved = [(t, t + 0.1 * torch.randn_like(t)) for t in (loc, scale, factor)]
    z1, z2, target = torch.randn(P, dtype=torch.float64), torch.randn(K, dtype=torch.float64), torch.randn(P)
    with substituted_tensors(moved):
        value, log_prob = low_rank_rsample_and_log_prob(loc, scale, factor, z1, z2)
        density = low_rank_log_prob(target, loc, scale, factor)
    expected_value, expected_log_prob = low_rank_rsample_and_log_prob(*(new for _, new in moved), z1, z2)
    expected_density = low_rank_log_prob(target, *(new for _, new in moved))
    for got, want in ((value, expected_value), (log_prob, expected_log_prob), (density, expected_density)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        weights = torch.randn_like(got)
        for g, w in zip(torch.autograd.grad((weights * got).sum(), (loc, scale, factor), retain_graph=True),
                        torch.autograd.grad((weights * want).sum(), (loc, scale, factor), retain_graph=True),
                        strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_blocked_reductions_of_a_large_factor_take_few_operations():
    # the number of operations (GPU kernel launches) of a blocked reduction is set by the bytes of its temporary, not
    # by the rows: ResNet-18's 11.2 M rows at rank 5 in float32 take 4 blocks (blocks of 32,768 rows took 342, and the
    # low-rank KL-ball step twice the diagonal one's time on an H200). Checked on 1 M rows: one block
    from torch.utils._python_dispatch import TorchDispatchMode

    class Operations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    rows, rank = 1 << 20, 5
    factor, other = torch.zeros(rows, rank, dtype=torch.float32), torch.ones(rows, rank, dtype=torch.float32)
    with Operations() as operations:
        row_dot(factor, other)
    assert len(operations.names) <= 10, operations.names  # one block (the 32,768-row blocks made 32: 160 operations)
    assert len(low_rank._row_blocks(torch.empty(11_200_000, rank, dtype=torch.float32, device="meta"))) == 4


@pytest.mark.parametrize("relative", [True, False])
def test_a_failed_factorisation_is_nan_on_the_device_and_an_error_when_checked(relative):
    # the capacitance is positive definite for every finite factor: it fails when V^T V overflows (here float32)
    loc, diag, factor = (t.detach().float() for t in _parameters())
    factor[2] = 1e20
    value = torch.zeros(P, dtype=torch.float32)
    variance = None if relative else diag
    with HostSyncCounter() as syncs:  # no host read: the status stays on the device and turns into NaN
        tril = low_rank_capacitance_tril(factor, variance)
        log_prob = low_rank_log_prob(value, loc, diag, factor, relative=relative)
        if relative:
            _, scored = low_rank_rsample_and_log_prob(loc, diag, factor, value, value[:K])
    assert syncs.count == 0, syncs.report()
    assert tril.isnan().all() and log_prob.isnan()
    if relative:
        assert scored.isnan()
    form = "I \\+ V\\^T V" if relative else "I \\+ W\\^T diag\\(d\\)\\^-1 W"
    match = f"the capacitance {form} \\(3 x 3\\) is not positive definite .*overflow torch.float32"
    with pytest.raises(ValueError, match=match):
        low_rank_capacitance_tril(factor, variance, check_errors=True)
    with pytest.raises(ValueError, match=match):
        low_rank_log_prob(value, loc, diag, factor, relative=relative, check_errors=True)


def test_the_guides_distribution_reports_a_failed_factorisation_under_validation():
    loc, scale, factor = (t.detach().float() for t in _parameters())
    factor[2] = 1e20  # finite: passes the distribution's argument checks
    with pyro.validation_enabled(True):
        posterior = ScaledLowRankMultivariateNormal(loc, scale, factor.requires_grad_())
        with pytest.raises(ValueError, match="the capacitance I \\+ V\\^T V .* is not positive definite"):
            posterior.log_prob(torch.zeros(P, dtype=torch.float32))
        with pytest.raises(ValueError, match="the capacitance I \\+ V\\^T V .* is not positive definite"):
            posterior.rsample()
    with pyro.validation_enabled(False):
        posterior = ScaledLowRankMultivariateNormal(loc, scale, factor)
        assert posterior.log_prob(posterior.rsample()).isnan()
