"""Small helpers on Pyro models and traces shared by the objectives, kernels and predictors."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch
from pyro import poutine
from pyro.distributions import Delta
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.distributions import constraints

from .._internals import is_deterministic_record
from .batchnorm import batchnorm_statistics_frozen

__all__ = ["NothingToPerturbWarning", "at_latent_values", "is_deterministic_site", "is_latent_site", "is_real_support",
           "latent_sites", "latent_supports", "subsampled_plate", "warn_nothing_to_perturb"]


class NothingToPerturbWarning(UserWarning):
    """A flat objective or model transform found nothing to perturb (no latent site, no observation, a guide without
    parameters): its value is the base objective's, or the model's own density. Issued once per objective or
    transformed model and cause."""


def warn_nothing_to_perturb(owner: object, cause: str, message: str) -> None:
    """A :class:`NothingToPerturbWarning` with ``message``, the first time ``owner`` meets ``cause`` (a check made
    in Python on the traced sites: no host read)."""
    warned = owner.__dict__.setdefault("_nothing_to_perturb", set())
    if cause not in warned:
        warned.add(cause)
        warnings.warn(message, NothingToPerturbWarning, stacklevel=3)


def is_latent_site(site: dict) -> bool:
    """A latent sample site: not observed, not deterministic, not a plate's subsample indices, and not an autoguide's
    auxiliary site (e.g. ``AutoNormal``'s ``"w_unconstrained"``, which the guide maps to the model's site ``"w"``)."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not is_deterministic_record(site)
        and not site["infer"].get("is_auxiliary", False)
    )


def subsampled_plate(site: dict) -> str | None:
    """The name of the first subsampled plate ``site`` sits in (a minibatch of a larger plate), else ``None``."""
    return next((frame.name for frame in site["cond_indep_stack"] if frame.size != frame.full_size), None)


def is_deterministic_site(site: dict) -> bool:
    """A sample site that only records a function of other sites: a ``pyro.deterministic`` record, or the observed
    ``Delta`` that ``poutine.reparam`` puts in place of a reparameterised site (``LocScaleReparam``,
    ``TransformReparam``, ...; Pyro's own rule in ``pyro.infer.inspect``). Its value is recomputed, never scored as
    an observation."""
    if site["type"] != "sample":
        return False
    if is_deterministic_record(site):
        return True
    fn = site["fn"]
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return bool(site["is_observed"]) and isinstance(fn, Delta)


def latent_sites(trace: poutine.Trace) -> dict[str, Tensor]:
    """The values of the latent sample sites of ``trace`` (see :func:`is_latent_site`), in trace order."""
    return {name: site["value"] for name, site in trace.nodes.items() if is_latent_site(site)}


def at_latent_values(model: Callable, values: Mapping[str, Tensor]) -> Callable:
    """``model`` with the latent sites named in ``values`` set to those values (constrained, as the model samples
    them), the way a guide's values are set: Pyro's ``poutine.replay``.

    Unlike ``poutine.condition``, which turns the sites into *observations*, they stay latent: their prior is scored
    at the given values and a model transform (:func:`~pyro_flat.transforms.sharpness_aware`,
    :func:`~pyro_flat.transforms.local_entropy`) treats them as latents. Use it to evaluate a (transformed) model's
    log density at given latent values.
    """
    trace = poutine.Trace()
    for name, value in values.items():
        trace.add_node(name, type="sample", name=name, value=value, is_observed=False, infer={})
    return poutine.replay(model, trace=trace)


def is_real_support(support: constraints.Constraint) -> bool:
    """Whether ``support`` is the real line (possibly as an ``independent`` event): no transform, no Jacobian."""
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def latent_supports(model: Callable, *args: object, **kwargs: object) -> dict[str, constraints.Constraint]:
    """The supports of the latent sites of ``model``: ``{site: constraint}``, in trace order.

    ``model`` may be a Pyro model (run once with ``args``/``kwargs``, hidden from enclosing handlers, without
    gradients and without updating BatchNorm statistics) or an autoguide that has been run once (its prototype
    trace is read; no arguments needed).
    """
    trace = getattr(model, "prototype_trace", None)
    if trace is None:
        with torch.no_grad(), poutine.block(), batchnorm_statistics_frozen():
            trace = poutine.trace(model).get_trace(*args, **kwargs)
    return {name: site["fn"].support for name, site in trace.nodes.items() if is_latent_site(site)}
