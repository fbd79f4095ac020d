"""How directories named in configs and store metadata are compared: resolved."""

from __future__ import annotations

from pathlib import Path


def resolve_path(path: str) -> str:
  """`path` absolute, without `~`, `..`, symlinks or a trailing `/`."""
  return str(Path(path).expanduser().resolve())
