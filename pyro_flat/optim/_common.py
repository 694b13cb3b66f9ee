"""Validation and closure handling shared by the closure-based optimizers of :mod:`pyro_flat.optim`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._validation import check_real  # noqa: F401  (where the optimizers imported it from)
from ..ops.efficient_sam import SAM_STEP, looksam_direction, looksam_gradient, sharpness_sensitive_selection
from ..runtime.replay import RunRecorder

Closure = Callable[[], Tensor | None]
"""A closure: evaluates the (mean) minibatch loss at the current parameters and calls ``backward()`` on it."""


def as_closures(owner: str, closure: Closure | Sequence[Closure] | None) -> list[Closure]:
    """One closure, or one per sub-batch (m-sharpness), as a non-empty list."""
    if closure is None:
        raise ValueError(f"{owner}.step needs a closure that computes the loss and calls backward()")
    closures = [closure] if callable(closure) else list(closure)
    if not closures or not all(callable(c) for c in closures):
        raise ValueError(f"{owner}.step: `closure` must be a callable or a non-empty sequence of callables")
    return closures


PerExampleClosure = Callable[[Tensor | None], Tensor]
"""A closure of ESAM's data selection: ``closure(subset)`` returns the loss of every example of its minibatch
(``subset=None``) or of the examples at the positions ``subset`` (a 1-D ``LongTensor``), as a 1-D tensor, without
calling ``backward()``."""


def gradients_at(
    closure: Closure | PerExampleClosure, params: Sequence[Tensor], *, per_example: bool = False,
    subset: Tensor | None = None,
) -> tuple[Tensor | None, list[Tensor]]:
    """Zero the gradients, run ``closure`` with grad enabled, and return its loss (detached) and the gradients
    (zeros for parameters the loss does not depend on).

    With ``per_example`` the closure is a :data:`PerExampleClosure` called with ``subset``: the gradients are those of
    the mean of its losses, and the per-example losses are returned."""
    for p in params:
        p.grad = None
    with torch.enable_grad():
        if per_example:
            loss = per_example_losses(closure, subset)
            loss.mean().backward()
        else:
            loss = closure()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    return (None if loss is None else loss.detach()), grads


def per_example_losses(closure: PerExampleClosure, subset: Tensor | None = None) -> Tensor:
    """``closure(subset)``, checked to be a 1-D tensor of per-example losses."""
    losses = closure(subset)
    if not isinstance(losses, Tensor) or losses.dim() != 1:
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            "with ESAM's data selection (esam_gamma < 1) the closure takes `subset` (None or positions in its "
            "minibatch) and returns one loss per example (a 1-D tensor) without calling backward(); it returned "
            f"{shape}"
        )
    return losses


def recorded_gradients_at(
    closure: Closure | PerExampleClosure, params: Sequence[Tensor], *, per_example: bool = False
) -> tuple[Tensor | None, list[Tensor], RunRecorder]:
    """:func:`gradients_at`, recorded (:class:`~pyro_flat.infer.replay.RunRecorder`) so that
    :func:`replayed_gradients_at` can evaluate the closure again as it ran."""
    with RunRecorder() as run:
        loss, grads = gradients_at(closure, params, per_example=per_example)
    return loss, grads, run


def replayed_gradients_at(
    closure: Closure | PerExampleClosure, params: Sequence[Tensor], run: RunRecorder, *, per_example: bool = False,
    subset: Tensor | None = None,
) -> list[Tensor]:
    """The gradients of ``closure`` at the current (moved) ``params``, replaying the recorded evaluation ``run``: the
    same random numbers (dropout masks, a minibatch drawn with torch's generator), the same subsample indices of any
    ``pyro.plate`` the closure runs, BatchNorm running statistics left unchanged (:mod:`pyro_flat.infer.replay`). On
    a ``subset`` of the minibatch only the random stream restarts where the run's did (its plates have another
    size)."""
    with run.replay(sites=subset is None):
        return gradients_at(closure, params, per_example=per_example, subset=subset)[1]


def replayed_losses(closure: PerExampleClosure, run: RunRecorder) -> Tensor:
    """The per-example losses of ``closure`` at the current parameters, without gradients, replaying ``run`` (ESAM's
    scoring pass)."""
    with run.replay(), torch.no_grad():
        return per_example_losses(closure, None)


def mean_loss(losses: Sequence[Tensor | None]) -> Tensor | None:
    """The mean of the closures' losses (``None`` if a closure returned ``None``), without a host sync."""
    if any(loss is None for loss in losses):
        return None
    return losses[0] if len(losses) == 1 else torch.stack(list(losses)).mean()


def ascent_gradients(closure: Closure | PerExampleClosure, params: list[Tensor], run: object, losses: Tensor | None,
                     esam_gamma: float) -> list[Tensor]:
    """The gradients at the perturbed ``params`` (the replayed closure): on the whole minibatch, or, with
    ``esam_gamma < 1``, on ESAM's sharpness-sensitive selection of its examples."""
    if esam_gamma == 1:
        return replayed_gradients_at(closure, params, run)
    selection = sharpness_sensitive_selection(losses, replayed_losses(closure, run), esam_gamma)
    return replayed_gradients_at(closure, params, run, per_example=True, subset=selection)


def looksam_step(optimizer: torch.optim.Optimizer, kind: str, params: list[Tensor], grads: list[Tensor],
                 sam_grads: list[Tensor], alpha: float) -> list[Tensor]:
    """LookSAM's gradient for a step of kind ``kind``: a sharpness-aware step refreshes the direction :math:`g_v`
    (kept in ``optimizer.state[p]["looksam_direction"]``) and returns ``sam_grads``; a reuse step returns ``grads``
    plus the kept direction scaled as in LookSAM."""
    directions = []
    for p in params:
        state = optimizer.state[p]
        if "looksam_direction" not in state:
            state["looksam_direction"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        directions.append(state["looksam_direction"])
    if kind == SAM_STEP:
        torch._foreach_copy_(directions, looksam_direction(grads, sam_grads))
        return sam_grads
    return looksam_gradient(grads, directions, alpha)
