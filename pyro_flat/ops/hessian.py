r"""Curvature of a loss: Hessian-vector products, top eigenvalues, trace and SAM sharpness.

Every function takes a loss as a *function of a list of tensors*, ``loss_fn(params) -> scalar``, and the point
``params`` at which to evaluate it. Let :math:`\theta\in\mathbb R^P` be all tensors of ``params`` flattened and
concatenated (:func:`pyro_flat.ops.tree.flatten`), :math:`L(\theta)` the loss and
:math:`H=\nabla^2_\theta L(\theta)` its Hessian, with eigenvalues :math:`\lambda_1\ge\lambda_2\ge\dots\ge\lambda_P`.

* :func:`hessian_vector_product` — :math:`Hv` by double backward (Pearlmutter's trick [1]); :math:`H` is never formed.
* :func:`top_hessian_eigenpairs` — the :math:`k` algebraically largest
  eigenvalues (and unit eigenvectors) by the Lanczos method with full reorthogonalisation [2].
* :func:`hutchinson_trace` — :math:`\operatorname{tr}H` by Hutchinson's estimator with Rademacher probes [3].
* :func:`sam_sharpness` — the SAM sharpness :math:`L(\theta+\hat\epsilon)-L(\theta)` [4].

The functions never touch the caller's tensors: they differentiate fresh leaves that share storage with ``params``
(``p.detach().requires_grad_()``), so ``params`` may or may not require grad, no ``.grad`` is written, and every
returned tensor is detached. Computation stays on the device and dtype of ``params``. ``loss_fn`` must compute the
loss *from its argument* (a closure over a module's own parameters is not differentiated): use
:func:`pyro_flat.metrics.network_loss_fn` or :func:`pyro_flat.metrics.model_loss_fn` to build one.

References:
    * [1] `Fast Exact Multiplication by the Hessian`, Barak A. Pearlmutter (Neural Computation 1994),
      doi:10.1162/neco.1994.6.1.147
    * [2] `Matrix Computations` (4th ed.), Gene H. Golub, Charles F. Van Loan (2013), §10.1–10.3
    * [3] `A Stochastic Estimator of the Trace of the Influence Matrix for Laplacian Smoothing Splines`,
      M. F. Hutchinson (Communications in Statistics 1990), doi:10.1080/03610919008812866
    * [4] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
      Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
    * [5] `PyHessian: Neural Networks Through the Lens of the Hessian`, Zhewei Yao, Amir Gholami, Kurt Keutzer,
      Michael W. Mahoney (2020), arXiv:1912.07145
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._validation import check_int, check_real
from .sam import check_radius, sam_perturbation
from .tree import flatten, unflatten_like

LossFn = Callable[[list[Tensor]], Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# validation and the Hessian-vector operator
# ---------------------------------------------------------------------------------------------------------------------


def _fresh_leaves(params: Sequence[Tensor]) -> list[Tensor]:
    """Validate ``params`` and return new leaves (sharing storage) that require grad."""
    if isinstance(params, Tensor):
        raise ValueError("`params` must be a sequence of tensors, got a single tensor: wrap it in a list")
    params = list(params)
    if not params:
        raise ValueError("`params` must hold at least one tensor, got an empty sequence")
    first = params[0]
    for i, p in enumerate(params):
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise ValueError(f"`params[{i}]` must be a floating-point tensor, got {type(p).__name__}")
        if p.dtype != first.dtype or p.device != first.device:
            raise ValueError(
                f"`params` must share one dtype and device: params[0] is {first.dtype} on {first.device}, "
                f"params[{i}] is {p.dtype} on {p.device}"
            )
    return [p.detach().requires_grad_(True) for p in params]



def _check_generator(generator: torch.Generator | None, like: Tensor) -> None:
    if generator is not None and torch.device(generator.device).type != like.device.type:
        raise ValueError(f"`generator` is on {generator.device}, expected one on the parameters' device {like.device}")


def _evaluate_loss(loss_fn: LossFn, leaves: list[Tensor]) -> Tensor:
    loss = loss_fn(leaves)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"`loss_fn` must return a scalar tensor, got {shape}")
    return loss.reshape(())


def _hvp_operator(loss_fn: LossFn, leaves: list[Tensor]) -> Callable[[Tensor], Tensor]:
    r"""Return :math:`v\mapsto Hv` on flat vectors.

    The gradient :math:`g(\theta)` is computed once with ``create_graph=True``; each product is then one backward
    pass of :math:`v^\top g` (``retain_graph=True``). The graph lives only as long as the returned closure.
    """
    with torch.enable_grad():
        loss = _evaluate_loss(loss_fn, leaves)
        if not loss.requires_grad:  # the loss does not depend on params at all
            return torch.zeros_like
        grads = torch.autograd.grad(loss, leaves, create_graph=True, materialize_grads=True)
    flat_grad = flatten(grads)
    if not flat_grad.requires_grad:  # the loss is at most linear in params: H = 0
        return torch.zeros_like

    def hvp(v: Tensor) -> Tensor:
        hv = torch.autograd.grad(flat_grad, leaves, grad_outputs=v, retain_graph=True, materialize_grads=True)
        return flatten(hv)

    return hvp


def hessian_vector_product(loss_fn: LossFn, params: Sequence[Tensor], vector: Sequence[Tensor]) -> list[Tensor]:
    r"""The Hessian-vector product :math:`Hv=\nabla_\theta\big(\nabla_\theta L(\theta)^\top v\big)`.

    Computed by double backward with :func:`torch.autograd.grad`: one forward pass, one backward pass with
    ``create_graph=True`` and one more backward pass, so about three times the cost of a gradient. The graph is
    freed before returning.

    :param loss_fn: :math:`L`, maps a list of tensors shaped like ``params`` to a scalar tensor.
    :param params: the point :math:`\theta`, a sequence of floating-point tensors on one device and dtype.
    :param vector: :math:`v`, tensors shaped like ``params``.
    :returns: :math:`Hv`, detached tensors shaped like ``params``.
    """
    leaves = _fresh_leaves(params)
    if isinstance(vector, Tensor):
        raise ValueError("`vector` must be a sequence of tensors shaped like `params`, got a single tensor")
    vector = list(vector)
    if len(vector) != len(leaves):
        raise ValueError(f"`vector` must hold one tensor per parameter ({len(leaves)}), got {len(vector)}")
    for i, (v, p) in enumerate(zip(vector, leaves, strict=True)):
        if not isinstance(v, Tensor) or v.shape != p.shape:
            shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"`vector[{i}]` must have shape {tuple(p.shape)} like params[{i}], got {shape}")
    flat_v = flatten([v.detach().to(dtype=leaves[0].dtype, device=leaves[0].device) for v in vector])
    return unflatten_like(_hvp_operator(loss_fn, leaves)(flat_v), leaves)


# ---------------------------------------------------------------------------------------------------------------------
# top eigenvalues: Lanczos with full reorthogonalisation
# ---------------------------------------------------------------------------------------------------------------------


def _orthogonalize(w: Tensor, basis: Tensor) -> Tensor:
    """Remove from ``w`` its components along the (orthonormal) rows of ``basis``; twice, for stability."""
    for _ in range(2):
        w = w - basis.T @ (basis @ w)
    return w


def _random_unit(basis: Tensor, generator: torch.Generator | None) -> Tensor:
    v = torch.randn(basis.shape[1], generator=generator, dtype=basis.dtype, device=basis.device)
    v = _orthogonalize(v, basis)
    return v / torch.linalg.vector_norm(v)


def _tridiagonal(alphas: list[Tensor], betas: list[Tensor]) -> Tensor:
    t = torch.diag(torch.stack(alphas))
    if betas:
        off = torch.stack(betas)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    return t


def _lanczos(
    hvp: Callable[[Tensor], Tensor],
    num_params: int,
    k: int,
    num_iters: int,
    tol: float,
    generator: torch.Generator | None,
    like: Tensor,
) -> tuple[Tensor, Tensor]:
    """The ``k`` largest Ritz pairs: eigenvalues ``[k]`` (descending) and unit eigenvectors ``[k, P]``."""
    m = min(num_iters, num_params)
    basis = torch.zeros(m, num_params, dtype=like.dtype, device=like.device)
    breakdown = torch.finfo(like.dtype).eps ** 0.5
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    q = _random_unit(basis[:0], generator)
    for j in range(m):
        basis[j] = q
        w = hvp(q)
        alphas.append(torch.dot(q, w))
        w = _orthogonalize(w, basis[: j + 1])  # includes w -= alpha_j q_j + beta_j q_{j-1}
        beta = torch.linalg.vector_norm(w)
        ritz_values, ritz_vectors = torch.linalg.eigh(_tridiagonal(alphas, betas))
        if j + 1 == m:
            break
        scale = ritz_values.abs().max()
        if bool(beta <= breakdown * scale):
            # span(basis) is invariant under H: restart in its orthogonal complement (T becomes block diagonal).
            # Never declare convergence here: a larger eigenvalue may live outside the current Krylov space.
            betas.append(torch.zeros_like(beta))
            q = _random_unit(basis[: j + 1], generator)
            continue
        if j + 1 >= k:
            # ||H y_i - theta_i y_i|| = beta_{j+1} |e_j^T s_i| for the Ritz pair (theta_i, y_i = Q s_i)
            residuals = beta * ritz_vectors[-1, -k:].abs()
            if bool((residuals <= tol * scale).all()):
                break
        betas.append(beta)
        q = w / beta
    num = len(alphas)
    values = ritz_values[-k:].flip(0)
    vectors = (basis[:num].T @ ritz_vectors[:, -k:]).T.flip(0)
    return values, vectors


def _check_lanczos_args(k: int, num_iters: int, tol: float, num_params: int) -> None:
    check_int(k, "k")
    check_int(num_iters, "num_iters")
    if k > num_params:
        raise ValueError(f"`k` must be <= the number of parameters ({num_params}), got {k}")
    if k > num_iters:
        raise ValueError(f"`num_iters` must be >= k ({k}) to find k eigenvalues, got {num_iters}")
    check_real(tol, "tol", low=0, low_open=True)


def top_hessian_eigenpairs(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    k: int = 1,
    *,
    num_iters: int = 100,
    tol: float = 1e-4,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, list[list[Tensor]]]:
    r"""The :math:`k` algebraically largest eigenvalues of :math:`H=\nabla^2 L(\theta)` and their eigenvectors.

    **Method: Lanczos with full reorthogonalisation** [2]. From a random unit :math:`q_1`, each step forms
    :math:`w=Hq_j` (one :func:`hessian_vector_product`, reusing one gradient graph), orthogonalises it against all
    previous :math:`q_i` (twice) and normalises it to :math:`q_{j+1}=w/\beta_{j+1}`. The Ritz values
    :math:`\theta_1\ge\dots` (eigenvalues of the tridiagonal :math:`T_j=Q_j^\top HQ_j`) approximate the eigenvalues
    of :math:`H`, and :math:`y_i=Q_js_i` the eigenvectors. Iteration stops when every one of the top :math:`k` Ritz
    pairs has residual :math:`\|Hy_i-\theta_iy_i\|_2=\beta_{j+1}|e_j^\top s_i|\le\mathrm{tol}\cdot\max_i|\theta_i|`,
    or after ``num_iters`` products. If :math:`\beta_{j+1}\approx0` the Krylov space is invariant and Lanczos
    restarts from a random vector orthogonal to it.

    Why Lanczos rather than power iteration with deflation (PyHessian [5]): power iteration converges to the
    eigenvalue of largest *magnitude*, which away from a minimum is often a negative one (the most negative
    eigenvalue can dominate :math:`\lambda_1`), whereas Lanczos gives the algebraically largest ones directly; it
    also needs far fewer products (its error shrinks with the Chebyshev rate in :math:`\sqrt{\text{gap}}`, against
    the ratio :math:`|\lambda_{k+1}/\lambda_k|` per step for power iteration), and the eigenvectors cost nothing
    extra. The price is memory: the basis holds ``min(num_iters, P)`` vectors of length :math:`P`, allocated up
    front (100 × 11.7 M float32 parameters of a ResNet-18 take 4.7 GB), so lower ``num_iters`` for large networks.

    :param loss_fn: :math:`L`, maps a list of tensors shaped like ``params`` to a scalar tensor.
    :param params: the point :math:`\theta`, a sequence of floating-point tensors on one device and dtype.
    :param int k: how many eigenvalues, :math:`1\le k\le\min(P,\text{num\_iters})`. Default 1 (:math:`\lambda_{\max}`,
        the usual sharpness measure).
    :param int num_iters: maximum number of Lanczos steps (Hessian-vector products), default 100 (PyHessian's
        ``maxIter``); when :math:`P\le` ``num_iters`` the Krylov space is exhausted and the result is exact up to
        rounding.
    :param float tol: relative residual tolerance, default 1e-4; the eigenvalue error is of order
        :math:`\mathrm{tol}^2\max|\theta|^2/\mathrm{gap}`, far below ``tol`` for a separated eigenvalue.
    :param generator: random generator for the start vector(s), on the parameters' device; default the global one.
    :returns: ``(eigenvalues, eigenvectors)``: a tensor of shape ``[k]`` in descending order, and a list of ``k``
        unit vectors (global L2 norm 1, arbitrary sign), each a list of tensors shaped like ``params``.

    .. note:: In exact arithmetic a Krylov space holds one direction per *distinct* eigenvalue, so an exactly
        repeated top eigenvalue is found with its multiplicity only once the space becomes invariant (always when
        :math:`P\le` ``num_iters``). Each step synchronises with the host once, for the stopping test.
    """
    leaves = _fresh_leaves(params)
    num_params = sum(p.numel() for p in leaves)
    _check_lanczos_args(k, num_iters, tol, num_params)
    _check_generator(generator, leaves[0])
    values, vectors = _lanczos(
        _hvp_operator(loss_fn, leaves), num_params, k, num_iters, float(tol), generator, leaves[0]
    )
    return values, [unflatten_like(v, leaves) for v in vectors]


# ---------------------------------------------------------------------------------------------------------------------
# trace and sharpness
# ---------------------------------------------------------------------------------------------------------------------


def hutchinson_trace_estimates(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    *,
    num_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""The per-probe Hutchinson estimates :math:`v_m^\top Hv_m`, :math:`m=1..M`, shape ``[num_samples]``.

    Each :math:`v_m\in\{-1,+1\}^P` has independent Rademacher entries, so :math:`\mathbb E[v^\top Hv]=\operatorname
    {tr}H` and :math:`\operatorname{Var}[v^\top Hv]=2\sum_{i\ne j}H_{ij}^2` (Rademacher probes have the smallest
    variance among iid probes; the estimate is exact for diagonal :math:`H`). Report the mean with its standard
    error ``std / sqrt(M)`` (PyHessian [5] likewise returns the list of probes). Arguments as in
    :func:`hutchinson_trace`.
    """
    leaves = _fresh_leaves(params)
    check_int(num_samples, "num_samples")
    _check_generator(generator, leaves[0])
    like = leaves[0]
    num_params = sum(p.numel() for p in leaves)
    hvp = _hvp_operator(loss_fn, leaves)
    estimates = torch.empty(num_samples, dtype=like.dtype, device=like.device)
    for m in range(num_samples):
        v = torch.randint(0, 2, (num_params,), generator=generator, device=like.device).to(like.dtype) * 2 - 1
        estimates[m] = torch.dot(v, hvp(v))
    return estimates


