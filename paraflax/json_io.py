"""JSON files: atomic writes, and reads whose errors name the file in one line.

Paths go through `etils.epath`, so a `gs://` location works like a local one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from etils import epath

from paraflax.paths import is_remote


def read_json(path: str | os.PathLike) -> Any:
  """The JSON value in `path`; a missing, unreadable or invalid (e.g. truncated) file is one
  `ValueError` / `FileNotFoundError` line that names it."""
  path = epath.Path(path)
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


def read_json_object(path: str | os.PathLike) -> dict:
  """`read_json` of a file that must hold a JSON object (a config): another value is one
  ValueError line naming the file."""
  value = read_json(path)
  if not isinstance(value, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__} "
                     f"{json.dumps(value)[:40]}")
  return value


def json_field(path, obj: dict, name: str, kind: type, lo: int | None = None):
  """`obj[name]` of the JSON object read from `path`, checked to be a `kind` (an int >= `lo`):
  missing or of another type, one ValueError line naming the file and the field."""
  if name not in obj:
    raise ValueError(f"{path}: missing field {name!r}")
  value = obj[name]
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if not ok or (lo is not None and value < lo):
    want = {int: "an int", str: "a string", dict: "an object", list: "a list"}.get(kind, kind)
    raise ValueError(f"{path}: field {name!r} must be {want}"
                     f"{'' if lo is None else f' >= {lo}'}, got {json.dumps(value)[:40]}")
  return value


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Write a file through a temporary one and a rename (a killed run never leaves half a
  file; on object stores each object appears whole anyway)."""
  path = epath.Path(path)
  tmp = path.with_name(path.name + f".tmp{os.getpid()}")
  tmp.write_bytes(data.encode() if isinstance(data, str) else data)
  tmp.replace(path)


def append_text(path: str | os.PathLike, text: str) -> None:
  """Append `text` to a file: in place on local disks, by rewriting the object on object
  stores (they cannot append)."""
  path = epath.Path(path)
  if is_remote(path):
    write_atomic(path, (path.read_text() if path.exists() else "") + text)
    return
  with path.open("a") as f:
    f.write(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Write JSON atomically (a killed run never leaves half a file)."""
  write_atomic(path, json.dumps(obj, indent=2) + "\n")
