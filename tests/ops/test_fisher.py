"""pyro_flat.ops.fisher and pyro_flat.ops.low_rank: closed forms against Monte Carlo, autograd and dense algebra."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch.distributions import kl_divergence, transform_to

from pyro_flat.ops.fisher import (
    diagonal_gaussian_fisher,
    diagonal_gaussian_inverse_fisher_product,
    kl_ball_step,
    low_rank_gaussian_inverse_fisher_product,
    normalized_score_step,
)
from pyro_flat.ops.low_rank import low_rank_covariance_product, swag_to_low_rank
from pyro_flat.ops.sam import sam_perturbation


def _autonormal_parameters(d=4):
    """loc, unconstrained scale and scale transform of a real AutoNormal guide (softplus scale)."""

    def model():
        pyro.sample("z", dist.Normal(0.0, 1.0).expand([d]).to_event(1))

    guide = AutoNormal(model)
    guide()
    loc = torch.tensor([0.3, -1.0, 2.0, 0.0])
    raw = torch.tensor([-1.5, 0.0, 0.7, -3.0])  # softplus^-1 of the scales
    return loc, raw, transform_to(guide.scale_constraint)


@pytest.mark.statistical
def test_closed_form_fisher_of_autonormal_matches_monte_carlo():
    # F = E[s s^T] with s = grad_(loc, u) log N(x; loc, softplus(u)); n = 200 000 independent draws (ESS = n),
    # seed 0; every one of the 36 entries of the 8x8 matrix is z-tested against the closed form with k = 4.5
    # (two-sided false-failure rate 7e-6 each, 2.5e-4 in total).
    loc, raw, transform = _autonormal_parameters()
    scale = transform(raw)
    n, d = 200_000, loc.numel()
    x = dist.Normal(loc, scale).sample((n,))
    loc_b = loc.expand(n, d).clone().requires_grad_()
    raw_b = raw.expand(n, d).clone().requires_grad_()
    log_q = dist.Normal(loc_b, transform(raw_b)).log_prob(x).sum()
    score_loc, score_raw = torch.autograd.grad(log_q, [loc_b, raw_b])
    scores = torch.cat([score_loc, score_raw], dim=1)  # [n, 2d], per-draw scores
    products = scores.unsqueeze(2) * scores.unsqueeze(1)  # [n, 2d, 2d]
    mc, se = products.mean(0), products.std(0) / math.sqrt(n)

    scale_derivative = transform.log_abs_det_jacobian(raw, scale).exp()
    fisher_loc, fisher_raw = diagonal_gaussian_fisher(scale, scale_derivative)
    exact = torch.diag(torch.cat([fisher_loc, fisher_raw]))
    assert torch.allclose(scale_derivative, torch.sigmoid(raw))  # softplus' = sigmoid
    z = (mc - exact).abs() / se.clamp(min=1e-12)
    assert z.max() < 4.5, z


def test_log_scale_parameterisation_gives_fisher_two():
    scale = torch.tensor([0.1, 1.0, 5.0])
    _, fisher_log_scale = diagonal_gaussian_fisher(scale, scale)  # s = exp(u): ds/du = s
    assert torch.allclose(fisher_log_scale, torch.full_like(scale, 2.0))


def test_kl_ball_step_has_fisher_norm_radius_and_zero_gradient_is_finite():
    g = torch.randn(7, dtype=torch.float64)
    fisher = torch.rand(7, dtype=torch.float64) + 0.1
    for radius in (0.0, 1e-3, 0.5):
        (delta,) = kl_ball_step([g], [g / fisher], radius)
        assert torch.allclose(0.5 * (delta * fisher * delta).sum(), torch.tensor(radius, dtype=torch.float64))
        assert torch.allclose(delta, math.sqrt(2 * radius) * (g / fisher) / (g * g / fisher).sum().sqrt())
    (delta,) = kl_ball_step([torch.zeros(3)], [torch.zeros(3)], 0.1)
    assert torch.equal(delta, torch.zeros(3))


def test_fixed_isotropic_scale_gives_sam_step():
    # closed form: delta* = sqrt(2 rho) s^2 g / ||s g||; isotropic s: SAM's step with radius s sqrt(2 rho)
    g = torch.randn(5, dtype=torch.float64)
    for scale in (torch.full((5,), 0.3, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.1):
        direction, _ = diagonal_gaussian_inverse_fisher_product(g, None, scale, torch.ones_like(scale))
        (delta,) = kl_ball_step([g], [direction], 0.02)
        closed = math.sqrt(2 * 0.02) * scale**2 * g / (scale * g).norm()
        assert torch.allclose(delta, closed, rtol=1e-12, atol=0)
    s = 0.3
    (sam,) = sam_perturbation([g], s * math.sqrt(2 * 0.02))
    (delta,) = kl_ball_step([g], [s**2 * g], 0.02)
    assert torch.allclose(delta, sam, rtol=1e-12, atol=0)


def test_kl_of_the_step_tends_to_the_radius_for_a_diagonal_gaussian():
    loc, raw, transform = _autonormal_parameters()
    scale = transform(raw)
    derivative = transform.log_abs_det_jacobian(raw, scale).exp()
    g_loc, g_raw = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    directions = diagonal_gaussian_inverse_fisher_product(g_loc, g_raw, scale, derivative)
    errors = []
    for radius in (1e-2, 1e-4, 1e-6):
        d_loc, d_raw = kl_ball_step([g_loc, g_raw], list(directions), radius)
        kl = kl_divergence(dist.Normal(loc + d_loc, transform(raw + d_raw)), dist.Normal(loc, scale)).sum()
        errors.append(abs(kl.item() / radius - 1))
    assert errors[0] > errors[1] > errors[2]  # the second-order error vanishes as the radius shrinks
    assert errors[2] < 1e-2


def _low_rank(loc, raw, factor, transform):
    """N(m, diag(s)(I + VV^T)diag(s)), s = T(u), as Pyro's AutoLowRankMultivariateNormal builds it."""
    scale = transform(raw)
    return dist.LowRankMultivariateNormal(loc, factor * scale.unsqueeze(-1), scale**2)


