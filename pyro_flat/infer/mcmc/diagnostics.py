r"""Whether chains have mixed: split :math:`\hat R` over two or more chains, with a warning when it is clearly above 1.

For :math:`C\ge2` chains of :math:`S` draws, each chain is split in halves and :math:`\hat R` compares the variance
between the :math:`2C` half-chains with the variance within them (Pyro's :func:`pyro.ops.stats.split_gelman_rubin`);
a chain still drifting, or stuck away from the others, gives :math:`\hat R` well above 1. The classic threshold 1.1
[1] marks chains that have clearly not mixed: run longer (warm-up included), or start closer to the posterior.

References:
    * [1] `Bayesian Data Analysis` (3rd ed.), Andrew Gelman, John Carlin, Hal Stern, David Dunson, Aki Vehtari,
      Donald Rubin (2013), section 11.4
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from pyro.ops.stats import split_gelman_rubin
from torch import Tensor

__all__ = ["NotMixedWarning", "check_mixing"]


class NotMixedWarning(UserWarning):
    """Chains whose split :math:`\\hat R` is above the threshold of :func:`check_mixing`: they have clearly not
    mixed."""


def check_mixing(samples: Mapping[str, Tensor] | object, *, threshold: float = 1.1) -> dict[str, float]:
    r"""Split :math:`\hat R` of every site (the largest over the site's elements), with a :class:`NotMixedWarning`
    naming the sites above ``threshold``.

    :param samples: draws grouped by chain, ``{site: [C, S, ...]}`` with :math:`C\ge2` chains of :math:`S\ge4` draws
        (``MCMC.get_samples(group_by_chain=True)``, :meth:`~pyro_flat.infer.BatchedSGLD.run`), or a
        :class:`pyro.infer.MCMC` that ran ``num_chains >= 2``.
    :param float threshold: the :math:`\hat R` above which a site has clearly not mixed; default 1.1 [1].
    :returns: ``{site: split R-hat}`` (``nan`` for a site that did not move at all).
    :raises ValueError: for fewer than two chains or four draws per chain.
    """
    if hasattr(samples, "get_samples"):
        samples = samples.get_samples(group_by_chain=True)
    if not isinstance(samples, Mapping) or not samples:
        raise ValueError("check_mixing: expected draws {site: [chains, draws, ...]} or an MCMC object")
    rhats = {}
    for name, draws in samples.items():
        if draws.dim() < 2 or draws.shape[0] < 2 or draws.shape[1] < 4:
            raise ValueError(
                f"check_mixing: site {name!r} has draws of shape {tuple(draws.shape)}; split R-hat needs "
                "[chains >= 2, draws >= 4, ...]"
            )
        rhat = split_gelman_rubin(draws.detach().to(torch.float64), chain_dim=0, sample_dim=1).reshape(-1)
        rhat = rhat[~torch.isnan(rhat)]
        rhats[name] = float(rhat.max()) if rhat.numel() else math.nan
    worst = {name: r for name, r in rhats.items() if r > threshold}
    if worst:
        listed = ", ".join(f"{name!r} {r:.2f}" for name, r in sorted(worst.items(), key=lambda item: -item[1]))
        warnings.warn(
            f"the chains have not mixed: split R-hat above {threshold:g} at {listed}. Run them longer (warm-up "
            "included) or start them closer to the posterior",
            NotMixedWarning,
            stacklevel=2,
        )
    return rhats
