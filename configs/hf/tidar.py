"""Keeps `--config configs/hf/tidar.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.hf.tidar import get_config  # noqa: F401
