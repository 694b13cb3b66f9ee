"""Autoguides for flat posteriors: subclasses of Pyro's :class:`~pyro.infer.autoguide.AutoGuide`."""

from .low_rank import AutoLowRankPlusDiagonalNormal

__all__ = ["AutoLowRankPlusDiagonalNormal"]
