"""Keeps `--config configs/tidar_continual.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.tidar_continual import get_config  # noqa: F401
