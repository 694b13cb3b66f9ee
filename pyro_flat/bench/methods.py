"""Imports every module that registers methods with the harness (add a line here for a new method module)."""

from . import (
    baselines,  # noqa: F401
    flat_seeking,  # noqa: F401
    kl_ball,  # noqa: F401
    sgmcmc,  # noqa: F401
    trajectory,  # noqa: F401
)
