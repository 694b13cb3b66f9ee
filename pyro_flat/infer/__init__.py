"""Inference for flat posteriors: objectives (ELBOs), MCMC kernels, guides, averaging, and BMA prediction."""

from ..runtime.capture import CompilationFallbackWarning
from ..runtime.sites import NothingToPerturbWarning, at_latent_values, is_latent_site, latent_sites, latent_supports
from . import autoguide, averaging, compiled, elbo, mcmc, particles
from .autoguide import AutoLowRankPlusDiagonalNormal, AutoSWAG, SWAGCollector
from .averaging import HWA
from .elbo import *  # noqa: F403  (every objective elbo/__init__.py exports: a new one is listed there only)
from .mcmc import SGHMC, SGLD, EntropyMCMC, EntropySGD, EntropySGLD
from .particles import BatchedMAP, BatchedPotential, BatchedSGLD, init_particles
from .predict import bma_predict, guide_draws, predict_logits, sample_draws, set_prediction_mode
from .svi import TensorSVI

__all__ = [
    *elbo.__all__,
    "autoguide",
    "averaging",
    "compiled",
    "elbo",
    "mcmc",
    "particles",
    "BatchedMAP",
    "BatchedPotential",
    "BatchedSGLD",
    "init_particles",
    "AutoSWAG",
    "HWA",
    "SWAGCollector",
    "SGLD",
    "SGHMC",
    "EntropyMCMC",
    "EntropySGD",
    "EntropySGLD",
    "AutoLowRankPlusDiagonalNormal",
    "CompilationFallbackWarning",
    "NothingToPerturbWarning",
    "TensorSVI",
    "bma_predict",
    "guide_draws",
    "is_latent_site",
    "at_latent_values",
    "latent_sites",
    "latent_supports",
    "predict_logits",
    "sample_draws",
    "set_prediction_mode",
]
