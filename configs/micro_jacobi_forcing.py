"""Keeps `--config configs/micro_jacobi_forcing.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.micro_jacobi_forcing import get_config  # noqa: F401
