"""The code corpus: this interpreter's own standard-library `.py` source.

Offline and deterministic. Test suites, installed third-party packages and generated
data blobs are left out; files that are empty or not valid UTF-8 are skipped.
The train/validation split is by file, from a stable hash of the relative path, so a
file never lands on both sides and the split does not depend on the machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
# Directory names pruned anywhere in the tree: third-party installs, bytecode, tests
# (test/, tests/, idlelib/idle_test/, lib2to3/tests/, ...).
EXCLUDED_DIRS = frozenset(
  {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
# Generated data rather than code: pydoc_data/topics.py is ~0.75 MB of prose in strings.
EXCLUDED_FILES = frozenset({"pydoc_data/topics.py"})


@dataclasses.dataclass(frozen=True)
class Document:
  """One source file: `path` relative to the corpus root (POSIX style) and its text."""

  path: str
  text: str


def stdlib_root() -> Path:
  """Directory of this interpreter's standard library."""
  return Path(sysconfig.get_paths()["stdlib"])


def corpus_name(val_fraction: float = 0.05, max_files: int | None = None) -> str:
  """Short, filename-safe identity of the stdlib corpus (for cache keys and logs)."""
  n = "all" if max_files is None else str(max_files)
  return f"stdlib-py{platform.python_version()}-val{val_fraction:g}-n{n}"


def split_of(path: str, val_fraction: float) -> str:
  """'validation' or 'train' for a relative path: a stable sha1 hash of the path."""
  return "validation" if _unit_hash(path) < val_fraction else "train"


def _unit_hash(path: str) -> float:
  digest = hashlib.sha1(path.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64  # uniform in [0, 1)


def _check_args(split: str, val_fraction: float, max_files: int | None) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
  if max_files is not None and max_files < 1:
    raise ValueError(f"max_files must be a positive integer or None, got {max_files}")


def _candidate_paths(root: Path) -> list[str]:
  """Relative POSIX paths of all `.py` files under root, pruned, sorted."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    rel_dir = Path(dirpath).relative_to(root)
    for name in filenames:
      if name.endswith(".py"):
        rel = (rel_dir / name).as_posix()
        if rel not in EXCLUDED_FILES:
          found.append(rel)
  return sorted(found)


def _read_text(path: Path) -> str | None:
  """File text, or None (skipped) when it is empty/whitespace or not valid UTF-8."""
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError:
    log.info("skipping %s: not valid UTF-8", path)
    return None
  return text if text.strip() else None


def load_documents(
  split: str = "train",
  val_fraction: float = 0.05,
  max_files: int | None = None,
  root: str | os.PathLike | None = None,
) -> list[Document]:
  """Documents of one split, sorted by path.

  `max_files` keeps a deterministic pseudo-random subset (lowest path hashes) of the
  split, so small subsets still sample the whole library rather than one package.
  `root` defaults to the standard library; pass a directory to use any `.py` tree.
  """
  _check_args(split, val_fraction, max_files)
  root = stdlib_root() if root is None else Path(root)
  if not root.is_dir():
    raise FileNotFoundError(f"corpus root {str(root)!r} is not a directory")
  paths = [p for p in _candidate_paths(root) if split_of(p, val_fraction) == split]
  paths.sort(key=_unit_hash)  # subset order: spread over the whole tree
  docs = []
  for rel in paths:
    if max_files is not None and len(docs) >= max_files:
      break
    text = _read_text(root / rel)
    if text is not None:
      docs.append(Document(rel, text))
  return sorted(docs, key=lambda d: d.path)


def stdlib_documents(
  split: str = "train",
  val_fraction: float = 0.05,
  max_files: int | None = None,
  root: str | os.PathLike | None = None,
) -> list[str]:
  """Texts of `load_documents(...)`, sorted by path (deterministic)."""
  return [d.text for d in load_documents(split, val_fraction, max_files, root)]


def heldout_prompts(
  n: int,
  prefix_chars: int = 256,
  val_fraction: float = 0.05,
  root: str | os.PathLike | None = None,
) -> list[str]:
  """The first `prefix_chars` characters of `n` validation files (path order).

  Only files at least `prefix_chars` long are used, so every prompt has exactly that
  length. These are never in the training split (prompts for trajectory collection,
  drafter training and benchmarks).
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  if prefix_chars < 1:
    raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars}")
  docs = load_documents("validation", val_fraction, None, root)
  prompts = [d.text[:prefix_chars] for d in docs if len(d.text) >= prefix_chars]
  if len(prompts) < n:
    raise ValueError(
      f"asked for {n} held-out prompts but only {len(prompts)} validation files "
      f"have >= {prefix_chars} characters (val_fraction={val_fraction}); "
      "raise val_fraction or lower n/prefix_chars"
    )
  return prompts[:n]
