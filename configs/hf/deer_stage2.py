"""Keeps `--config configs/hf/deer_stage2.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.hf.deer_stage2 import get_config  # noqa: F401