def _low_rank_kl(loc, raw, factor, transform):
    """The function phi' -> KL(q_phi' || q_phi) of the low-rank-plus-diagonal family (for its Hessian = Fisher)."""
    p, k = factor.shape
    base = _low_rank(loc, raw, factor, transform)

    def kl(flat):
        m, u, v = flat[:p], flat[p : 2 * p], flat[2 * p :].reshape(p, k)
        return kl_divergence(_low_rank(m, u, v, transform), base)

    return kl


def test_low_rank_fisher_approximation_is_exact_in_the_mean_and_an_upper_bound():
    p, k = 3, 2
    loc = torch.tensor([0.5, -0.2, 1.0])
    raw = torch.tensor([-0.5, 0.3, -1.2])
    factor = torch.tensor([[0.4, -0.1], [0.2, 0.3], [-0.5, 0.6]])
    transform = transform_to(dist.constraints.softplus_positive)
    flat = torch.cat([loc, raw, factor.reshape(-1)])
    exact = torch.autograd.functional.hessian(_low_rank_kl(loc, raw, factor, transform), flat)  # the true Fisher
    # the approximation, as a dense matrix: apply F~^{-1} to unit vectors, then invert
    scale = transform(raw)
    derivative = transform.log_abs_det_jacobian(raw, scale).exp()
    columns = []
    for e in torch.eye(flat.numel()):
        parts = low_rank_gaussian_inverse_fisher_product(
            e[:p], e[p : 2 * p], e[2 * p :].reshape(p, k), scale, derivative, factor
        )
        columns.append(torch.cat([parts[0], parts[1], parts[2].reshape(-1)]))
    approx = torch.linalg.inv(torch.stack(columns, dim=1))
    cov = torch.diag(scale) @ (torch.eye(p) + factor @ factor.T) @ torch.diag(scale)
    assert torch.allclose(approx[:p, :p], torch.linalg.inv(cov), atol=1e-10)  # exact mean block Sigma^{-1}
    assert torch.allclose(exact[:p, :p], torch.linalg.inv(cov), atol=1e-8)
    assert torch.allclose(exact[:p, p:], torch.zeros(p, flat.numel() - p), atol=1e-8)  # mean/cov decouple
    assert torch.linalg.eigvalsh(approx - exact).min() > -1e-8  # F~ >= F: the step stays inside the KL ball
    # a block held fixed: the others use their own sub-block of F~ (the inverse of the sub-block, not a sub-block
    # of the inverse)
    g_u, g_v = torch.randn(p), torch.randn(p, k)
    _, x_u, none = low_rank_gaussian_inverse_fisher_product(None, g_u, None, scale, derivative, factor)
    assert none is None and torch.allclose(x_u, torch.linalg.solve(approx[p : 2 * p, p : 2 * p], g_u))
    _, none, x_v = low_rank_gaussian_inverse_fisher_product(None, None, g_v, scale, derivative, factor)
    expected = torch.linalg.solve(approx[2 * p :, 2 * p :], g_v.reshape(-1))
    assert none is None and torch.allclose(x_v.reshape(-1), expected)


