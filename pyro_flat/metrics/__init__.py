"""Metrics for Bayesian deep learning: accuracy and calibration of the BMA predictive, predictive uncertainty and
OOD detection, a streaming BMA accumulator, one-call evaluation, reliability diagrams, and flatness (Hessian
eigenvalues and trace, SAM sharpness) of networks and Pyro models.

The package imports only torch and pyro; :func:`reliability_diagram` imports matplotlib when called.
"""

from .bma import StreamingBMA, bma_log_probs, bma_probs
from .calibration import accuracy, bma_nll, brier_score, expected_calibration_error, reliability_bins
from .evaluation import Predictions, evaluate
from .flatness import (
    hessian_eigenvalues,
    hessian_trace,
    model_loss_fn,
    network_loss_fn,
    sam_sharpness,
)
from .plots import reliability_diagram
from .uncertainty import mutual_information, ood_aupr, ood_auroc, ood_report, predictive_entropy

__all__ = [
    "Predictions",
    "StreamingBMA",
    "accuracy",
    "bma_log_probs",
    "bma_nll",
    "bma_probs",
    "brier_score",
    "evaluate",
    "expected_calibration_error",
    "hessian_eigenvalues",
    "hessian_trace",
    "model_loss_fn",
    "mutual_information",
    "network_loss_fn",
    "ood_aupr",
    "ood_auroc",
    "ood_report",
    "predictive_entropy",
    "reliability_bins",
    "reliability_diagram",
    "sam_sharpness",
]
