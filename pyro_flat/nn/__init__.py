"""Bayesian networks as Pyro models, and tools to turn torch networks Bayesian."""

from .batchnorm import has_batchnorm, refresh_batchnorm
from .bayesian import NORM_LAYERS, head_module_name, init_to_network, latent_init_values, make_bayesian
from .models import (
    BayesianClassifier,
    BayesianCNN,
    BayesianMLP,
    BayesianRegressionMLP,
    BayesianRegressor,
)
from .transfer import bayesian_transfer, replace_head

__all__ = [
    "NORM_LAYERS",
    "BayesianCNN",
    "BayesianClassifier",
    "BayesianMLP",
    "BayesianRegressionMLP",
    "BayesianRegressor",
    "bayesian_transfer",
    "has_batchnorm",
    "head_module_name",
    "init_to_network",
    "latent_init_values",
    "make_bayesian",
    "refresh_batchnorm",
    "replace_head",
]
