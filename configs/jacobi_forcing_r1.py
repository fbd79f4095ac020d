"""Keeps `--config configs/jacobi_forcing_r1.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.jacobi_forcing_r1 import get_config  # noqa: F401
