"""The shipped recipes travel with the package: every one loads by name as by path (and as
the checkout's `configs/<name>.py`, the path outside checks pass), names resolve to nothing
outside `paraflax/recipes/`, and a copy of the package alone (what a wheel installs) finds
them."""

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from paraflax.training import TrainConfig, load_config
from paraflax.training.config.recipes import RECIPES, config_file, names

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_every_recipe_loads_by_name_as_by_path():
  found = names()
  assert {"tiny_ar", "micro_ar", "hf/sft", "hf/deer_stage2"} <= set(found)
  assert len(found) == len(list(RECIPES.rglob("*.py"))) - len(list(RECIPES.rglob("__init__.py")))
  for name in found:
    assert config_file(name) == config_file(f"{name}.py") == RECIPES / f"{name}.py"
    cfg = load_config(name)
    assert isinstance(cfg, TrainConfig) and cfg == load_config(RECIPES / f"{name}.py"), name


@pytest.mark.fast
def test_the_checkouts_configs_paths_load_the_same_recipes():
  configs = ROOT / "configs"
  assert sorted(p.relative_to(configs).with_suffix("").as_posix()
                for p in configs.rglob("*.py")) == names()
  for name in names():
    assert load_config(configs / f"{name}.py") == load_config(name), name


@pytest.mark.fast
def test_a_file_wins_over_a_recipe_and_an_unknown_name_lists_the_recipes(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "tiny_ar.py").write_text(
      "from paraflax.training import load_config\nimport dataclasses\n\n"
      "def get_config():\n  return dataclasses.replace(load_config('tiny_ar'), steps=3)\n")
  assert config_file("tiny_ar.py") == Path("tiny_ar.py") and load_config("tiny_ar.py").steps == 3
  assert load_config("tiny_ar").steps == 2000  # no file of that name: the recipe
  for bad in ("nope", "../recipes/tiny_ar", "__init__", "hf"):
    with pytest.raises(FileNotFoundError, match=r"not found: neither a file nor a recipe \(.*"
                       r"hf/sft.*tiny_ar"):
      config_file(bad)


@pytest.mark.fast
def test_the_wheel_ships_every_recipe_folder():
  """Every folder with a recipe is a package pyproject's `find` includes (a folder with an
  `__init__.py` whose name matches an include pattern, as setuptools finds them)."""
  find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
  folders = {p.parent for p in RECIPES.rglob("*.py")}
  assert {f.relative_to(RECIPES).as_posix() for f in folders} == {".", "hf"}
  for folder in folders:
    name = folder.relative_to(ROOT).as_posix().replace("/", ".")
    assert (folder / "__init__.py").is_file(), name
    assert any(fnmatch.fnmatch(name, pattern) for pattern in find["find"]["include"]), name


def test_the_package_alone_finds_its_recipes(tmp_path):
  """A copy of `paraflax/` with no checkout around it (as installed) loads a recipe by name,
  one recipe loading another included."""
  shutil.copytree(RECIPES.parent, tmp_path / "site" / "paraflax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  code = ("import paraflax\nfrom paraflax.training import load_config\n"
          "print(paraflax.__file__, load_config('hf/sft').data_source,"
          " load_config('tiny_ar').steps)")
  env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                       capture_output=True, text=True).stdout
  where, source, steps = out.split()
  assert Path(where).is_relative_to(tmp_path / "site") and (source, steps) == ("jsonl", "2000")
