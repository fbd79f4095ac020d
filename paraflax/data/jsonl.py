"""User data as JSON Lines: one record per line, either

    {"text": "..."}                           a plain document, or
    {"prompt": "...", "response": "..."}      a prompt/response pair.

Other keys are ignored (ids, metadata). Blank lines are skipped; `.jsonl.gz` files are read
gunzipped. Every problem (malformed JSON, invalid UTF-8, corrupt gzip data, a duplicate key)
is reported as `ValueError("<file>:<line>: ...")`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class TextRecord:
  """A plain training document."""

  text: str


@dataclasses.dataclass(frozen=True)
class PairRecord:
  """A prompt and its response; `text` is their concatenation, as a document."""

  prompt: str
  response: str

  @property
  def text(self) -> str:
    return self.prompt + self.response


Record = TextRecord | PairRecord


def _parse(obj: object, where: str) -> Record:
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  has_text = "text" in obj
  has_pair = "prompt" in obj or "response" in obj
  if has_text and has_pair:
    raise ValueError(f"{where}: record has both 'text' and 'prompt'/'response'; use one")
  if has_text:
    keys = ("text",)
  elif "prompt" in obj and "response" in obj:
    keys = ("prompt", "response")
  else:
    raise ValueError(
      f"{where}: expected key 'text' or both 'prompt' and 'response', got keys {sorted(obj)}"
    )
  for k in keys:
    if not isinstance(obj[k], str):
      raise ValueError(f"{where}: {k!r} must be a string, got {type(obj[k]).__name__}")
  return TextRecord(obj["text"]) if has_text else PairRecord(obj["prompt"], obj["response"])


class _DuplicateKey(Exception):
  pass


def _unique_keys(pairs):
  obj = {}
  for k, v in pairs:
    if k in obj:
      raise _DuplicateKey(k)
    obj[k] = v
  return obj


def _lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
  """(line number, raw line) of a binary file; a corrupt gzip stream names the line it hit."""
  lineno = 0
  while True:
    try:
      raw = f.readline()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
      raise ValueError(f"{path}:{lineno + 1}: corrupt gzip data ({e})") from None
    if not raw:
      return
    lineno += 1
    yield lineno, raw


def json_lines(path: Path, opener=None) -> Iterator[tuple[str, object]]:
  """("file:line", parsed object) for every non-blank line (`.gz` files are gunzipped);
  malformed JSON, invalid UTF-8, corrupt gzip data and duplicate keys name their line."""
  opener = opener or (gzip.open if Path(path).suffix == ".gz" else open)
  with opener(path, "rb") as f:
    for lineno, raw in _lines(f, path):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: invalid UTF-8 (byte {raw[e.start]:#04x} at column "
                         f"{e.start + 1})") from None
      if not line.strip():
        continue
      try:
        yield where, json.loads(line, object_pairs_hook=_unique_keys)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
      except _DuplicateKey as e:
        raise ValueError(f"{where}: duplicate key {e.args[0]!r} in a JSON object") from None


def read_jsonl(path: str | os.PathLike) -> list[Record]:
  """All records of a JSONL file, in file order."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"JSONL file {str(path)!r} not found")
  records = [_parse(obj, where) for where, obj in json_lines(path)]
  if not records:
    raise ValueError(f"{path}: no records (file is empty)")
  return records


def jsonl_documents(path: str | os.PathLike) -> list[str]:
  """Training documents of a JSONL file: `text`, or `prompt + response`."""
  return [r.text for r in read_jsonl(path)]
