"""Keeps `--config configs/hf/deer_stage1.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.hf.deer_stage1 import get_config  # noqa: F401
