"""pyro_flat.bench."""
