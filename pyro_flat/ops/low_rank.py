r"""The low-rank-plus-diagonal Gaussian family of SWAG and SA-BMA.

A Gaussian :math:`\mathcal N(m, \Sigma)` on :math:`\mathbb R^P` with

.. math:: \Sigma = \mathrm{diag}(s^2) + W W^\top = \mathrm{diag}(s)\,(I + VV^\top)\,\mathrm{diag}(s),
    \qquad W = \mathrm{diag}(s)\,V \in \mathbb R^{P\times K},

sampled as :math:`\theta = m + s\odot(z_1 + V z_2)` with :math:`z_1\sim\mathcal N(0, I_P)`, :math:`z_2\sim
\mathcal N(0, I_K)`. The functions here take the *relative* factor :math:`V` (the parameterisation of Pyro's
:class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`): the capacitance :math:`I + V^\top V` of the Woodbury
identity then stays well conditioned however small :math:`s` is, whereas :math:`I + W^\top\mathrm{diag}(s^{-2})W`
overflows float32 when a SWAG coordinate barely moved.

SWAG [1] estimates the family from SGD iterates :math:`\theta_1,\dots,\theta_T`: the running mean :math:`\bar\theta`,
the diagonal variance :math:`\overline{\theta^2} - \bar\theta^2` and the deviation matrix
:math:`D = [\theta_{T-K+1} - \bar\theta_{T-K+1}, \dots]` of the last :math:`K` iterates, and samples

.. math:: \theta = \bar\theta + \sqrt{c}\,\Big(\sqrt{\mathrm{var}}\odot z_1 + \frac{D z_2}{\sqrt{K-1}}\Big),

where :math:`c` is SWAG's ``scale`` (:math:`c = 1/2` gives the paper's :math:`\tfrac12(\Sigma_{\rm diag} +
\Sigma_{\rm low\,rank})`). Hence :math:`s = \sqrt{c\cdot\mathrm{var}}`, :math:`W = \sqrt{c}\,D/\sqrt{K-1}` and
:math:`V_{ik} = D_{ik}/\sqrt{(K-1)\,\mathrm{var}_i}` (``c`` cancels).

**Density without** :math:`P\times K` **temporaries.** With :math:`x = (\theta - m)/s`, :math:`C = I + V^\top V`
(:math:`K\times K`, Cholesky factor :math:`L`) and :math:`a = C^{-1}V^\top x`, the Woodbury identity and the matrix
determinant lemma give

.. math:: \log q(\theta) = -\tfrac12\Big(P\log 2\pi + 2\sum_i\log s_i + 2\sum_k \log L_{kk}
    + \|x\|^2 - (V^\top x)^\top a\Big),

and its gradients, with :math:`r = x - Va` (so that :math:`\Sigma^{-1}(\theta - m) = r/s`),

.. math:: \nabla_\theta = -r/s = -\nabla_m,\qquad \nabla_s = (r\odot x - 1)/s,\qquad
    \nabla_V = r a^\top - V C^{-1},

computed by :func:`low_rank_log_prob` with vectors of length :math:`P`, :math:`K\times K` matrices and one
:math:`P\times K` result (the gradient of :math:`V`, written in place), where torch's
``LowRankMultivariateNormal`` divides the absolute factor :math:`W` by the diagonal (a :math:`P\times K` copy, twice)
and autograd adds several :math:`P\times K` buffers in the backward pass. A reparameterised draw
:math:`\theta = m + s\odot(z_1 + Vz_2)` scored by its own density (an ELBO's :math:`\log q(\theta)`) gives :math:`V`
a second gradient, :math:`(s\odot\bar g_\theta)z_2^\top`; :func:`low_rank_rsample_and_log_prob` returns the draw
and its log-density from one autograd node, so that both land in one :math:`P\times K` buffer.

**No host synchronisation.** :math:`C` is factorised by ``torch.linalg.cholesky_ex``, whose status stays on the
device, and solved with triangular solves (``torch.cholesky_solve`` and ``torch.cholesky_inverse`` read a status on
the host on CUDA: MAGMA's, or the check of their result). :math:`C` is positive definite for every finite factor (its
eigenvalues are at least 1), so a failed factorisation means a non-finite factor: its Cholesky factor is then NaN,
which the density, the draws' log-density and the gradients carry; ``check_errors=True`` (a guide under validation)
raises instead, with one host read.

The same holds in SWAG's absolute form :math:`\Sigma = \mathrm{diag}(d) + WW^\top`, with :math:`C = I +
W^\top\mathrm{diag}(d)^{-1}W` accumulated over blocks of rows and :math:`\nabla_W = q a^\top -
\mathrm{diag}(d)^{-1}WC^{-1}`, :math:`q = \Sigma^{-1}(\theta - m)`.

References:
    * [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "low_rank_capacitance_tril",
    "low_rank_covariance_product",
    "low_rank_log_prob",
    "low_rank_rsample",
    "low_rank_rsample_and_log_prob",
    "low_rank_variance",
    "row_dot",
    "swag_to_low_rank",
]

BLOCK_BYTES = 1 << 26
r"""Bytes of the temporary of one block of rows of the row-wise reductions of a :math:`P\times K` matrix (64 MiB):
a bounded temporary, in few blocks (one kernel launch or three each; ResNet-18's 11 M rows at rank 5 in float32 take
4 blocks, where blocks of a fixed 32,768 rows took 342, launch-bound on a GPU)."""


def _row_blocks(matrix: Tensor) -> range:
    """The first rows of the blocks of ``matrix`` (``[..., P, K]``) whose temporaries hold :data:`BLOCK_BYTES`."""
    row_bytes = max(1, matrix[..., :1, :].numel() * matrix.element_size())
    return range(0, matrix.shape[-2], max(1, BLOCK_BYTES // row_bytes))


def _recorded(*tensors: Tensor) -> bool:
    """Whether autograd records operations on ``tensors`` (then blocks of rows would cost a full-size gradient each)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    r"""The row-wise inner products :math:`\sum_k a_{ik} b_{ik}` of two ``[..., P, K]`` matrices (broadcast), block by
    block of rows, so that no :math:`P\times K` product is materialised (in one piece when autograd records it)."""
    if _recorded(a, b):
        return (a * b).sum(-1)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    out = a.new_empty(shape[:-1])
    blocks = _row_blocks(a.expand(shape))
    for start in blocks:
        stop = start + blocks.step
        torch.sum(a[..., start:stop, :] * b[..., start:stop, :], -1, out=out[..., start:stop])
    return out


