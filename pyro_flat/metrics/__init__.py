"""pyro_flat.metrics."""
