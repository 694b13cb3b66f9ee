"""Pure tensor maths shared by every pyro_flat method. Imports only :mod:`torch`."""