def low_rank_variance(diag: Tensor, factor: Tensor, *, relative: bool = True) -> Tensor:
    r"""The marginal variances :math:`\mathrm{diag}\,\Sigma`: :math:`s^2\odot(1 + \sum_k V_{:k}^2)` in the relative
    form (``diag`` = :math:`s`), :math:`d + \sum_k W_{:k}^2` in the absolute form (``diag`` = :math:`d`)."""
    squares = row_dot(factor, factor)
    return diag.square() * (1 + squares) if relative else diag + squares


def low_rank_capacitance_tril(factor: Tensor, variance: Tensor | None = None, *, check_errors: bool = False) -> Tensor:
    r"""The Cholesky factor :math:`L` of the capacitance :math:`C = I + V^\top V` (relative factor :math:`V`,
    ``variance=None``) or :math:`C = I + W^\top\mathrm{diag}(d)^{-1}W` (absolute factor, ``variance`` = :math:`d`,
    accumulated over blocks of rows unless autograd records it), shape ``[..., K, K]``.

    Made without a host synchronisation: where :math:`C` is not positive definite (a non-finite factor, or a
    non-positive :math:`d`), :math:`L` is NaN. With ``check_errors=True``, that raises a ``ValueError`` instead (one
    host read).
    """
    rank = factor.shape[-1]
    if variance is None:
        gram = factor.mT @ factor
    elif _recorded(factor, variance):
        gram = (factor / variance.unsqueeze(-1)).mT @ factor
    else:
        gram = 0
        blocks = _row_blocks(factor)
        for start in blocks:
            block = factor[..., start : start + blocks.step, :]
            gram = gram + (block / variance[..., start : start + blocks.step, None]).mT @ block
    eye = torch.eye(rank, dtype=factor.dtype, device=factor.device)
    tril, info = torch.linalg.cholesky_ex(gram + eye)
    if check_errors and bool((info != 0).any()):
        order = int(info.max())
        raise ValueError(
            f"low_rank_capacitance_tril: the capacitance I + {'V^T V' if variance is None else 'W^T diag(d)^-1 W'} "
            f"({rank} x {rank}) is not positive definite (its leading minor of order {order} is not): the factor is "
            f"not finite or so large that its products overflow {factor.dtype}"
            f"{'' if variance is None else ', or the variance d is not positive'}"
        )
    return torch.where(info.unsqueeze(-1).unsqueeze(-1) == 0, tril, torch.nan)


