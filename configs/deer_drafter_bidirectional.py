"""Keeps `--config configs/deer_drafter_bidirectional.py` working:
the shipped recipe of that name (`paraflax/recipes/`, installed with the package)."""

from paraflax.recipes.deer_drafter_bidirectional import get_config  # noqa: F401
