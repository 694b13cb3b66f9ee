"""pyro_flat.infer."""