def _capacitance_solve(tril: Tensor, vectors: Tensor) -> Tensor:
    r""":math:`C^{-1}y` for ``vectors`` :math:`y` shaped ``[..., K]``, from :math:`L` (two triangular solves)."""
    half = torch.linalg.solve_triangular(tril, vectors.unsqueeze(-1), upper=False)
    return torch.linalg.solve_triangular(tril.mT, half, upper=True).squeeze(-1)


def _capacitance_inverse(tril: Tensor) -> Tensor:
    r""":math:`C^{-1} = L^{-\top}L^{-1}`, ``[..., K, K]``."""
    eye = torch.eye(tril.shape[-1], dtype=tril.dtype, device=tril.device)
    inverse_tril = torch.linalg.solve_triangular(tril, eye, upper=False)
    return inverse_tril.mT @ inverse_tril


def _factor_times(factor: Tensor, vectors: Tensor) -> Tensor:
    """:math:`V z` for ``vectors`` :math:`z` shaped ``[..., K]``: ``[..., P]``. With an unbatched factor the batch is
    one matrix product whose gradient in :math:`V` comes out in :math:`V`'s (row-major) layout."""
    if factor.dim() == 2:
        flat = vectors.reshape(-1, factor.shape[-1])
        return (factor @ flat.mT).mT.reshape(vectors.shape[:-1] + factor.shape[-2:-1])
    return (factor @ vectors.unsqueeze(-1)).squeeze(-1)


def _factor_transpose_times(factor: Tensor, vectors: Tensor) -> Tensor:
    r""":math:`V^\top x` for ``vectors`` :math:`x` shaped ``[..., P]``: ``[..., K]``."""
    return (vectors.unsqueeze(-2) @ factor).squeeze(-2)


def low_rank_rsample(
    loc: Tensor, diag: Tensor, factor: Tensor, noise_diag: Tensor, noise_rank: Tensor, *, relative: bool = True
) -> Tensor:
    r"""The reparameterised draw :math:`m + s\odot(z_1 + Vz_2)` (relative form, ``diag`` = :math:`s`) or
    :math:`m + \sqrt d\odot z_1 + Wz_2` (absolute form, ``diag`` = :math:`d`), with ``noise_diag`` :math:`z_1`
    ``[..., P]`` and ``noise_rank`` :math:`z_2` ``[..., K]``; the gradient of the factor is its only
    :math:`P\times K` tensor."""
    low_rank = _factor_times(factor, noise_rank)
    if relative:
        return loc + diag * (noise_diag + low_rank)
    return loc + diag.sqrt() * noise_diag + low_rank


