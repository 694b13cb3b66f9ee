"""Pyro's :class:`~pyro.infer.SVI` with a step that leaves the loss on the device."""

from __future__ import annotations

from collections.abc import Callable

import pyro
from pyro import poutine
from pyro.infer import ELBO, SVI
from pyro.optim import PyroOptim
from torch import Tensor

from .._internals import unconstrained_of

__all__ = ["TensorSVI"]


class TensorSVI(SVI):
    """:class:`~pyro.infer.SVI` whose :meth:`step` returns the loss as a detached 0-dim tensor on the model's device
    instead of a Python float, so that a training step makes no host read (``SVI.step`` reads the loss once to hand
    it back). Read the loss when you need it, e.g. every hundred steps; ``evaluate_loss`` returns a float, as in Pyro.

    A step backpropagates the objective's ``differentiable_loss`` (the particles' losses summed, then one backward
    pass: the gradients of ``loss_and_grads``). It makes no host read with an objective whose ``differentiable_loss``
    makes none: every objective of :mod:`pyro_flat.infer`, and :class:`~pyro_flat.infer.TensorTrace_ELBO` /
    :class:`~pyro_flat.infer.TensorTraceMeanField_ELBO` in place of Pyro's ``Trace_ELBO`` / ``TraceMeanField_ELBO``
    (Pyro's read every site's log-density as a float).

    :param model: the Pyro model.
    :param guide: the guide.
    :param optim: a ``PyroOptim``.
    :param loss: an ELBO (its ``differentiable_loss`` is used) or a callable ``loss(model, guide, *args, **kwargs)``
        returning a differentiable tensor, as for ``SVI``.
    :param bool set_grads_to_none: after the optimiser's step, drop the gradients (``p.grad = None``, as torch's
        ``Optimizer.zero_grad(set_to_none=True)``) instead of Pyro's fresh zeros; default ``False`` (Pyro's). The
        gradients then take no memory between steps, and the next backward pass writes them without a second buffer
        (Pyro's replacement allocates zeros while the old gradients are alive, and the next backward pass adds into
        them: two gradient-sized buffers at once, e.g. for a low-rank guide's factor). The steps differ from Pyro's
        only for a parameter that stops receiving gradients: Pyro's optimisers keep moving it with zero gradients
        (Adam's momentum), torch's skip it.
    :param kwargs: ``SVI``'s other options.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim: PyroOptim,
        loss: ELBO | Callable,
        *,
        set_grads_to_none: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(model, guide, optim, loss, **kwargs)
        self.set_grads_to_none = bool(set_grads_to_none)
        # Pyro's SVI keeps only the ELBO's bound methods; a plain callable loss is its differentiable loss
        self._differentiable_loss = loss.differentiable_loss if isinstance(loss, ELBO) else loss

    def step(self, *args: object, **kwargs: object) -> Tensor:
        """One optimisation step (the loss's gradients, then the optimiser); returns the loss as a 0-dim tensor."""
        with poutine.trace(param_only=True) as param_capture:
            loss = self._differentiable_loss(self.model, self.guide, *args, **kwargs)
        params = {unconstrained_of(site["value"]) for site in param_capture.trace.nodes.values()}
        if params and loss.requires_grad:
            loss.backward()
        self.optim(params)
        if self.set_grads_to_none:
            for param in params:
                param.grad = None
        else:
            pyro.infer.util.zero_grads(params)
        return loss.detach()
