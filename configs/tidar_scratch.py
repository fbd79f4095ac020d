"""Keeps `--config configs/tidar_scratch.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.tidar_scratch import get_config  # noqa: F401
