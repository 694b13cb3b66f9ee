"""pyro_flat.nn."""