def _seen_by_torch(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as torch operations receive them: a ``TorchFunctionMode`` that swaps tensors (KLBallELBO's perturbed
    pass, :class:`~pyro_flat.infer.replay.substituted_tensors`) reaches the operations inside a custom autograd
    ``Function`` but not its inputs, so that the backward pass would see the originals; a view (no copy) is an
    operation the mode sees."""
    return tuple(t.view_as(t) for t in tensors)


def _sum_to(tensor: Tensor, shape: torch.Size) -> Tensor:
    return tensor if tensor.shape == shape else tensor.sum_to_size(shape)


def _density(
    value: Tensor, loc: Tensor, diag: Tensor, factor: Tensor, relative: bool, check_errors: bool
) -> tuple[Tensor, ...]:
    """``(log q(value), L, a)`` in plain differentiable operations (the forward pass of :class:`_LowRankLogProb`)."""
    diff = value - loc
    if relative:
        whitened = diff / diag
        projected = _factor_transpose_times(factor, whitened)
        tril = low_rank_capacitance_tril(factor, check_errors=check_errors)
        logdet_diag = 2 * diag.log().sum(-1)
        squared = whitened.square().sum(-1)
    else:
        projected = _factor_transpose_times(factor, diff / diag)
        tril = low_rank_capacitance_tril(factor, diag, check_errors=check_errors)
        logdet_diag = diag.log().sum(-1)
        squared = (diff.square() / diag).sum(-1)
    solved = _capacitance_solve(tril, projected)
    mahalanobis = squared - (projected * solved).sum(-1)
    logdet = logdet_diag + 2 * tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return -0.5 * (value.shape[-1] * math.log(2 * math.pi) + logdet + mahalanobis), tril, solved


class _LowRankLogProb(torch.autograd.Function):
    r""":math:`\log q(\theta)` and its gradients by the formulas of the module docstring (first order only)."""

    @staticmethod
    def forward(ctx: object, value: Tensor, loc: Tensor, diag: Tensor, factor: Tensor, relative: bool,
                check_errors: bool) -> Tensor:
        log_prob, tril, solved = _density(value, loc, diag, factor, relative, check_errors)
        ctx.save_for_backward(value, loc, diag, factor, tril, solved)
        ctx.relative = relative
        return log_prob

    @staticmethod
    @once_differentiable
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor | None, ...]:
        value, loc, diag, factor, tril, solved = ctx.saved_tensors
        relative = ctx.relative
        diff = value - loc
        low_rank = _factor_times(factor, solved)
        if relative:
            whitened = diff / diag
            residual = whitened - low_rank  # r = x - Va
            precision_diff = residual / diag  # Sigma^{-1} (theta - m)
        else:
            residual = precision_diff = (diff - low_rank) / diag
        weight = grad.unsqueeze(-1)
        grad_value = grad_loc = grad_diag = grad_factor = None
        if ctx.needs_input_grad[0]:
            grad_value = _sum_to(-weight * precision_diff, value.shape)
        if ctx.needs_input_grad[1]:
            grad_loc = _sum_to(weight * precision_diff, loc.shape)
        parameter_batch = factor.shape[:-2] if relative else torch.broadcast_shapes(factor.shape[:-2], diag.shape[:-1])
        if ctx.needs_input_grad[3] or (ctx.needs_input_grad[2] and not relative):
            total = _sum_to(grad, parameter_batch)[..., None, None]
            # -(sum of grad) V C^{-1}, or -(sum of grad) diag(d)^{-1} W C^{-1}: the factor's gradient, written in place
            grad_factor = factor @ (-total * _capacitance_inverse(tril))
            if not relative:
                grad_factor.div_(diag.unsqueeze(-1))
        if ctx.needs_input_grad[2]:
            if relative:
                grad_diag = _sum_to(weight * (residual * whitened - 1) / diag, diag.shape)
            else:  # 0.5 (q^2 - diag Sigma^{-1}) with diag Sigma^{-1} = (1 - rowdot(diag(d)^{-1} W C^{-1}, W)) / d
                squares = _sum_to(weight * precision_diff.square(), diag.shape)
                inverse_diag = (grad.sum_to_size(parameter_batch).unsqueeze(-1) + row_dot(grad_factor, factor)) / diag
                grad_diag = _sum_to(0.5 * squares - 0.5 * inverse_diag, diag.shape)
        if ctx.needs_input_grad[3]:
            weighted = weight * residual  # the rank-one terms sum_b g_b r_b a_b^T
            if factor.dim() == 2 and grad_factor.dim() == 2:
                grad_factor.addmm_(weighted.reshape(-1, weighted.shape[-1]).mT, solved.reshape(-1, solved.shape[-1]))
            else:
                grad_factor = grad_factor + _sum_to(weighted.unsqueeze(-1) * solved.unsqueeze(-2), factor.shape)
        else:
            grad_factor = None
        return grad_value, grad_loc, grad_diag, grad_factor, None, None


def low_rank_log_prob(
    value: Tensor, loc: Tensor, diag: Tensor, factor: Tensor, *, relative: bool = True, check_errors: bool = False,
    fused: bool = True,
) -> Tensor:
    r""":math:`\log\mathcal N(\theta;\ m,\ \Sigma)` for :math:`\Sigma = \mathrm{diag}(s)(I + VV^\top)\mathrm{diag}(s)`
    (``relative``, ``diag`` = :math:`s`, ``factor`` = :math:`V`) or :math:`\Sigma = \mathrm{diag}(d) + WW^\top`
    (``relative=False``, ``diag`` = :math:`d`, ``factor`` = :math:`W`), with the gradients of the module docstring:
    no :math:`P\times K` temporary beyond the factor's gradient (with unbatched parameters; a batched factor's
    gradient sums per-batch :math:`P\times K` terms). First-order differentiable.

    :param value: :math:`\theta`, shape ``[..., P]``.
    :param loc: :math:`m`, ``[..., P]``.
    :param diag: :math:`s > 0` or :math:`d > 0`, ``[..., P]``.
    :param factor: :math:`V` or :math:`W`, ``[..., P, K]``.
    :param check_errors: raise a ``ValueError`` where the capacitance is not positive definite (one host read;
        :func:`low_rank_capacitance_tril`) instead of returning NaN.
    :param fused: the gradients by the formulas above, in one custom autograd node (default); ``False``: the same
        log-density in plain differentiable operations, which autograd differentiates (a step captured as a graph of
        tensor operations, :mod:`pyro_flat.runtime.capture`, cannot keep a custom node's backward).
    :returns: the log-density, shape the broadcast batch shape.
    """
    if not fused:
        return _density(value, loc, diag, factor, relative, check_errors)[0]
    return _LowRankLogProb.apply(*_seen_by_torch(value, loc, diag, factor), relative, check_errors)


def low_rank_covariance_product(scale: Tensor, factor: Tensor, vector: Tensor) -> Tensor:
    r""":math:`\Sigma v = s\odot\big(s\odot v + V (V^\top (s\odot v))\big)` in :math:`O(PK)`, with the relative
    factor :math:`V` (``vector`` may carry leading batch dimensions)."""
    scaled = scale * vector
    return scale * (scaled + (scaled @ factor) @ factor.transpose(-1, -2))


def swag_to_low_rank(
    mean: Tensor, variance: Tensor, deviations: Tensor, *, scale: float = 0.5, min_variance: float = 1e-30
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Convert SWAG moments into the parameters :math:`(m, s, V)` of the low-rank-plus-diagonal Gaussian.

    :param mean: :math:`\bar\theta`, shape ``[P]``.
    :param variance: the diagonal variance :math:`\overline{\theta^2}-\bar\theta^2`, shape ``[P]`` (clamped below at
        ``min_variance``, as SWAG's ``var_clamp``, since round-off can make it slightly negative).
    :param deviations: :math:`D`, shape ``[P, K]`` with :math:`K \ge 1` columns (:math:`K - 1` is replaced by 1 when
        :math:`K = 1`).
    :param scale: SWAG's covariance scale :math:`c > 0` (default 0.5, the SWAG paper's choice).
    :param min_variance: the clamp of ``variance``, :math:`> 0`.
    :returns: ``(loc, scale, factor)`` with ``loc = mean``, ``scale`` :math:`s=\sqrt{c\cdot\mathrm{var}}` and the
        relative ``factor`` :math:`V = D/\sqrt{(K-1)\,\mathrm{var}}` (rows divided), new tensors; the covariance
        :math:`\mathrm{diag}(s)(I+VV^\top)\mathrm{diag}(s)` equals SWAG's :math:`c\,(\mathrm{diag}(\mathrm{var}) +
        DD^\top/(K-1))`.
    """
    if mean.dim() != 1:
        raise ValueError(f"swag_to_low_rank: `mean` must be a vector [P], got shape {tuple(mean.shape)}")
    if variance.shape != mean.shape:
        raise ValueError(
            f"swag_to_low_rank: `variance` must have the shape of `mean` {tuple(mean.shape)}, got "
            f"{tuple(variance.shape)}"
        )
    if deviations.dim() != 2 or deviations.shape[0] != mean.shape[0] or deviations.shape[1] < 1:
        raise ValueError(
            f"swag_to_low_rank: `deviations` must be a matrix [P={mean.shape[0]}, K>=1], got shape "
            f"{tuple(deviations.shape)}"
        )
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"swag_to_low_rank: `scale` must be a finite number > 0, got {scale!r}")
    if not (isinstance(min_variance, (int, float)) and min_variance > 0):
        raise ValueError(f"swag_to_low_rank: `min_variance` must be a number > 0, got {min_variance!r}")
    rank = deviations.shape[1]
    variance = variance.clamp(min=min_variance)
    factor = deviations / (max(rank - 1, 1) * variance).sqrt().unsqueeze(-1)
    return mean.clone(), (scale * variance).sqrt(), factor


