"""JSON files: atomic writes, and reads whose errors name the file in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: str | os.PathLike) -> Any:
  """The JSON value in `path`; a missing, unreadable or invalid (e.g. truncated) file is one
  `ValueError` / `FileNotFoundError` line that names it."""
  path = Path(path)
  try:
    text = path.read_text(encoding="utf-8")
  except FileNotFoundError:
    raise FileNotFoundError(f"{str(path)!r} not found") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: cannot be read ({e})") from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    what = "empty" if not text.strip() else "truncated or corrupt"
    raise ValueError(f"{path}: not valid JSON, {what} ({e})") from None


def write_json(path: Path, obj: Any) -> None:
  """Write JSON atomically (a killed run never leaves half a file)."""
  path = Path(path)
  tmp = path.with_name(path.name + f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(obj, indent=2) + "\n")
  os.replace(tmp, path)
