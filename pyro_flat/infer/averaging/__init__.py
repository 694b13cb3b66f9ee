r"""Averaging along optimisation trajectories: HWA (averaged variational parameters of an SVI guide) and SWA.

SWA [1] is the running mean of weight iterates; it is the mean of a :class:`~pyro_flat.infer.autoguide.SWAGCollector`
(``collector.mean()``, or ``AutoSWAG.median()``), so it has no class of its own. :class:`HWA` averages the means and
scales of a Gaussian SVI guide at the end of each cycle of SWA's cyclical learning rate (:func:`cyclical_lr`,
:func:`cyclical_lr_scheduler`).

[1] `Averaging Weights Leads to Wider Optima and Better Generalization`, Pavel Izmailov, Dmitrii Podoprikhin,
    Timur Garipov, Dmitry Vetrov, Andrew Gordon Wilson (UAI 2018), arXiv:1803.05407
"""

from .hwa import HWA, CyclicalLR, cyclical_lr, cyclical_lr_scheduler, guide_loc_scale

__all__ = ["HWA", "CyclicalLR", "cyclical_lr", "cyclical_lr_scheduler", "guide_loc_scale"]
