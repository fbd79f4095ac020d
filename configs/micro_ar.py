"""Keeps `--config configs/micro_ar.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.micro_ar import get_config  # noqa: F401
