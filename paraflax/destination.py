"""Directories that commands write: what kind a directory is, the refusals that keep what a user
owns, and the atomic replacement of a directory (a temporary sibling, then renames).

    kind(path)                  "paraflax workdir", "paraflax convert output", "trajectory
                                store", "teacher store", "Hugging Face directory" or None
    check_output(out, ...)      `export` and `convert`: an absent or empty directory, or with
                                `overwrite` a non-empty one, never a workdir, a store or the
                                model's own source (being, containing or lying inside one)
    check_store_dir(out, what)  a store command fills only an empty directory or a store of its
                                own kind (stores resume where they stopped)
    replacing(out)              write into a temporary sibling; it takes `out`'s place whole

`replacing` writes into `OUT.paraflax-new-PID`. Only when that is complete is an existing
`OUT` renamed to `OUT.paraflax-old-PID`, the new directory renamed to `OUT`, and the old one
removed. An error or Ctrl-C puts everything back (`OUT` as it was, the new directory removed);
a kill leaves `OUT` old (before the first rename), complete (after the second) or, between the
two renames, absent, with the old contents in `OUT.paraflax-old-PID` and the new, complete
export in `OUT.paraflax-new-PID`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

WORKDIR, CONVERTED = "paraflax workdir", "paraflax convert output"
TRAJECTORIES, TEACHER, STORE = "trajectory store", "teacher store", "paraflax store"
HF = "Hugging Face directory"
PROTECTED = (WORKDIR, TRAJECTORIES, TEACHER, STORE)  # never written over, even with overwrite
LOCK = "paraflax.lock"  # `training.workdirs.lock.LOCK`: a lock file alone leaves a directory empty

# Fault injection for tests: called with each stage of `replacing` ("written", "moved aside").
fault: Callable[[str], None] = lambda stage: None


def _store_kind(meta: Path) -> str:
  try:
    keys = json.loads(meta.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return STORE
  if not isinstance(keys, dict):
    return STORE
  return TRAJECTORIES if "block_size" in keys else TEACHER if "answer_len" in keys else STORE


def kind(path: str | os.PathLike) -> str | None:
  """What the directory `path` holds (see the module docstring), None for anything else."""
  path = Path(path)
  if (path / "meta.json").is_file() and any(
      (path / n).exists() for n in ("progress.json", "tokenizer.json", LOCK)):
    return _store_kind(path / "meta.json")
  if not (path / "config.json").is_file():
    return None
  if any(path.glob("*.safetensors")):
    return HF
  if (path / "checkpoints").is_dir() or (path / "tokenizer.json").is_file():
    return CONVERTED if (path / "hf_config.json").is_file() else WORKDIR
  return None


def is_empty(path: Path) -> bool:
  """Whether the directory `path` holds nothing (a lock file left by a killed run aside)."""
  return all(p.name == LOCK for p in path.iterdir())


def _named(path: Path, what: str | None) -> str:
  return f"{str(path)!r}" + (f" (a {what})" if what else "")


def _protected(path: Path, source: Path | None) -> str | None:
  """Why `path` may not be written over: it is a workdir, a store or `source`, or None."""
  what = kind(path)
  if what in PROTECTED:
    return f"a {what}"
  return "the model's own source directory" if path == source else None


def _inside(out: Path, source: Path | None) -> str | None:
  for parent in out.parents:
    why = _protected(parent, source)
    if why:
      return f"lies inside {_named(parent, None)}, {why}"
  return None


def _contains(out: Path, source: Path | None) -> str | None:
  if source is not None and out in source.parents:
    return f"contains the model's own source directory {str(source)!r}"
  for root, dirs, _ in os.walk(out):
    for d in dirs:
      why = _protected(Path(root) / d, None)
      if why:
        return f"contains {_named(Path(root) / d, None)}, {why}"
  return None


def check_output(out: str | os.PathLike, *, overwrite: bool = False,
                 source: str | os.PathLike | None = None) -> Path:
  """`out` (absolute) if a command may write its directory there, else one ValueError line:
  a file; a non-empty directory without `overwrite`; even with it, a paraflax workdir, a store
  or `source` (the directory the model was loaded from), or a directory that contains or lies
  inside one."""
  out = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
  src = None if source is None else Path(os.path.realpath(os.path.expanduser(os.fspath(source))))
  real = Path(os.path.realpath(out))
  if out.exists() and not out.is_dir():
    raise ValueError(f"{str(out)!r} is a file: name a directory to write into")
  why = _protected(real, src) if out.exists() else None
  why = f"is {why}" if why else _inside(real, src)
  if why is None and out.exists() and not is_empty(out):
    if not overwrite:
      raise ValueError(f"{str(out)!r} is not empty ({kind(out) or 'other files'}): pass "
                       "--overwrite (overwrite=True) to replace it, or name a new directory")
    why = _contains(real, src)
  if why:
    raise ValueError(f"refusing to write into {str(out)!r}: it {why}; name another directory")
  return out


def check_store_dir(out: str | os.PathLike, what: str) -> None:
  """Refuse (one ValueError line) to fill a store `what` ("trajectory store", "teacher store")
  in a directory that is not empty and not a store of that kind."""
  out = Path(os.path.expanduser(os.fspath(out)))
  if "://" in os.fspath(out) or not out.exists():
    return
  if not out.is_dir():
    raise ValueError(f"{str(out)!r} is a file: name a directory for the {what}")
  found = kind(out)
  if found != what and not is_empty(out):
    raise ValueError(f"{str(out)!r} is not empty and is not a {what} "
                     f"({'it holds a ' + found if found else 'it holds other files'}): name an "
                     f"empty or new directory for the {what}")


@contextlib.contextmanager
def replacing(out: Path) -> Iterator[Path]:
  """Yield a new empty sibling of `out` to write into; when the block ends without error it
  takes `out`'s place and the old `out` is removed (see the module docstring for what an
  interruption leaves)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  new = out.with_name(f"{out.name}.paraflax-new-{os.getpid()}")
  old = out.with_name(f"{out.name}.paraflax-old-{os.getpid()}")
  shutil.rmtree(new, ignore_errors=True)  # a killed run of this pid's
  new.mkdir()
  try:
    yield new
    fault("written")
    if out.exists():
      out.rename(old)
    fault("moved aside")
    new.rename(out)
  except BaseException:
    if old.exists() and not out.exists():
      old.rename(out)
    shutil.rmtree(new, ignore_errors=True)
    raise
  shutil.rmtree(old, ignore_errors=True)
