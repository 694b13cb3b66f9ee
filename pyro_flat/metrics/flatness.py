r"""Flatness of a network or a Pyro model: Hessian eigenvalues, Hessian trace and SAM sharpness.

Thin adapters of :mod:`pyro_flat.ops.hessian` onto ``torch.nn.Module`` networks and Pyro models. Build a loss as a
function of the parameters with :func:`network_loss_fn` (a list of tensors) or :func:`model_loss_fn` (a dict
``{site name: value}``), then call :func:`hessian_eigenvalues`, :func:`hessian_trace` or :func:`sam_sharpness`.

The flatness of a point depends on a triple that must be fixed, and reported, to compare methods:

* **the loss**: here the *mean* training loss over a fixed data set, without the prior or weight decay (which would
  add :math:`\lambda_{wd}I` to the Hessian);
* **the data subset**: use one fixed, seeded subset of a few thousand points; mini-batch estimates are unstable, and
  a subsampled plate in a Pyro model is frozen at its first draw (see :func:`model_loss_fn`);
* **the network mode**: a network is evaluated in its *current* mode; call ``module.eval()`` for the usual
  eval-mode Hessian (BatchNorm with running statistics, no dropout), as PyHessian does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor, nn
from torch.func import functional_call

from .._internals import is_deterministic_record
from ..ops import hessian as _hessian

Params = Mapping[str, Tensor] | Sequence[Tensor]

_LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "cross_entropy": nn.functional.cross_entropy,
    "mse": nn.functional.mse_loss,
}


def network_loss_fn(
    module: nn.Module, x: Tensor, y: Tensor, *, loss: str = "cross_entropy"
) -> tuple[Callable[[list[Tensor]], Tensor], list[Tensor]]:
    r"""The mean training loss of ``module`` on ``(x, y)`` as a function of its trainable parameters.

    .. math:: L(\theta)=\frac1n\sum_{i=1}^n\ell\big(f_\theta(x_i),y_i\big),

    with :math:`\ell` the cross-entropy of the logits :math:`f_\theta(x_i)` and the label :math:`y_i`
    (``"cross_entropy"``, :func:`torch.nn.functional.cross_entropy`) or the squared error averaged over all output
    elements (``"mse"``, :func:`torch.nn.functional.mse_loss`). The network runs through
    :func:`torch.func.functional_call`, so the module itself is never modified: its trainable parameters are
    replaced by the function's argument, frozen parameters (``requires_grad=False``) are used as they are, and
    buffers are *copies* taken now (in train mode BatchNorm updates the copies, not the module's running statistics).

    :param module: the network :math:`f_\theta`, evaluated in its current train/eval mode.
    :param x: inputs, shape ``[n, ...]``.
    :param y: targets: class labels ``[n]`` (int64) for cross-entropy, values shaped like the output for MSE.
    :param str loss: ``"cross_entropy"`` (default) or ``"mse"``.
    :returns: ``(loss_fn, params)``: ``loss_fn(list_of_tensors) -> scalar`` in the order of
        ``module.named_parameters()`` (trainable ones only), and the current values of those parameters (detached,
        sharing storage with the module).
    """
    if loss not in _LOSSES:
        raise ValueError(f"`loss` must be one of {sorted(_LOSSES)}, got {loss!r}")
    if not isinstance(x, Tensor) or not isinstance(y, Tensor) or x.ndim == 0 or y.ndim == 0:
        raise ValueError("`x` and `y` must be tensors with a leading data dimension")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"`x` and `y` must have the same number of rows, got {x.shape[0]} and {y.shape[0]}")
    trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("`module` has no trainable parameters (none with requires_grad=True)")
    names = [name for name, _ in trainable]
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    criterion = _LOSSES[loss]

    def loss_fn(values: list[Tensor]) -> Tensor:
        if len(values) != len(names):
            raise ValueError(f"loss_fn expects {len(names)} tensors (the trainable parameters), got {len(values)}")
        output = functional_call(module, {**buffers, **dict(zip(names, values, strict=True))}, (x,))
        return criterion(output, y)

    return loss_fn, [p.detach() for _, p in trainable]


def _sum_and_count(site: dict) -> tuple[Tensor, Tensor | int] | None:
    """The unscaled log-likelihood sum of an observed site and the number of observations, honouring masks."""
    log_prob = site["fn"].log_prob(site["value"])
    mask = site["mask"]
    if mask is None or mask is True:
        return log_prob.sum(), log_prob.numel()
    if mask is False:
        return None
    log_prob, mask = torch.broadcast_tensors(log_prob, mask)
    return torch.where(mask, log_prob, torch.zeros_like(log_prob)).sum(), mask.sum()


def model_loss_fn(
    model: Callable[..., object], *args: object, **kwargs: object
) -> Callable[[Mapping[str, Tensor]], Tensor]:
    r"""The mean negative log-likelihood of a Pyro model as a function of its latent values.

    .. math:: L(\theta)=-\frac1n\sum_{\text{observed sites }o}\ \sum_{j}\log p(o_j\mid\theta),

    where :math:`\theta` = ``{site name: value}`` fixes every latent sample site (by :func:`pyro.poutine.condition`),
    the sum runs over the entries :math:`o_j` of every *observed* sample site of the trace of
    ``model(*args, **kwargs)`` and :math:`n` is the total number of entries (the ``numel`` of each observed site's
    ``log_prob``; masked entries are excluded from both). This is the training loss at :math:`\theta`: no prior, and
    **no plate scaling** — the :math:`N/B` factor of a subsampled ``pyro.plate`` is ignored, so the value is a mean
    over the minibatch, comparable to :func:`network_loss_fn`. :math:`\theta` are values in the sites' constrained
    space (for real-valued network weights the same thing). The result is twice differentiable in :math:`\theta`.

    Subsample indices drawn by ``pyro.plate(..., subsample_size=B)`` are drawn once, at the first call, and replayed
    at every later call of the returned function, so that every Hessian-vector product sees the same minibatch (a
    new minibatch per product would make power iteration or Lanczos meaningless). Call :func:`model_loss_fn` again
    for a new minibatch; better, pass a fixed data subset without subsampling.

    :param model: a Pyro model; ``pyro.factor`` statements count as observed sites, ``pyro.deterministic`` ones do
        not.
    :param args: positional arguments of ``model`` (e.g. ``x, y``).
    :param kwargs: keyword arguments of ``model``.
    :returns: ``loss_fn(theta: dict[str, Tensor]) -> scalar``. It raises ``ValueError`` if ``theta`` names a site
        the model does not sample, leaves a latent site unset, or if the model observes nothing.
    """
    frozen_subsamples: dict[str, Tensor] = {}
    first_call = True

    def loss_fn(theta: Mapping[str, Tensor]) -> Tensor:
        nonlocal first_call
        if not isinstance(theta, Mapping):
            raise ValueError(f"`theta` must be a dict {{site name: value}}, got {type(theta).__name__}")
        conditioned = poutine.condition(model, data={**frozen_subsamples, **theta})
        trace = poutine.trace(conditioned).get_trace(*args, **kwargs)
        sample_sites = {name: site for name, site in trace.nodes.items() if site["type"] == "sample"}
        if first_call:
            unknown = sorted(set(theta) - set(sample_sites))
            if unknown:
                raise ValueError(
                    f"`theta` names {unknown}, which the model does not sample; its sites: {sorted(sample_sites)}"
                )
            for name, site in sample_sites.items():
                if site_is_subsample(site):
                    frozen_subsamples[name] = site["value"]
            first_call = False
        latent = sorted(n for n, s in sample_sites.items() if not s["is_observed"] and not site_is_subsample(s))
        if latent:
            raise ValueError(f"`theta` must give a value to every latent site; missing: {latent}")
        total, count = 0.0, 0
        for name, site in sample_sites.items():
            if name in theta or site_is_subsample(site) or is_deterministic_record(site):
                continue  # latents, plate indices and pyro.deterministic records are not observations
            term = _sum_and_count(site)
            if term is not None:
                total, count = total + term[0], count + term[1]
        if isinstance(count, int) and count == 0:
            raise ValueError("the model has no observed sample sites (obs=...): there is no likelihood to evaluate")
        return -total / count

    return loss_fn


def _as_list(loss_fn: Callable[..., Tensor], params: Params) -> tuple[Callable[[list[Tensor]], Tensor], list[Tensor]]:
    """Adapt a dict-valued loss to the list-of-tensors convention of :mod:`pyro_flat.ops.hessian`."""
    if isinstance(params, Mapping):
        names = list(params)
        return (lambda values: loss_fn(dict(zip(names, values, strict=True)))), list(params.values())
    return loss_fn, params


def hessian_eigenvalues(
    loss_fn: Callable[..., Tensor],
    params: Params,
    k: int = 1,
    *,
    num_iters: int = 100,
    tol: float = 1e-4,
    generator: torch.Generator | None = None,
    eigenvectors: bool = False,
) -> Tensor | tuple[Tensor, list[dict[str, Tensor]] | list[list[Tensor]]]:
    r"""The :math:`k` largest eigenvalues :math:`\lambda_1\ge\dots\ge\lambda_k` of the Hessian of ``loss_fn`` (and,
    with ``eigenvectors=True``, their unit eigenvectors).

    :math:`\lambda_1=\lambda_{\max}` is the usual sharpness measure. Lanczos with full reorthogonalisation: see
    :func:`pyro_flat.ops.hessian.top_hessian_eigenpairs` for the method and the stopping rule.

    :param loss_fn: from :func:`network_loss_fn` (takes a list) or :func:`model_loss_fn` (takes a dict).
    :param params: the point: a list of tensors for a list loss, ``{site name: value}`` for a dict loss.
    :param int k: number of eigenvalues, default 1.
    :param int num_iters: maximum number of Hessian-vector products, default 100.
    :param float tol: relative residual tolerance, default 1e-4.
    :param generator: random generator on the parameters' device.
    :param bool eigenvectors: also return the eigenvectors (default ``False``).
    :returns: the eigenvalues, shape ``[k]``, descending; with ``eigenvectors=True`` the pair ``(eigenvalues,
        vectors)``, each of the ``k`` vectors structured like ``params`` (a dict or a list of tensors) with global
        L2 norm 1.
    """
    fn, values = _as_list(loss_fn, params)
    eigenvalues, vectors = _hessian.top_hessian_eigenpairs(
        fn, values, k, num_iters=num_iters, tol=tol, generator=generator
    )
    if not eigenvectors:
        return eigenvalues
    if isinstance(params, Mapping):
        return eigenvalues, [dict(zip(params, v, strict=True)) for v in vectors]
    return eigenvalues, vectors


def hessian_trace(
    loss_fn: Callable[..., Tensor],
    params: Params,
    *,
    num_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Hutchinson's estimate of :math:`\operatorname{tr}\nabla^2L(\theta)` with ``num_samples`` Rademacher probes.

    See :func:`pyro_flat.ops.hessian.hutchinson_trace` (its standard error is
    :math:`\sqrt{2\sum_{i\ne j}H_{ij}^2/M}`; :func:`pyro_flat.ops.hessian.hutchinson_trace_estimates` gives the probes).

    :param loss_fn: from :func:`network_loss_fn` (takes a list) or :func:`model_loss_fn` (takes a dict).
    :param params: the point: a list of tensors for a list loss, ``{site name: value}`` for a dict loss.
    :param int num_samples: number of probes :math:`M`, default 100.
    :param generator: random generator on the parameters' device.
    :returns: a 0-d tensor.
    """
    fn, values = _as_list(loss_fn, params)
    return _hessian.hutchinson_trace(fn, values, num_samples=num_samples, generator=generator)


def sam_sharpness(loss_fn: Callable[..., Tensor], params: Params, rho: float = 0.05) -> Tensor:
    r"""SAM sharpness :math:`L(\theta+\rho\,g/\|g\|_2)-L(\theta)`, :math:`g=\nabla L(\theta)`, global L2 norm.

    See :func:`pyro_flat.ops.hessian.sam_sharpness`.

    :param loss_fn: from :func:`network_loss_fn` (takes a list) or :func:`model_loss_fn` (takes a dict).
    :param params: the point: a list of tensors for a list loss, ``{site name: value}`` for a dict loss.
    :param float rho: radius :math:`\rho\ge0`, default 0.05 — SAM's usual radius [Foret et al. 2021] and the one
        used by F-BNN, so the value measures the flatness the flat-seeking objectives target.
    :returns: a 0-d tensor.
    """
    fn, values = _as_list(loss_fn, params)
    return _hessian.sam_sharpness(fn, values, rho)


__all__ = [
    "hessian_eigenvalues",
    "hessian_trace",
    "model_loss_fn",
    "network_loss_fn",
    "sam_sharpness",
]
