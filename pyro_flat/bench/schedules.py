r"""The learning-rate and step-size schedules of the harness, from one place.

* :class:`CosineDecay`: the multiplier of a cosine decay over a training phase (``lr_schedule="cosine"``, bSAM);
* :class:`~pyro_flat.infer.averaging.CyclicalLR`: SWA's cyclical learning rate (HWA's cycles);
* :class:`~pyro_flat.infer.mcmc.CyclicalStepSize`: cSGLD's cyclical cosine step size (``csgld``, ``emcmc`` with
  ``cycles``).

The last two belong to the library; the harness's methods take them from here.
"""

from __future__ import annotations

import math

from ..infer.averaging import CyclicalLR
from ..infer.mcmc import CyclicalStepSize

__all__ = ["CosineDecay", "CyclicalLR", "CyclicalStepSize"]


class CosineDecay:
    """The multiplier :math:`\\frac12(1+\\cos(\\pi t/T))` of a cosine decay over ``num_steps`` :math:`T` (a class, so
    that it pickles)."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps = max(1, num_steps)

    def __call__(self, step: int) -> float:
        return 0.5 * (1 + math.cos(math.pi * min(step, self.num_steps) / self.num_steps))
