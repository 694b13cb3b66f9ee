"""pyro_flat: flat-posterior Bayesian deep learning for Pyro."""

__version__ = "0.1.0"
