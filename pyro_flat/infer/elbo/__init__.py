"""Flat-seeking variational objectives: subclasses of Pyro's ELBOs usable by ``pyro.infer.SVI`` unchanged."""

from .jit import JitKLBallELBO, JitSharpnessAwareELBO, JitSharpnessAwareMeanFieldELBO
from .kl_ball import KLBallELBO
from .sharpness_aware import SharpnessAwareELBO, SharpnessAwareMeanFieldELBO

__all__ = [
    "JitKLBallELBO",
    "JitSharpnessAwareELBO",
    "JitSharpnessAwareMeanFieldELBO",
    "KLBallELBO",
    "SharpnessAwareELBO",
    "SharpnessAwareMeanFieldELBO",
]
