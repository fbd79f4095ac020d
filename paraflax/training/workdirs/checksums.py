"""Checksum manifests: the size and crc32 of every file a writer made, verified on load.

A manifest's `files` maps paths relative to a root directory ('/'-separated) to
`{"size": bytes, "crc32": "8 hex digits"}`. Checkpoints (`training/workdirs/checkpoint.py`) and the
trajectory / teacher stores (`training/stores/store.py`) keep one beside their data.

Hashing is one streaming pass per file (8 MiB reads into one reused buffer, stdlib
`zlib.crc32`, which releases the GIL), files in parallel threads, right after the writer
closed them, so the bytes mostly come from the page cache: about 2 GB/s per core here. Files
are listed, sized and read through `etils.epath`, so manifests work on `gs://` stores too.
"""

from __future__ import annotations

import concurrent.futures
import os
import zlib
from collections.abc import Iterable, Mapping

from etils import epath

ALGORITHM = "crc32"
_BLOCK = 8 << 20


class ChecksumError(ValueError):
  """A file that differs from its manifest (missing, another size, another crc32)."""

  def __init__(self, file: str | os.PathLike, reason: str):
    self.file = epath.Path(file)
    super().__init__(f"{file}: {reason}")


class ChecksumWarning(UserWarning):
  """Data loaded without verification: it has no manifest (made before manifests existed)."""


def _threads(n: int) -> int:
  return max(1, min(n, os.cpu_count() or 1, 8))


def file_digest(path: str | os.PathLike) -> dict:
  """{"size", "crc32"} of one file, read once in 8 MiB blocks."""
  crc, size = 0, 0
  with epath.Path(path).open("rb") as f:
    while block := f.read(_BLOCK):
      crc = zlib.crc32(block, crc)
      size += len(block)
  return {"size": size, ALGORITHM: f"{crc:08x}"}


def files_under(root: str | os.PathLike, skip: Iterable[str] = ()) -> list[str]:
  """Every regular file under `root` (relative, '/'-separated, sorted), less names in `skip`."""
  root, skip = epath.Path(root), set(skip)
  return sorted((d / n).relative_to(root).as_posix()
                for d, _, names in root.walk() for n in names if n not in skip)


def digest(root: str | os.PathLike, rels: Iterable[str]) -> dict[str, dict]:
  """{rel: file_digest(root / rel)} over `rels`, several files at once."""
  root, rels = epath.Path(root), list(rels)
  with concurrent.futures.ThreadPoolExecutor(_threads(len(rels))) as pool:
    return dict(zip(rels, pool.map(lambda r: file_digest(root / r), rels)))


def verify(root: str | os.PathLike, files: Mapping[str, dict],
           manifest: str | os.PathLike) -> None:
  """Raise `ChecksumError` naming the first file (in path order) under `root` that is missing
  or differs from `files` (an entry of `manifest`). Sizes are checked before any byte is read,
  so a truncated file costs nothing."""
  root = epath.Path(root)
  for rel in sorted(files):
    want, file = files[rel], root / rel
    if not file.is_file():
      raise ChecksumError(file, f"missing (listed in {manifest})")
    size = file.stat().length
    if size != want["size"]:
      raise ChecksumError(file, f"{size} bytes, {want['size']} when saved (truncated or "
                          f"overwritten; {manifest})")
  got = digest(root, sorted(files))
  for rel, d in got.items():
    if d[ALGORITHM] != files[rel][ALGORITHM]:
      raise ChecksumError(root / rel, f"{ALGORITHM} {d[ALGORITHM]}, {files[rel][ALGORITHM]} when "
                          f"saved (the file changed after it was written; {manifest})")
