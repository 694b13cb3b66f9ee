"""Shared helpers of the stochastic-gradient kernel tests: z-scores from the Monte-Carlo standard error."""

from __future__ import annotations

import math

import torch
from pyro.ops.stats import effective_sample_size


def mcse_z(draws: torch.Tensor, truth: float) -> float:
    """|mean - truth| / (sd / sqrt(ESS)) for draws shaped [chains, num_draws] (the Monte-Carlo standard error)."""
    ess = float(effective_sample_size(draws, chain_dim=0, sample_dim=1))
    return abs(float(draws.mean()) - truth) / (float(draws.std()) / math.sqrt(ess))


def covariance_z(draws: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """z-scores of every covariance entry: the MCSE rule applied to the products (x_i - m_i)(x_j - m_j), for draws
    shaped [chains, num_draws, D] around the known mean ``mean``; returns a [D, D] tensor."""
    d = draws.shape[-1]
    z = torch.zeros(d, d)
    centred = draws - mean
    for i in range(d):
        for j in range(i, d):
            z[i, j] = z[j, i] = mcse_z(centred[..., i] * centred[..., j], float(cov[i, j]))
    return z
