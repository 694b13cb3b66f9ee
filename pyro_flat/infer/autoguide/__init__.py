"""Guides for flat posteriors: the SWAG guide built from any trajectory (:class:`AutoSWAG`, :class:`SWAGCollector`)."""

from .swag import AutoSWAG, LowRankPlusDiagonalNormal, SWAGCollector

__all__ = ["AutoSWAG", "LowRankPlusDiagonalNormal", "SWAGCollector"]
