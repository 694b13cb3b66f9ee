"""Flat-seeking objectives: subclasses of Pyro's ELBOs usable by ``SVI.step`` unchanged."""

from .kl_ball import KLBallELBO

__all__ = ["KLBallELBO"]
