"""Flat-seeking variational objectives: subclasses of Pyro's ELBOs usable by ``pyro.infer.SVI`` unchanged."""

from .sharpness_aware import SharpnessAwareELBO, SharpnessAwareMeanFieldELBO

__all__ = ["SharpnessAwareELBO", "SharpnessAwareMeanFieldELBO"]