def hutchinson_trace(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    *,
    num_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Hutchinson's estimate of :math:`\operatorname{tr}\nabla^2L(\theta)=\sum_i\lambda_i`, a 0-d tensor.

    .. math:: \widehat{\operatorname{tr}H}=\frac1M\sum_{m=1}^M v_m^\top Hv_m,\qquad v_m\sim\text{Rademacher}^P,

    unbiased with standard error :math:`\sqrt{2\sum_{i\ne j}H_{ij}^2/M}`; use :func:`hutchinson_trace_estimates`
    to get the per-probe values and so the standard error.

    :param loss_fn: :math:`L`, maps a list of tensors shaped like ``params`` to a scalar tensor.
    :param params: the point :math:`\theta`, a sequence of floating-point tensors on one device and dtype.
    :param int num_samples: number of probes :math:`M\ge1`, default 100 (PyHessian's ``maxIter``); each costs one
        Hessian-vector product.
    :param generator: random generator for the probes, on the parameters' device; default the global one.
    :returns: the estimate, on the parameters' device and dtype.
    """
    return hutchinson_trace_estimates(loss_fn, params, num_samples=num_samples, generator=generator).mean()


def sam_sharpness(loss_fn: LossFn, params: Sequence[Tensor], rho: float) -> Tensor:
    r"""The SAM sharpness :math:`L(\theta+\hat\epsilon)-L(\theta)` with :math:`\hat\epsilon=\rho\,g/\|g\|_2`.

    :math:`g=\nabla_\theta L(\theta)` and :math:`\|\cdot\|_2` is the *global* L2 norm over all tensors
    (:func:`pyro_flat.ops.sam.sam_perturbation`), so :math:`\hat\epsilon` is the first-order worst case inside the
    ball of radius :math:`\rho` [4]. For :math:`L=\tfrac12\theta^\top A\theta` it equals
    :math:`\rho\|A\theta\|+\rho^2(A\theta)^\top A(A\theta)/(2\|A\theta\|^2)`. A zero gradient gives 0.

    :param loss_fn: :math:`L`, maps a list of tensors shaped like ``params`` to a scalar tensor.
    :param params: the point :math:`\theta`, a sequence of floating-point tensors on one device and dtype.
    :param float rho: the radius :math:`\rho\ge0`.
    :returns: the sharpness, a detached 0-d tensor on the parameters' device and dtype.
    """
    rho = check_radius(rho)
    leaves = _fresh_leaves(params)
    with torch.enable_grad():
        loss = _evaluate_loss(loss_fn, leaves)
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, leaves, materialize_grads=True)
        else:
            grads = tuple(torch.zeros_like(p) for p in leaves)
    eps = sam_perturbation(grads, rho)
    with torch.no_grad():
        perturbed = _evaluate_loss(loss_fn, [p + e for p, e in zip(leaves, eps, strict=True)])
    return (perturbed - loss).detach()


__all__ = [
    "LossFn",
    "hessian_vector_product",
    "hutchinson_trace",
    "hutchinson_trace_estimates",
    "sam_sharpness",
    "top_hessian_eigenpairs",
]
