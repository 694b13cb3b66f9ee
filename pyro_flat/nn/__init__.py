"""Bayesian networks as Pyro models, tools to turn torch networks Bayesian, and the CIFAR ResNets of the papers."""

from .batchnorm import has_batchnorm, refresh_batchnorm
from .bayesian import (
    NORM_LAYERS,
    head_module_name,
    init_to_network,
    is_packed,
    latent_init_values,
    make_bayesian,
    pack_latents,
    unpacked_sites,
)
from .models import (
    BayesianClassifier,
    BayesianCNN,
    BayesianMLP,
    BayesianRegressionMLP,
    BayesianRegressor,
)
from .resnets import preresnet, resnet18, wide_resnet
from .transfer import SWAGFrozenSampler, bayesian_transfer, replace_head

__all__ = [
    "NORM_LAYERS",
    "SWAGFrozenSampler",
    "BayesianCNN",
    "BayesianClassifier",
    "BayesianMLP",
    "BayesianRegressionMLP",
    "BayesianRegressor",
    "bayesian_transfer",
    "has_batchnorm",
    "head_module_name",
    "init_to_network",
    "is_packed",
    "latent_init_values",
    "make_bayesian",
    "pack_latents",
    "preresnet",
    "refresh_batchnorm",
    "replace_head",
    "resnet18",
    "unpacked_sites",
    "wide_resnet",
]
