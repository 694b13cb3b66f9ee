"""Shared fixtures for the metric tests: per-sample logits of a classifier that is right about 60 % of the time."""

from __future__ import annotations

import pytest
import torch


def make_problem(num_samples=8, num_points=600, num_classes=10, seed=0, scale=2.0):
    """Logits ``[S, N, C]``: a shared signal towards the label plus per-sample noise, and labels ``[N]``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_points,), generator=g)
    signal = 2.5 * torch.nn.functional.one_hot(y, num_classes).to(torch.float64)
    shared = scale * torch.randn(num_points, num_classes, generator=g, dtype=torch.float64)
    noise = scale * torch.randn(num_samples, num_points, num_classes, generator=g, dtype=torch.float64)
    return signal + shared + noise, y


@pytest.fixture
def problem():
    return make_problem()
