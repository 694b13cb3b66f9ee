"""Flat-seeking variational objectives, subclasses of Pyro's ELBOs usable by ``pyro.infer.SVI`` unchanged, and their
bases: Pyro's ``Trace_ELBO`` / ``TraceMeanField_ELBO`` with the loss summed on the device."""

from .jit import JitKLBallELBO, JitSharpnessAwareELBO, JitSharpnessAwareMeanFieldELBO, JitTensorTrace_ELBO
from .kl_ball import KLBallELBO
from .sharpness_aware import SharpnessAwareELBO, SharpnessAwareMeanFieldELBO
from .trace_elbo import TensorTrace_ELBO, TensorTraceMeanField_ELBO

__all__ = [
    "JitKLBallELBO",
    "JitSharpnessAwareELBO",
    "JitSharpnessAwareMeanFieldELBO",
    "JitTensorTrace_ELBO",
    "KLBallELBO",
    "SharpnessAwareELBO",
    "SharpnessAwareMeanFieldELBO",
    "TensorTraceMeanField_ELBO",
    "TensorTrace_ELBO",
]
