"""Inference for flat posteriors: objectives (ELBOs), MCMC kernels, guides, averaging, and BMA prediction."""

from .elbo import SharpnessAwareELBO, SharpnessAwareMeanFieldELBO
from .predict import bma_predict, guide_draws, predict_logits, sample_draws, set_prediction_mode
from .util import is_latent_site, is_subsample_site, latent_sites

__all__ = [
    "SharpnessAwareELBO",
    "SharpnessAwareMeanFieldELBO",
    "bma_predict",
    "guide_draws",
    "is_latent_site",
    "is_subsample_site",
    "latent_sites",
    "predict_logits",
    "sample_draws",
    "set_prediction_mode",
]
