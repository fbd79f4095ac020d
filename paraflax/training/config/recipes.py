"""The shipped recipes (`paraflax/recipes/`, installed with the package) found by name:
`--config hf/sft` as well as `--config path/to/my_recipe.py`."""

from __future__ import annotations

import os
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def names() -> list[str]:
  """Every recipe's name: its path under `RECIPES` without `.py` ("tiny_ar", "hf/sft")."""
  return sorted(p.relative_to(RECIPES).with_suffix("").as_posix()
                for p in RECIPES.rglob("*.py") if p.name != "__init__.py")


def config_file(config: str | os.PathLike) -> Path:
  """The config file `config` names: itself when it is a file, else the recipe of that name
  (with or without `.py`); a FileNotFoundError listing the recipes otherwise."""
  path = Path(config).expanduser()
  if path.is_file():
    return path
  name = Path(config).as_posix().removesuffix(".py")
  if name in names():
    return RECIPES / f"{name}.py"
  raise FileNotFoundError(f"config {str(config)!r} not found: neither a file nor a recipe "
                          f"({', '.join(names())})")
