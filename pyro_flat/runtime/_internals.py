"""The one door to Pyro's and torch's private APIs: every use of one in pyro_flat goes through a name defined here,
each with the public API whose absence makes it necessary. A Pyro or torch release that moves one breaks this module
only (and the bounds on both in ``pyproject.toml`` say which releases are tested)."""

from __future__ import annotations

from torch import nn

BatchNormBase = nn.modules.batchnorm._BatchNorm
"""The base class of every BatchNorm layer (1d/2d/3d, lazy, SyncBatchNorm): torch has no public base class or
predicate for "a layer with running batch statistics"."""

InstanceNormBase = nn.modules.instancenorm._InstanceNorm
"""The base class of the InstanceNorm layers: torch has no public base class for them."""
