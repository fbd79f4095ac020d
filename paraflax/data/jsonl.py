"""User data as JSON Lines: one record per line, either

    {"text": "..."}                           a plain document,
    {"prompt": "...", "response": "..."}      a prompt/response pair, or
    {"messages": [{"role": "user", "content": "..."}, ..., {"role": "assistant", ...}]}
                                              a chat (roles system/user/assistant), whose last
                                              message is the assistant's reply trained on.

Other keys are ignored (ids, metadata). Blank lines are skipped; `.jsonl.gz` files are read
gunzipped. Every problem (malformed JSON, invalid UTF-8, corrupt gzip data, a duplicate key, a
record of no known kind) is reported as `ValueError("<file>:<line>: ...")`, or, with
`skip_bad_lines`, skipped and counted in one warning naming the first.

`read_records` takes many files, globs (`data/*.jsonl*`) and directories (their `.jsonl` and
`.jsonl.gz` files), in the order given, each glob's matches sorted.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Iterator

ROLES = ("system", "user", "assistant")


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


@dataclasses.dataclass(frozen=True)
class ChatRecord:
  """A conversation `((role, content), ...)` ending with the assistant's reply."""

  messages: tuple[tuple[str, str], ...]

  @property
  def text(self) -> str:
    """Its contents, one per line (a document for a trained BPE; its split key)."""
    return "\n".join(content for _, content in self.messages)

  def as_dicts(self, upto: int | None = None) -> list[dict]:
    """`messages[:upto]` as [{"role", "content"}, ...] (what chat templates read)."""
    return [{"role": r, "content": c} for r, c in self.messages[:upto]]


Record = TextRecord | PairRecord | ChatRecord


def _messages(value, where: str) -> tuple[tuple[str, str], ...]:
  if not isinstance(value, list) or not value:
    raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                     "{\"role\", \"content\"} objects")
  out = []
  for i, m in enumerate(value):
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(
        m.get("content"), str):
      raise ValueError(f"{where}: message {i} must be {{\"role\": one of {list(ROLES)}, "
                       f"\"content\": a string}}, got {json.dumps(m)[:80]}")
    out.append((m["role"], m["content"]))
  if out[-1][0] != "assistant":
    raise ValueError(f"{where}: the last message must be the assistant's (the reply trained "
                     f"on), got {out[-1][0]!r}")
  return tuple(out)


def parse_record(obj: object, where: str) -> Record:
  """The record of one parsed JSON line (`where`: "file:line", for errors)."""
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  kinds = [k for k, keys in (("text", ("text",)), ("pair", ("prompt", "response")),
                             ("chat", ("messages",))) if any(x in obj for x in keys)]
  if len(kinds) > 1:
    names = {"text": "'text'", "pair": "'prompt'/'response'", "chat": "'messages'"}
    raise ValueError(f"{where}: record has both {names[kinds[0]]} and {names[kinds[1]]}; "
                     "use one")
  if kinds == ["chat"]:
    return ChatRecord(_messages(obj["messages"], where))
  if kinds == ["text"]:
    keys = ("text",)
  elif "prompt" in obj and "response" in obj:
    keys = ("prompt", "response")
  else:
    raise ValueError(f"{where}: expected key 'text' or both 'prompt' and 'response' (or "
                     f"'messages'), got keys {sorted(obj)}")
  for k in keys:
    if not isinstance(obj[k], str):
      raise ValueError(f"{where}: {k!r} must be a string, got {type(obj[k]).__name__}")
  return TextRecord(obj["text"]) if keys == ("text",) else PairRecord(obj["prompt"],
                                                                      obj["response"])


class _DuplicateKey(Exception):
  pass


def _unique_keys(pairs):
  obj = {}
  for k, v in pairs:
    if k in obj:
      raise _DuplicateKey(k)
    obj[k] = v
  return obj


class _Corrupt(Exception):
  pass


def _lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
  """(line number, raw line) of a binary file; a corrupt gzip stream names the line it hit."""
  lineno = 0
  while True:
    try:
      raw = f.readline()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
      where = f"{path}:{lineno + 1}"
      raise _Corrupt(where, ValueError(f"{where}: corrupt gzip data ({e})")) from None
    if not raw:
      return
    lineno += 1
    yield lineno, raw


