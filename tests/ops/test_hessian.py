"""pyro_flat.ops.hessian against closed forms (quadratics) and dense Hessians (a small MLP)."""

from __future__ import annotations

import math

import pytest
import torch

from pyro_flat.ops.hessian import (
    hessian_vector_product,
    hutchinson_trace,
    hutchinson_trace_estimates,
    sam_sharpness,
    top_hessian_eigenpairs,
)
from pyro_flat.ops.tree import flatten, unflatten_like


def top_hessian_eigenvalues(*args, **kwargs):
    return top_hessian_eigenpairs(*args, **kwargs)[0]


def _quadratic(eigenvalues, shapes=((3,), (2, 2)), seed=0):
    """L = ½ θᵀAθ with A = Q diag(eigenvalues) Qᵀ, θ split into tensors of ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    eigenvalues = torch.as_tensor(eigenvalues, dtype=torch.float64)
    size = eigenvalues.numel()
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64))
    a = q @ torch.diag(eigenvalues) @ q.T
    a = (a + a.T) / 2
    sizes = [math.prod(s) for s in shapes]
    assert sum(sizes) == size
    params = unflatten_like(torch.randn(size, generator=g, dtype=torch.float64), [torch.empty(s) for s in shapes])

    def loss_fn(ps):
        theta = flatten(ps)
        return 0.5 * theta @ a @ theta

    return loss_fn, params, a


def _mlp_problem(seed=0, n=200):
    """A 5-8-3 tanh MLP (75 parameters) with mean cross-entropy on random data; float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    params = [
        torch.randn(8, 5, generator=g, dtype=torch.float64) / 5**0.5,
        torch.zeros(8, dtype=torch.float64),
        torch.randn(3, 8, generator=g, dtype=torch.float64) / 8**0.5,
        torch.zeros(3, dtype=torch.float64),
    ]

    def loss_fn(ps):
        w1, b1, w2, b2 = ps
        return torch.nn.functional.cross_entropy(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)

    def flat_loss(theta):
        return loss_fn(unflatten_like(theta, params))

    dense = torch.autograd.functional.hessian(flat_loss, flatten(params))
    return loss_fn, params, (dense + dense.T) / 2


@pytest.fixture(scope="module")
def mlp():
    return _mlp_problem()


# ---------------------------------------------------------------------------------------------------------------------
# Hessian-vector products
# ---------------------------------------------------------------------------------------------------------------------


def test_hvp_quadratic_is_a_times_v():
    loss_fn, params, a = _quadratic([4.0, 3.0, 2.0, 1.0, -1.0, -2.0, 0.5])
    v = unflatten_like(torch.randn(7), params)
    hv = hessian_vector_product(loss_fn, params, v)
    assert [h.shape for h in hv] == [p.shape for p in params]
    torch.testing.assert_close(flatten(hv), a @ flatten(v), rtol=1e-12, atol=1e-12)


def test_hvp_mlp_matches_dense(mlp):
    loss_fn, params, dense = mlp
    v = unflatten_like(torch.randn(dense.shape[0]), params)
    torch.testing.assert_close(flatten(hessian_vector_product(loss_fn, params, v)), dense @ flatten(v))


