"""Module-level models and potentials, importable by spawned MCMC worker processes."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch


def normal_normal(data: torch.Tensor, subsample_size: int | None = None) -> None:
    """y ~ N(0, 1), x_i ~ N(y, 1): posterior N(sum x / (n + 1), 1 / (n + 1))."""
    y = pyro.sample("y", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(data), subsample_size=subsample_size) as idx:
        pyro.sample("x", dist.Normal(y, 1.0), obs=data[idx])


def quadratic_potential(params: dict) -> torch.Tensor:
    """U = |theta|^2 / 2 (a standard normal target) for potential_fn kernels."""
    return 0.5 * (params["theta"] ** 2).sum()