def _decoded(raw: bytes, where: str) -> object:
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{where}: invalid UTF-8 (byte {raw[e.start]:#04x} at column "
                     f"{e.start + 1})") from None
  if not line.strip():
    return _BLANK
  try:
    return json.loads(line, object_pairs_hook=_unique_keys)
  except json.JSONDecodeError as e:
    # `msg` may end with where ("Unterminated string starting at"): the column says it
    raise ValueError(f"{where}: malformed JSON ({e.msg.removesuffix(' at')} at column "
                     f"{e.colno})") from None
  except _DuplicateKey as e:
    raise ValueError(f"{where}: duplicate key {e.args[0]!r} in a JSON object") from None


_BLANK = object()


def _entries(path: Path, opener=None) -> Iterator[tuple[str, object]]:
  """("file:line", parsed object, or the ValueError of a bad line) for every non-blank line;
  corrupt gzip data ends the file with its error."""
  opener = opener or (gzip.open if Path(path).suffix == ".gz" else open)
  with opener(path, "rb") as f:
    try:
      for lineno, raw in _lines(f, path):
        where = f"{path}:{lineno}"
        try:
          obj = _decoded(raw, where)
        except ValueError as e:
          yield where, e
          continue
        if obj is not _BLANK:
          yield where, obj
    except _Corrupt as e:
      yield e.args  # (where, its ValueError)


def json_lines(path: Path, opener=None) -> Iterator[tuple[str, object]]:
  """("file:line", parsed object) for every non-blank line (`.gz` files are gunzipped);
  malformed JSON, invalid UTF-8, corrupt gzip data and duplicate keys name their line."""
  for where, obj in _entries(path, opener):
    if isinstance(obj, ValueError):
      raise obj
    yield where, obj


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
  """The files of `paths`: files as given, globs' matches sorted, directories' `*.jsonl` and
  `*.jsonl.gz` sorted; a missing file or a glob matching nothing is a FileNotFoundError."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  files = []
  for p in map(os.fspath, paths):
    p = os.path.expanduser(p)
    if glob.has_magic(p):
      found = sorted(Path(f) for f in glob.glob(p, recursive=True) if os.path.isfile(f))
      if not found:
        raise FileNotFoundError(f"no JSONL file matches {p!r}")
      files += found
    elif os.path.isdir(p):
      found = sorted(f for f in Path(p).iterdir()
                     if f.name.endswith((".jsonl", ".jsonl.gz")) and f.is_file())
      if not found:
        raise FileNotFoundError(f"directory {p!r} has no .jsonl or .jsonl.gz file")
      files += found
    elif os.path.isfile(p):
      files.append(Path(p))
    else:
      raise FileNotFoundError(f"JSONL file {p!r} not found")
  if not files:
    raise ValueError("no JSONL files given")
  return files


def read_records(paths, *, skip_bad_lines: bool = False) -> list[Record]:
  """All records of `paths` (files, globs, directories: `expand_paths`), in order. A bad line
  is a `ValueError("file:line: ...")`; with `skip_bad_lines`, skipped, and one warning says
  how many were and names the first."""
  records, bad = [], []
  for path in expand_paths(paths):
    for where, obj in _entries(path):
      try:
        if isinstance(obj, ValueError):
          raise obj
        records.append(parse_record(obj, where))
      except ValueError as e:
        if not skip_bad_lines:
          raise
        bad.append(str(e))
  if bad:
    warnings.warn(f"skipped {len(bad)} bad JSONL line{'s' * (len(bad) > 1)} (the first: "
                  f"{bad[0]})", stacklevel=2)
  if not records:
    names = ", ".join(map(str, expand_paths(paths)))
    raise ValueError(f"{names}: no records (file is empty" + (
        f", {len(bad)} bad lines skipped)" if bad else ")"))
  return records


def read_jsonl(path: str | os.PathLike, *, skip_bad_lines: bool = False) -> list[Record]:
  """All records of one JSONL file, in file order."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"JSONL file {str(path)!r} not found")
  return read_records([path], skip_bad_lines=skip_bad_lines)


def jsonl_documents(path: str | os.PathLike) -> list[str]:
  """Training documents of a JSONL file: `text`, `prompt + response`, or a chat's contents."""
  return [r.text for r in read_jsonl(path)]
