"""pyro_flat.optim."""
