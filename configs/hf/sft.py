"""Keeps `--config configs/hf/sft.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.hf.sft import get_config  # noqa: F401
