"""User data as JSON Lines: one record per line, either

    {"text": "..."}                           a plain document, or
    {"prompt": "...", "response": "..."}      a prompt/response pair.

Other keys are ignored (ids, metadata). Blank lines are skipped. Every problem is
reported as `ValueError("<file>:<line>: ...")`.
"""

from __future__ import annotations

import dataclasses
import json
import os
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


def json_lines(path: Path, opener=open) -> Iterator[tuple[str, object]]:
  """("file:line", parsed object) for every non-blank line; malformed JSON names its line."""
  with opener(path, "rt", encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        yield where, json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


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
