"""Small helpers on Pyro traces shared by the objectives, kernels and predictors."""

from __future__ import annotations

from pyro import poutine
from torch import Tensor


def is_subsample_site(site: dict) -> bool:
    """Whether ``site`` is the index draw of a subsampled ``pyro.plate`` (a ``sample`` site, but not a latent)."""
    return site["type"] == "sample" and type(site["fn"]).__name__ == "_Subsample"


def is_latent_site(site: dict) -> bool:
    """A latent sample site: not observed, not deterministic, not a plate's subsample indices, and not an autoguide's
    auxiliary site (e.g. ``AutoNormal``'s ``"w_unconstrained"``, which the guide maps to the model's site ``"w"``)."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not is_subsample_site(site)
        and not site["infer"].get("_deterministic", False)
        and not site["infer"].get("is_auxiliary", False)
    )


def latent_sites(trace: poutine.Trace) -> dict[str, Tensor]:
    """The values of the latent sample sites of ``trace`` (see :func:`is_latent_site`), in trace order."""
    return {name: site["value"] for name, site in trace.nodes.items() if is_latent_site(site)}
