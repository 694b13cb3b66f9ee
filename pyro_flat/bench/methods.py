"""Imports every module that registers methods with the harness (add a line here for a new method module)."""

from . import baselines  # noqa: F401
from . import trajectory as _trajectory  # noqa: F401