def _draw_and_density(
    loc: Tensor, scale: Tensor, factor: Tensor, noise_diag: Tensor, noise_rank: Tensor, check_errors: bool
) -> tuple[Tensor, ...]:
    """``(theta, log q(theta), L, a)`` in plain differentiable operations (the forward pass of
    :class:`_LowRankSampleLogProb`)."""
    whitened = noise_diag + _factor_times(factor, noise_rank)  # x = (theta - m) / s
    value = loc + scale * whitened
    projected = _factor_transpose_times(factor, whitened)
    tril = low_rank_capacitance_tril(factor, check_errors=check_errors)
    solved = _capacitance_solve(tril, projected)
    mahalanobis = whitened.square().sum(-1) - (projected * solved).sum(-1)
    logdet = 2 * scale.log().sum(-1) + 2 * tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return value, -0.5 * (value.shape[-1] * math.log(2 * math.pi) + logdet + mahalanobis), tril, solved


class _LowRankSampleLogProb(torch.autograd.Function):
    r"""The draw :math:`\theta = m + s\odot(z_1 + Vz_2)` and :math:`\log q(\theta)` as one node: the gradient of the
    log-density is its total derivative (through :math:`\theta` too), and the factor receives one gradient buffer."""

    @staticmethod
    def forward(
        ctx: object, loc: Tensor, scale: Tensor, factor: Tensor, noise_diag: Tensor, noise_rank: Tensor,
        check_errors: bool,
    ) -> tuple[Tensor, Tensor]:
        value, log_prob, tril, solved = _draw_and_density(loc, scale, factor, noise_diag, noise_rank, check_errors)
        ctx.save_for_backward(loc, scale, factor, noise_diag, noise_rank, tril, solved)
        return value, log_prob

    @staticmethod
    @once_differentiable
    def backward(ctx: object, grad_value: Tensor, grad_log_prob: Tensor) -> tuple[Tensor | None, ...]:
        # total derivatives of log q(m + s (z1 + V z2)) = -sum log s - (terms in V and the noise): 0 in m, -1/s in s,
        # and in V: g (r (a - z2)^T - V C^{-1}) with r = x - Va, x = z1 + V z2
        loc, scale, factor, noise_diag, noise_rank, tril, solved = ctx.saved_tensors
        weight = grad_log_prob.unsqueeze(-1)
        whitened = _factor_times(factor, noise_rank).add_(noise_diag)  # x
        grad_loc = grad_scale = grad_factor = None
        if ctx.needs_input_grad[0]:
            grad_loc = _sum_to(grad_value, loc.shape)
        if ctx.needs_input_grad[1]:
            grad_scale = _sum_to((grad_value * whitened).addcdiv_(weight, scale, value=-1), scale.shape)
        if ctx.needs_input_grad[2]:
            weighted_residual = whitened.sub_(_factor_times(factor, solved)).mul_(weight)  # g r, in place of x
            through_value = grad_value * scale
            total = _sum_to(grad_log_prob, factor.shape[:-2])[..., None, None]
            grad_factor = factor @ (-total * _capacitance_inverse(tril))  # the one P x K buffer
            shift = solved - noise_rank  # a - z2
            if factor.dim() == 2:
                rows, rank = factor.shape
                grad_factor.addmm_(through_value.reshape(-1, rows).mT, noise_rank.reshape(-1, rank))
                grad_factor.addmm_(weighted_residual.reshape(-1, rows).mT, shift.reshape(-1, rank))
            else:
                outer = through_value.unsqueeze(-1) * noise_rank.unsqueeze(-2)
                outer = outer + weighted_residual.unsqueeze(-1) * shift.unsqueeze(-2)
                grad_factor = grad_factor + _sum_to(outer, factor.shape)
        return grad_loc, grad_scale, grad_factor, None, None, None