def test_normalized_score_step_moves_each_block_by_rho():
    blocks = [[torch.randn(3), torch.randn(2, 2)], [torch.randn(4)]]
    steps = normalized_score_step(blocks, 0.125)  # the authors' README rho = 0.5 = sqrt(2 * 0.125)
    for block, step in zip(blocks, steps, strict=True):
        norm = torch.sqrt(sum((s**2).sum() for s in step))
        assert torch.allclose(norm, torch.tensor(0.5, dtype=norm.dtype))
        ratio = step[0] / block[0]
        assert torch.allclose(ratio, ratio[0].expand_as(ratio)) and ratio[0] > 0
    with pytest.raises(ValueError, match="non-empty"):
        normalized_score_step([[]], 0.1)


@pytest.mark.parametrize("radius", [-1.0, float("nan"), float("inf"), True, "0.1"])
def test_invalid_radius_is_rejected(radius):
    with pytest.raises(ValueError, match="`radius`"):
        kl_ball_step([torch.ones(2)], [torch.ones(2)], radius)
    with pytest.raises(ValueError, match="`radius`"):
        normalized_score_step([[torch.ones(2)]], radius)


def test_low_rank_covariance_product_and_swag_conversion():
    p, k = 6, 4
    mean, variance = torch.randn(p), torch.rand(p) + 0.1
    deviations = torch.randn(p, k)
    loc, scale, factor = swag_to_low_rank(mean, variance, deviations, scale=0.5)
    swag_cov = 0.5 * (torch.diag(variance) + deviations @ deviations.T / (k - 1))  # SWAG's sampling covariance
    assert torch.equal(loc, mean) and loc is not mean
    absolute = factor * scale.unsqueeze(-1)  # W = diag(s) V
    assert torch.allclose(torch.diag(scale**2) + absolute @ absolute.T, swag_cov)
    v = torch.randn(2, p)
    assert torch.allclose(low_rank_covariance_product(scale, factor, v), v @ swag_cov.T)
    _, clamped, _ = swag_to_low_rank(mean, -variance, deviations[:, :1])
    assert (clamped > 0).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mean": torch.zeros(2, 2)}, "`mean`"),
        ({"variance": torch.ones(3)}, "`variance`"),
        ({"deviations": torch.ones(4, 2)}, "`deviations`"),
        ({"scale": 0.0}, "`scale`"),
        ({"min_variance": 0.0}, "`min_variance`"),
    ],
)
def test_swag_conversion_rejects_bad_input(kwargs, match):
    args = {"mean": torch.zeros(2), "variance": torch.ones(2), "deviations": torch.ones(2, 3)}
    options = {k: kwargs.pop(k) for k in ("scale", "min_variance") if k in kwargs}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        swag_to_low_rank(args["mean"], args["variance"], args["deviations"], **options)
