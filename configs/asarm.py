"""Keeps `--config configs/asarm.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.asarm import get_config  # noqa: F401
