"""pyro_flat.data."""
