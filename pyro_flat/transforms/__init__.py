"""pyro_flat.transforms."""
