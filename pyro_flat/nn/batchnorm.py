"""Batch-norm statistics for a sampled network.

A weight-space posterior sample (SWAG, VI, SG-MCMC, bSAM, ...) changes the activations, so the running statistics
that BatchNorm layers collected during training no longer fit; predicting with them silently degrades accuracy and
calibration. :func:`refresh_batchnorm` recomputes them for one sample with one pass over training inputs, using
:func:`torch.optim.swa_utils.update_bn` (cumulative average, as SWA/SWAG do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from pyro import poutine
from torch import Tensor, nn
from torch.optim.swa_utils import update_bn

from ..runtime.batchnorm import has_batchnorm

__all__ = ["has_batchnorm", "refresh_batchnorm"]


class _ConditionedNet(nn.Module):
    """Runs ``model`` with its latent sites fixed to ``latents``, as a plain ``nn.Module`` for ``update_bn``."""

    def __init__(self, model: nn.Module, latents: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.model = model
        self.latents = dict(latents)

    def forward(self, x: Tensor) -> Tensor:
        return poutine.condition(self.model, data=self.latents)(x)


def refresh_batchnorm(
    model: nn.Module,
    latents: Mapping[str, Tensor],
    inputs: Tensor | Iterable,
    *,
    batch_size: int = 256,
) -> None:
    """Recompute the BatchNorm running statistics of ``model`` at the latent values ``latents``.

    :param model: a Pyro model (e.g. :class:`~pyro_flat.nn.BayesianCNN`) called as ``model(x)``.
    :param latents: the sampled latent values, by site name (e.g. one draw of a guide).
    :param inputs: training inputs: a tensor ``[N, ...]`` or an iterable of batches (tensors or ``(x, y)`` pairs).
    :param batch_size: batch size when ``inputs`` is a tensor.

    The model's train/eval mode is restored afterwards. Does nothing when ``model`` has no BatchNorm layer.
    """
    if not has_batchnorm(model):
        return
    if isinstance(inputs, Tensor):
        if inputs.dim() < 2 or len(inputs) == 0:
            raise ValueError(f"`inputs` must be a non-empty tensor [N, ...], got shape {tuple(inputs.shape)}")
        inputs = torch.split(inputs, batch_size)
    was_training = model.training
    with torch.no_grad():
        update_bn(inputs, _ConditionedNet(model, latents))
    model.train(was_training)
