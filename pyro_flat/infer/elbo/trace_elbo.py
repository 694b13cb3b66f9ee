r"""Pyro's :class:`~pyro.infer.Trace_ELBO` and :class:`~pyro.infer.TraceMeanField_ELBO` with the loss summed as a
tensor: the same estimator, values and gradients, without a host read per sample site.

Pyro's ELBOs turn every site's log-density sum into a Python float as they add it up (``torch_item``, once per model
site and once per guide site) and check the total for NaN (``warn_if_nan``, a read of the loss and a backward hook
that reads its gradient). On a GPU each read waits for the device to finish its queued work: a network with 62
weight tensors makes 126 of them per step. Here the per-particle terms stay on the device,

.. math:: \widehat{\mathrm{ELBO}} = \frac1S\sum_{s=1}^S\Big[\sum_{\text{model sites}}\log p
    - \sum_{\text{guide sites}}\log q\Big],

with Pyro's surrogate (score-function terms for guide sites without ``rsample``, Rao-Blackwellised by the plates as
in ``Trace_ELBO``; analytic KL divergences where registered, as in ``TraceMeanField_ELBO``) for the gradients:

* ``loss`` and ``loss_and_grads`` return a Python float, as in Pyro: one host read per call, the float handed back
  (``SVI.step`` and ``SVI.evaluate_loss``);
* ``differentiable_loss`` returns the loss as a differentiable 0-dim tensor: no host read.
  :class:`~pyro_flat.infer.TensorSVI` steps with it and hands back the tensor.

The NaN warning of ``differentiable_loss`` needs a host read; it is made only under Pyro's validation
(``pyro.enable_validation``). A training loop checks the loss's finiteness at an interval instead (the harness every
``log_every`` steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pyro.distributions.util import is_identically_zero, scale_and_mask
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.util import check_fully_reparametrized, is_validation_enabled
from pyro.poutine import Trace
from pyro.util import warn_if_nan
from torch import Tensor
from torch.distributions import kl_divergence

from ..._internals import trace_log_r

__all__ = ["TensorTraceMeanField_ELBO", "TensorTrace_ELBO"]


class _TensorLoss:
    """The three entry points of Pyro's ELBOs on top of a ``_differentiable_loss_particle`` that returns the loss
    and the surrogate loss of one particle as tensors."""

    def _particles(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
        loss, surrogate = 0.0, 0.0
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            loss_particle, surrogate_particle = self._differentiable_loss_particle(model_trace, guide_trace)
            loss = loss + loss_particle / self.num_particles
            surrogate = surrogate + surrogate_particle / self.num_particles
        return torch.as_tensor(loss), torch.as_tensor(surrogate)

    def loss(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> float:
        """The loss :math:`-\\widehat{\\mathrm{ELBO}}` as a Python float (one host read)."""
        loss, _ = self._particles(model, guide, args, kwargs)
        value = loss.item()
        warn_if_nan(value, "loss")
        return value

    def differentiable_loss(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> Tensor:
        """The loss as a 0-dim tensor whose gradient is the surrogate's (no host read)."""
        loss, surrogate = self._particles(model, guide, args, kwargs)
        if is_validation_enabled():
            warn_if_nan(surrogate, "loss")
        return loss + (surrogate - surrogate.detach())

    def loss_and_grads(self, model: Callable, guide: Callable, *args: object, **kwargs: object) -> float:
        """Backpropagate the surrogate loss of each particle; return the loss as a Python float (one host read)."""
        loss = 0.0
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            loss_particle, surrogate_particle = self._differentiable_loss_particle(model_trace, guide_trace)
            loss = loss + loss_particle / self.num_particles
            trainable = any(
                site["type"] == "param" for trace in (model_trace, guide_trace) for site in trace.nodes.values()
            )
            if trainable and getattr(surrogate_particle, "requires_grad", False):
                (surrogate_particle / self.num_particles).backward(retain_graph=self.retain_graph)
        value = torch.as_tensor(loss).item()
        warn_if_nan(value, "loss")
        return value


class TensorTrace_ELBO(_TensorLoss, Trace_ELBO):  # noqa: N801 (named like Pyro's ELBOs)
    """:class:`~pyro.infer.Trace_ELBO` with the loss summed as a tensor (see the module docstring): the same values
    and gradients, no host read per site; ``differentiable_loss`` makes none at all.

    :param kwargs: :class:`~pyro.infer.Trace_ELBO`'s options (``num_particles``, ``vectorize_particles``, ...).
    """

    def _differentiable_loss_particle(self, model_trace: Trace, guide_trace: Trace) -> tuple[Tensor, Tensor]:
        elbo = 0.0
        for site in model_trace.nodes.values():
            if site["type"] == "sample":
                elbo = elbo + site["log_prob_sum"]
        surrogate_terms, log_r = 0.0, None
        for site in guide_trace.nodes.values():
            if site["type"] != "sample":
                continue
            elbo = elbo - site["log_prob_sum"]
            log_prob, score_function_term, entropy_term = site["score_parts"]
            # the surrogate is the ELBO with -log q replaced by the entropy term and the score-function term added;
            # for a reparameterised site the entropy term *is* log q (Pyro's ScoreParts), which adds nothing
            if entropy_term is not log_prob:
                surrogate_terms = surrogate_terms + site["log_prob_sum"]
                if not is_identically_zero(entropy_term):
                    surrogate_terms = surrogate_terms - entropy_term.sum()
            if not is_identically_zero(score_function_term):
                if log_r is None:
                    log_r = trace_log_r(model_trace, guide_trace)
                surrogate_terms = surrogate_terms + (log_r.sum_to(site["cond_indep_stack"]) * score_function_term).sum()
        elbo = torch.as_tensor(elbo)
        return -elbo.detach(), -(elbo + surrogate_terms)


class TensorTraceMeanField_ELBO(_TensorLoss, TraceMeanField_ELBO):  # noqa: N801 (named like Pyro's ELBOs)
    """:class:`~pyro.infer.TraceMeanField_ELBO` with the loss summed as a tensor (see the module docstring): analytic
    KL divergences where registered, the same values and gradients, no host read per site; ``differentiable_loss``
    makes none at all.

    :param kwargs: :class:`~pyro.infer.TraceMeanField_ELBO`'s options.
    """

    def _differentiable_loss_particle(self, model_trace: Trace, guide_trace: Trace) -> tuple[Tensor, Tensor]:
        elbo = 0.0
        for name, model_site in model_trace.nodes.items():
            if model_site["type"] != "sample":
                continue
            if model_site["is_observed"]:
                elbo = elbo + model_site["log_prob_sum"]
                continue
            guide_site = guide_trace.nodes[name]
            if is_validation_enabled():
                check_fully_reparametrized(guide_site)
            try:
                kl = kl_divergence(guide_site["fn"], model_site["fn"])
            except NotImplementedError:  # sampled estimate
                elbo = elbo + model_site["log_prob_sum"] - guide_site["score_parts"].entropy_term.sum()
            else:
                elbo = elbo - scale_and_mask(kl, guide_site["scale"], guide_site["mask"]).sum()
        for name, guide_site in guide_trace.nodes.items():
            if guide_site["type"] == "sample" and name not in model_trace.nodes:  # auxiliary sites
                if is_validation_enabled():
                    check_fully_reparametrized(guide_site)
                elbo = elbo - guide_site["score_parts"].entropy_term.sum()
        elbo = torch.as_tensor(elbo)
        return -elbo.detach(), -elbo