def low_rank_rsample_and_log_prob(
    loc: Tensor, scale: Tensor, factor: Tensor, noise_diag: Tensor, noise_rank: Tensor, *, check_errors: bool = False,
    fused: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""The draw :math:`\theta = m + s\odot(z_1 + Vz_2)` of :func:`low_rank_rsample` (relative form) and
    :math:`\log q(\theta)` of :func:`low_rank_log_prob`, from one autograd node: the gradients of any function of
    both in :math:`(m, s, V)` are those of the two computed apart (the log-density's total derivative, through
    :math:`\theta` too), with one :math:`P\times K` buffer for :math:`V`'s. The log-density has no gradient in
    :math:`\theta` itself (it is a function of the parameters and the noise). First-order differentiable.

    :param loc: :math:`m`, ``[..., P]``.
    :param scale: :math:`s > 0`, ``[..., P]``.
    :param factor: :math:`V`, ``[..., P, K]``.
    :param noise_diag: :math:`z_1`, ``[..., P]`` (the draws' shape).
    :param noise_rank: :math:`z_2`, ``[..., K]``.
    :param check_errors: as for :func:`low_rank_log_prob`.
    :param fused: one custom autograd node (default), or plain differentiable operations (as for
        :func:`low_rank_log_prob`).
    :returns: ``(value, log_prob)``.
    """
    if not fused:
        return _draw_and_density(loc, scale, factor, noise_diag, noise_rank, check_errors)[:2]
    return _LowRankSampleLogProb.apply(*_seen_by_torch(loc, scale, factor, noise_diag, noise_rank), check_errors)
