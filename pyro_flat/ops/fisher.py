r"""Fisher information of Gaussian variational families and the KL-ball ascent step of SA-BMA.

Let :math:`q_\phi` be a guide with parameters :math:`\phi` and :math:`g = \nabla_\phi \mathbb E_{q_\phi}[L]` the
gradient of an expected loss. The second-order expansion :math:`\mathrm{KL}(q_{\phi+\delta}\,\|\,q_\phi)
\approx \tfrac12 \delta^\top F_\phi \delta`, with the Fisher :math:`F_\phi = \mathbb E_{q_\phi}[\nabla_\phi\log q_\phi\,
\nabla_\phi\log q_\phi^\top]` of the guide with respect to its own parameters, turns the worst case of the linearised
loss inside the ball :math:`\mathrm{KL}(q_{\phi+\delta}\|q_\phi)\le\gamma` into [1]

.. math:: \delta^* = \sqrt{2\gamma}\; \frac{F_\phi^{-1} g}{\sqrt{g^\top F_\phi^{-1} g}},
    \qquad \tfrac12 \delta^{*\top} F_\phi\, \delta^* = \gamma .

**Diagonal Gaussian** :math:`\mathcal N(m, \mathrm{diag}(s^2))` whose scale is the image :math:`s = T(u)` of the
parameter :math:`u` that is actually optimised (``softplus`` for Pyro's autoguides, ``exp`` for a log-scale): the
Fisher in :math:`(m, u)` is diagonal, :math:`F_m = 1/s^2`, :math:`F_u = 2T'(u)^2/s^2`. With a fixed isotropic scale
and only the mean learned, :math:`\delta^*` is SAM's step [2] with radius :math:`\rho = s\sqrt{2\gamma}`.

**Low-rank plus diagonal Gaussian** :math:`\mathcal N(m, \Sigma)`, :math:`\Sigma = \mathrm{diag}(s)(I + VV^\top)
\mathrm{diag}(s)`, :math:`V\in\mathbb R^{P\times K}` (SWAG's family, with the relative factor of Pyro's
``AutoLowRankMultivariateNormal``). The mean block :math:`F_m = \Sigma^{-1}` is used exactly (:math:`F_m^{-1}g =
\Sigma g`). The marginal Fisher's factor block vanishes at :math:`V=0`, so the covariance blocks use the Fisher of the
**augmented** sampling process :math:`z\sim\mathcal N(0, I_K)`, :math:`\theta_i\mid z\sim\mathcal N(m_i + s_i
v_i^\top z,\ s_i^2)`: a :math:`(1+K)\times(1+K)` block per coordinate :math:`i`, in :math:`(u_i, v_i)`,

.. math:: \tilde F_i = \begin{pmatrix} T'^2(\|v_i\|^2 + 2)/s_i^2 & T' v_i^\top/s_i \\ T' v_i/s_i & I_K
    \end{pmatrix},

which dominates the marginal Fisher, so the step stays inside the KL ball to second order.

**The authors' code variant** (github.com/SungJun98/SA-BMA): the score :math:`s = \nabla_\phi \log q_\phi(\theta)`
normalised per block :math:`k` (mean, scale, factor), :math:`\delta_k = \sqrt{2\gamma}\, s_k / \|s_k\|_2`.
Derivations (the Fisher blocks, their inverse, the domination): the *SA-BMA* page of the documentation
(``docs/methods/kl-ball.md``).

References:
    * [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
      Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
    * [2] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
      Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._validation import check_int, check_real
from .low_rank import low_rank_covariance_product, row_dot
from .sam import check_radius
from .tree import global_norm, tree_dot

__all__ = [
    "conjugate_gradient",
    "diagonal_gaussian_fisher",
    "diagonal_gaussian_inverse_fisher_product",
    "kl_ball_step",
    "low_rank_gaussian_inverse_fisher_product",
    "normalized_score_step",
]


def diagonal_gaussian_fisher(scale: Tensor, scale_derivative: Tensor) -> tuple[Tensor, Tensor]:
    r"""The diagonal Fisher of :math:`\mathcal N(m, \mathrm{diag}(s^2))` in the parameters :math:`(m, u)`,
    :math:`s = T(u)`.

    :param scale: the standard deviations :math:`s > 0`.
    :param scale_derivative: :math:`T'(u) = \partial s / \partial u` elementwise (``1`` if :math:`s` itself is
        the parameter, :math:`s` for :math:`s = e^u`, :math:`\mathrm{sigmoid}(u)` for :math:`s=\mathrm{softplus}(u)`).
    :returns: ``(F_m, F_u)`` shaped like ``scale``: :math:`1/s^2` and :math:`2T'(u)^2/s^2`.
    """
    precision = scale.pow(-2)
    return precision, 2 * scale_derivative.square() * precision


def diagonal_gaussian_inverse_fisher_product(
    grad_loc: Tensor | None, grad_scale: Tensor | None, scale: Tensor, scale_derivative: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    r""":math:`F^{-1} g` for a diagonal Gaussian: :math:`(s^2 g_m,\; s^2 g_u / (2T'(u)^2))`.

    :param grad_loc: :math:`g_m` (``None`` if the mean is not a parameter).
    :param grad_scale: :math:`g_u`, the gradient with respect to the *optimised* scale parameter (``None`` if the
        scale is held fixed).
    :param scale: the standard deviations :math:`s`.
    :param scale_derivative: :math:`T'(u)` (see :func:`diagonal_gaussian_fisher`).
    """
    variance = scale.square()
    loc_part = None if grad_loc is None else variance * grad_loc
    scale_part = None if grad_scale is None else variance * grad_scale / (2 * scale_derivative.square())
    return loc_part, scale_part


def low_rank_gaussian_inverse_fisher_product(
    grad_loc: Tensor | None,
    grad_scale: Tensor | None,
    grad_factor: Tensor | None,
    scale: Tensor,
    scale_derivative: Tensor,
    factor: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    r""":math:`\tilde F^{-1} g` for :math:`\mathcal N(m, \mathrm{diag}(s)(I + VV^\top)\mathrm{diag}(s))` with the
    approximation of the module docstring: exact mean block :math:`\Sigma g_m`; augmented-Fisher blocks in
    :math:`(u_i, v_i)` per coordinate, :math:`\tilde F_i^{-1}(g_u, g_v) = (x_u,\ g_v - \tfrac{T'}{s_i}v_i x_u)` with
    :math:`x_u = \tfrac{s_i^2}{2T'^2}(g_u - \tfrac{T'}{s_i} v_i^\top g_v)`. A ``None`` gradient marks a block that is
    not a parameter (held fixed): the remaining blocks then use their own sub-block of :math:`\tilde F`.

    :param grad_loc: :math:`g_m \in \mathbb R^P` (or ``None``).
    :param grad_scale: :math:`g_u\in\mathbb R^P` (or ``None``).
    :param grad_factor: :math:`g_V \in \mathbb R^{P\times K}` (or ``None``).
    :param scale: the diagonal standard deviations :math:`s`.
    :param scale_derivative: :math:`T'(u)`.
    :param factor: the relative factor :math:`V`, shape ``[P, K]``.

    The only :math:`P\times K` tensor made is the factor's direction (row-wise products are reduced block by block).
    """
    loc_part = None if grad_loc is None else low_rank_covariance_product(scale, factor, grad_loc)
    coupling = scale_derivative / scale  # T'/s
    if grad_scale is None:
        return loc_part, None, grad_factor
    if grad_factor is None:
        return loc_part, grad_scale / (coupling.square() * (row_dot(factor, factor) + 2)), None
    scale_part = (grad_scale - coupling * row_dot(factor, grad_factor)) / (2 * coupling.square())
    factor_part = torch.addcmul(grad_factor, (coupling * scale_part).unsqueeze(-1), factor, value=-1)
    return loc_part, scale_part, factor_part


def kl_ball_step(
    grads: Sequence[Tensor], inverse_fisher_grads: Sequence[Tensor], radius: float, *, eps: float = 1e-30
) -> list[Tensor]:
    r"""The Fisher-preconditioned worst case :math:`\delta^* = \sqrt{2\gamma}\,F^{-1}g/\sqrt{g^\top F^{-1}g}`.

    :param grads: the loss gradient :math:`g`, one tensor per parameter.
    :param inverse_fisher_grads: :math:`F^{-1} g`, shaped like ``grads``.
    :param radius: the KL radius :math:`\gamma \ge 0` (nats).
    :param eps: added under the square root so that a zero gradient gives a zero step, not NaN.
    :returns: :math:`\delta^*` per parameter (detached), with :math:`\tfrac12\delta^{*\top}F\delta^* = \gamma`.
    """
    radius = check_radius(radius, "radius")
    if len(grads) != len(inverse_fisher_grads) or not grads:
        raise ValueError(
            f"kl_ball_step: expected equally many (>= 1) gradients and inverse-Fisher products, got {len(grads)} "
            f"and {len(inverse_fisher_grads)}"
        )
    grads = [g.detach() for g in grads]
    directions = [v.detach() for v in inverse_fisher_grads]
    quadratic = tree_dot(grads, directions)
    coefficient = math.sqrt(2 * radius) * torch.rsqrt(quadratic + eps)
    return [coefficient * v for v in directions]


def normalized_score_step(
    blocks: Sequence[Sequence[Tensor]], radius: float, *, eps: float = 1e-12
) -> list[list[Tensor]]:
    r"""The authors'-code perturbation: each block of the score normalised on its own, :math:`\delta_k =
    \sqrt{2\gamma}\, s_k/(\|s_k\|_2 + \epsilon)` (``first_step`` of ``SABMA_optim`` in github.com/SungJun98/SA-BMA).

    :param blocks: the score :math:`s = \nabla_\phi\log q_\phi(\theta)` split into blocks :math:`s_k`; a block is a
        list of tensors normalised together by their global norm (one block per *role*: all means, all scales, all
        factors).
    :param radius: :math:`\gamma \ge 0`; every block moves by :math:`\sqrt{2\gamma}` in Euclidean norm.
    :param eps: the code's ``1e-12`` added to the norm.
    :returns: the perturbations, structured like ``blocks`` (detached).
    """
    rho = math.sqrt(2 * check_radius(radius, "radius"))
    if not blocks or any(len(block) == 0 for block in blocks):
        raise ValueError("normalized_score_step: expected at least one non-empty score block")
    steps = []
    for block in blocks:
        block = [s.detach() for s in block]
        coefficient = rho / (global_norm(block) + eps)
        steps.append([coefficient * s for s in block])
    return steps


def conjugate_gradient(
    matvec: Callable[[list[Tensor]], list[Tensor]],
    b: Sequence[Tensor],
    *,
    iterations: int,
    damping: float,
) -> list[Tensor]:
    r"""Solve :math:`(F + \lambda I)\,x = b` by conjugate gradients, for a symmetric positive semi-definite :math:`F`
    known only through products :math:`v \mapsto Fv` (e.g. Fisher-vector products by automatic differentiation).

    The damping is relative to the curvature along :math:`b`, :math:`\lambda = \text{damping}\cdot
    b^\top F b / b^\top b`, so it does not depend on the parameters' units; it bounds the solution in directions
    where :math:`F` is (nearly) singular. A fixed number of iterations and no convergence test: nothing is read on
    the host (a converged iteration leaves :math:`x` unchanged). In exact arithmetic CG is exact after as many
    iterations as :math:`F` has distinct eigenvalues.

    :param matvec: :math:`v \mapsto Fv` on lists of tensors shaped like ``b``.
    :param b: the right-hand side, one tensor per parameter.
    :param int iterations: the number of CG iterations (:math:`\ge 1`).
    :param float damping: the relative damping (:math:`\ge 0`).
    :returns: :math:`x`, shaped like ``b``.
    """
    check_int(iterations, "iterations", owner="conjugate_gradient")
    check_real(damping, "damping", low=0, owner="conjugate_gradient")
    b = [t.detach() for t in b]
    fb = matvec(b)
    bb = tree_dot(b, b)
    tiny = torch.finfo(bb.dtype).tiny
    lam = damping * tree_dot(b, fb) / bb.clamp_min(tiny)

    def apply(v: list[Tensor], fv: list[Tensor] | None = None) -> list[Tensor]:
        fv = matvec(v) if fv is None else fv
        return [f + lam * t for f, t in zip(fv, v, strict=True)]

    x = [torch.zeros_like(t) for t in b]
    r = list(b)
    p = list(b)
    rr = bb
    ap = apply(p, fb)
    for i in range(iterations):
        pap = tree_dot(p, ap)
        alpha = torch.where(pap > tiny, rr / pap.clamp_min(tiny), torch.zeros_like(pap))
        x = [xi + alpha * pi for xi, pi in zip(x, p, strict=True)]
        r = [ri - alpha * api for ri, api in zip(r, ap, strict=True)]
        if i + 1 == iterations:
            break
        rr_new = tree_dot(r, r)
        beta = torch.where(rr > tiny, rr_new / rr.clamp_min(tiny), torch.zeros_like(rr))
        p = [ri + beta * pi for ri, pi in zip(r, p, strict=True)]
        rr = rr_new
        ap = apply(p)
    return x
