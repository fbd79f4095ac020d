"""The user's cache; workdir and store locations as `etils.epath.Path`, so that local
directories and object stores (`gs://bucket/dir` on TPU VMs) go through the same code.

Local locations are made absolute with `~` expanded; remote ones (any `scheme://`) are kept as
given: `pathlib`-style `resolve()` would turn `gs://b/x` into a local `gs:/b/x`.
"""

from __future__ import annotations

import os
from pathlib import Path

from etils import epath

CACHE = Path(os.environ.get("PARAFLAX_CACHE", "~/.cache/paraflax")).expanduser()


def is_hf_dir(path: str | os.PathLike) -> bool:
  """Whether `path` holds a Hugging Face checkpoint: config.json and safetensors weights."""
  path = epath.Path(path)
  return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def model_dirs(workdir=None, hf=None) -> tuple[str | None, str | None]:
  """(workdir, hf) with the directory's kind checked: an HF directory given as `workdir` moves
  to `hf`; a directory that is neither kind is a ValueError saying what was expected."""
  path = epath.Path(workdir or hf)
  if not hf and (path / "config.json").is_file() and (path / "checkpoints").is_dir():
    return str(path), None
  if is_hf_dir(path):
    return None, str(path)
  raise ValueError(f"{str(path)!r} is not a model directory: expected " + (
      "a Hugging Face directory (config.json + *.safetensors)" if hf else
      "a paraflax workdir (config.json + checkpoints/) or a Hugging Face directory "
      "(config.json + *.safetensors)"))


def is_remote(path: str | os.PathLike) -> bool:
  """Whether `path` names an object store (`gs://...`, `s3://...`) rather than a local file."""
  return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an `epath.Path`: absolute without `~` when local, unchanged when remote."""
  if is_remote(path):
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def resolve_path(path: str) -> str:
  """`path` absolute, without `~`, `..`, symlinks or a trailing `/` (remote: only the `/`)."""
  if is_remote(path):
    return os.fspath(epath.Path(path))
  return str(as_path(path).resolve())


def kvstore(path: str | os.PathLike) -> dict:
  """The tensorstore kvstore spec of a directory: `file`, or `gcs` for `gs://bucket/dir`."""
  text = os.fspath(path)
  if not is_remote(text):
    return {"driver": "file", "path": os.fspath(as_path(text))}
  scheme, _, rest = text.partition("://")
  if scheme != "gs":
    raise ValueError(f"{text!r}: tensorstore stores live on local disks or gs:// only")
  bucket, _, key = rest.partition("/")
  return {"driver": "gcs", "bucket": bucket, "path": key.rstrip("/")}
