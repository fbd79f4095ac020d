"""Keeps `--config configs/ar_drafter.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.ar_drafter import get_config  # noqa: F401
