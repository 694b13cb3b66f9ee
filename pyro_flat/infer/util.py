"""Helpers on Pyro models and traces: :mod:`pyro_flat.runtime.sites` (the runtime layer), importable from here
too."""

from ..runtime import sites
from ..runtime.sites import *  # noqa: F403

__all__ = sites.__all__
