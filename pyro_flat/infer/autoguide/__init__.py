"""Autoguides for flat posteriors (subclasses of Pyro's :class:`~pyro.infer.autoguide.AutoGuide`): the SWAG guide
built from any trajectory (:class:`AutoSWAG`, :class:`SWAGCollector`) and the trainable low-rank-plus-diagonal
Gaussian guide of SA-BMA (:class:`AutoLowRankPlusDiagonalNormal`)."""

from .gaussian_posterior import AutoGaussianPosterior
from .low_rank import AutoLowRankPlusDiagonalNormal
from .low_rank_normal import LowRankPlusDiagonalNormal
from .swag import AutoSWAG
from .swag_collector import SWAGCollector

__all__ = [
    "AutoGaussianPosterior", "AutoLowRankPlusDiagonalNormal", "AutoSWAG", "LowRankPlusDiagonalNormal", "SWAGCollector"
]