def test_hvp_leaves_no_graph_and_no_grad():
    loss_fn, params, _ = _quadratic([1.0] * 7)
    params = [p.requires_grad_(True) for p in params]
    before = [p.detach().clone() for p in params]
    hv = hessian_vector_product(loss_fn, params, [torch.ones_like(p) for p in params])
    assert all(h.grad_fn is None and not h.requires_grad for h in hv)
    assert all(p.grad is None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_hvp_of_a_linear_loss_is_zero():
    params = [torch.randn(3)]
    hv = hessian_vector_product(lambda ps: ps[0].sum(), params, [torch.ones(3)])
    assert torch.equal(hv[0], torch.zeros(3))
    assert torch.equal(top_hessian_eigenvalues(lambda ps: ps[0].sum(), params, 2), torch.zeros(2))


# ---------------------------------------------------------------------------------------------------------------------
# top eigenvalues
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "eigenvalues, k",
    [
        ([5.0, 3.0, 2.0, 1.0, 0.5, -1.0, -4.0], 3),
        ([2.0, 1.0, 0.5, 0.1, 0.0, -3.0, -7.0], 1),  # the most negative eigenvalue dominates in magnitude
        ([5.0, 5.0, 3.0, 2.0, 1.0, 0.0, -1.0], 3),  # a repeated top eigenvalue
        ([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0], 2),  # negative definite
    ],
)
def test_top_eigenvalues_quadratic_exact(eigenvalues, k):
    loss_fn, params, _ = _quadratic(eigenvalues)
    expected = torch.tensor(sorted(eigenvalues, reverse=True)[:k])
    got = top_hessian_eigenvalues(loss_fn, params, k, generator=torch.Generator().manual_seed(1))
    assert got.shape == (k,)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_top_eigenvalues_converge_when_krylov_space_is_smaller_than_p():
    # P = 200 > num_iters = 80: the Krylov space is never exhausted, so accuracy comes from convergence alone
    eigenvalues = torch.cat([torch.tensor([10.0, 8.0, 6.5]), torch.linspace(-2.0, 4.0, 197)])
    loss_fn, params, _ = _quadratic(eigenvalues, shapes=((200,),))
    got = top_hessian_eigenvalues(
        loss_fn, params, 3, num_iters=80, tol=1e-10, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(got, torch.tensor([10.0, 8.0, 6.5]), rtol=1e-6, atol=0)


def test_eigenpairs_are_orthonormal_eigenvectors():
    loss_fn, params, a = _quadratic([5.0, 3.0, 2.0, 1.0, 0.5, -1.0, -4.0])
    values, vectors = top_hessian_eigenpairs(loss_fn, params, 3)
    assert all([v.shape for v in vec] == [p.shape for p in params] for vec in vectors)
    flat = torch.stack([flatten(v) for v in vectors])
    torch.testing.assert_close(flat @ flat.T, torch.eye(3), atol=1e-10, rtol=0)
    torch.testing.assert_close(flat @ a, values[:, None] * flat, atol=1e-8, rtol=0)


def test_top_eigenvalues_mlp_match_dense(mlp):
    loss_fn, params, dense = mlp
    expected = torch.linalg.eigvalsh(dense).flip(0)[:3]
    got = top_hessian_eigenvalues(loss_fn, params, 3, tol=1e-8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    # with the default tolerance the top eigenvalue is already accurate to far better than tol
    top = top_hessian_eigenvalues(loss_fn, params, num_iters=40, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(top, expected[:1], rtol=1e-6, atol=0)


def test_top_eigenvalues_same_generator_seed_same_result(mlp):
    loss_fn, params, _ = mlp
    runs = [
        top_hessian_eigenvalues(loss_fn, params, 2, num_iters=10, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    assert torch.equal(*runs)


def test_float32_stays_float32():
    loss_fn, params, _ = _quadratic([5.0, 3.0, 2.0, 1.0, 0.5, -1.0, -4.0])
    params32 = [p.float() for p in params]

    def loss_fn_32(ps):
        return loss_fn([p.double() for p in ps]).float()

    got = top_hessian_eigenvalues(loss_fn_32, params32, 2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([5.0, 3.0]), rtol=1e-4, atol=1e-4, check_dtype=False)
    assert hutchinson_trace(loss_fn_32, params32, num_samples=2).dtype == torch.float32
    assert sam_sharpness(loss_fn_32, params32, 0.1).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Hutchinson trace
# ---------------------------------------------------------------------------------------------------------------------


def test_hutchinson_is_exact_for_a_diagonal_hessian():
    # v^T D v = sum_i D_ii v_i^2 = tr D for every Rademacher v
    d = torch.tensor([3.0, -1.0, 0.5, 2.0])
    params = [torch.randn(4)]
    estimates = hutchinson_trace_estimates(lambda ps: 0.5 * (d * ps[0] ** 2).sum(), params, num_samples=5)
    torch.testing.assert_close(estimates, torch.full((5,), float(d.sum())))


def test_hutchinson_mlp_within_its_standard_error(mlp):
    """Rademacher probes: Var[vᵀHv] = 2 Σ_{i≠j} H_ij², known from the dense H. z < 4.5 (false alarm 7e-6)."""
    loss_fn, params, dense = mlp
    num_samples = 1000
    estimates = hutchinson_trace_estimates(
        loss_fn, params, num_samples=num_samples, generator=torch.Generator().manual_seed(0)
    )
    variance = 2 * (dense.square().sum() - dense.diagonal().square().sum())
    # the empirical variance of the probes agrees with the formula (chi-square with 999 dof: +-20 % is > 4 sigma)
    assert 0.8 < float(estimates.var() / variance) < 1.2
    z = (estimates.mean() - dense.trace()) / (variance / num_samples).sqrt()
    assert abs(float(z)) < 4.5
    torch.testing.assert_close(
        hutchinson_trace(loss_fn, params, num_samples=num_samples, generator=torch.Generator().manual_seed(0)),
        estimates.mean(),
    )


# ---------------------------------------------------------------------------------------------------------------------
# SAM sharpness
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rho", [0.0, 0.05, 0.5])
def test_sam_sharpness_quadratic_closed_form(rho):
    loss_fn, params, a = _quadratic([5.0, 3.0, 2.0, 1.0, 0.5, -1.0, -4.0])
    g = a @ flatten(params)
    expected = rho * g.norm() + rho**2 * (g @ a @ g) / (2 * g.norm() ** 2)
    torch.testing.assert_close(sam_sharpness(loss_fn, params, rho), expected, rtol=1e-10, atol=1e-14)


def test_sam_sharpness_zero_gradient_is_zero():
    loss_fn, _, _ = _quadratic([1.0] * 7)
    params = [torch.zeros(3), torch.zeros(2, 2)]
    assert float(sam_sharpness(loss_fn, params, 0.1)) == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------


def test_validation_errors():
    loss_fn, params, _ = _quadratic([1.0] * 7)
    with pytest.raises(ValueError, match="`k` must be an int >= 1"):
        top_hessian_eigenvalues(loss_fn, params, 0)
    with pytest.raises(ValueError, match=r"`k` must be <= the number of parameters \(7\)"):
        top_hessian_eigenvalues(loss_fn, params, 8)
    with pytest.raises(ValueError, match="`num_iters` must be >= k"):
        top_hessian_eigenvalues(loss_fn, params, 3, num_iters=2)
    with pytest.raises(ValueError, match="`tol` must be a finite number > 0"):
        top_hessian_eigenvalues(loss_fn, params, tol=0.0)
    with pytest.raises(ValueError, match="`num_samples` must be an int >= 1"):
        hutchinson_trace(loss_fn, params, num_samples=0)
    with pytest.raises(ValueError, match="`params` must hold at least one tensor"):
        hutchinson_trace(loss_fn, [])
    with pytest.raises(ValueError, match="`params` must be a sequence of tensors"):
        hutchinson_trace(loss_fn, torch.zeros(7))
    with pytest.raises(ValueError, match=r"`params\[1\]` must be a floating-point tensor"):
        hutchinson_trace(loss_fn, [params[0], torch.zeros(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="`params` must share one dtype"):
        hutchinson_trace(loss_fn, [params[0], params[1].float()])
    with pytest.raises(ValueError, match="`loss_fn` must return a scalar"):
        hutchinson_trace(lambda ps: flatten(ps), params)
    with pytest.raises(ValueError, match=r"`vector\[1\]` must have shape \(2, 2\)"):
        hessian_vector_product(loss_fn, params, [torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match="`vector` must hold one tensor per parameter"):
        hessian_vector_product(loss_fn, params, [torch.ones(3)])
    with pytest.raises(ValueError, match="`rho` must be a finite number >= 0"):
        sam_sharpness(loss_fn, params, -0.1)
