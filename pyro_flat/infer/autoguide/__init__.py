"""Autoguides for flat posteriors (subclasses of Pyro's :class:`~pyro.infer.autoguide.AutoGuide`): the SWAG guide
built from any trajectory (:class:`AutoSWAG`, :class:`SWAGCollector`) and the trainable low-rank-plus-diagonal
Gaussian guide of SA-BMA (:class:`AutoLowRankPlusDiagonalNormal`)."""

from .low_rank import AutoLowRankPlusDiagonalNormal
from .swag import AutoGaussianPosterior, AutoSWAG, LowRankPlusDiagonalNormal, SWAGCollector

__all__ = [
    "AutoGaussianPosterior", "AutoLowRankPlusDiagonalNormal", "AutoSWAG", "LowRankPlusDiagonalNormal", "SWAGCollector"
]
