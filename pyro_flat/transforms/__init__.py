"""Model transforms: functions that take a Pyro model and return another Pyro model whose density is a flat-seeking
modification of the original, so that any Pyro inference (SVI, MCMC, MAP) on it targets the flat posterior."""

from .local_entropy_model import local_entropy, local_entropy_draws, local_entropy_potential
from .sharpness_aware_model import LOG_LIKELIHOOD_SITE, SharpnessAwareModel, sharpness_aware

__all__ = [
    "LOG_LIKELIHOOD_SITE",
    "SharpnessAwareModel",
    "local_entropy",
    "local_entropy_draws",
    "local_entropy_potential",
    "sharpness_aware",
]
