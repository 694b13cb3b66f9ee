"""Model transforms (Pyro effect handlers) that turn a model's posterior into a flat-seeking one."""

from .local_entropy import local_entropy, local_entropy_draws, local_entropy_potential

__all__ = ["local_entropy", "local_entropy_draws", "local_entropy_potential"]
