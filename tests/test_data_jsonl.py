"""JSONL user data: both record kinds load; bad lines are named by file and line."""

import json

import pytest

from paraflax.data.jsonl import PairRecord, TextRecord, jsonl_documents, read_jsonl


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


@pytest.mark.fast
def test_both_record_kinds(tmp_path):
  path = _write(
    tmp_path / "d.jsonl",
    [
      json.dumps({"text": "def f():\n\treturn 1\n", "id": 7}),
      "",
      json.dumps({"prompt": "def g():\n", "response": "    return 'é'\n"}),
    ],
  )
  assert read_jsonl(path) == [
    TextRecord("def f():\n\treturn 1\n"),
    PairRecord("def g():\n", "    return 'é'\n"),
  ]
  assert jsonl_documents(path) == ["def f():\n\treturn 1\n", "def g():\n    return 'é'\n"]


@pytest.mark.fast
@pytest.mark.parametrize(
  "bad, message",
  [
    ('{"text": "ok"', "malformed JSON"),
    ('["text"]', "expected a JSON object"),
    ('{"prompt": "p"}', "expected key 'text' or both 'prompt' and 'response'"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"text": "a", "prompt": "b", "response": "c"}', "both 'text' and"),
  ],
)
def test_bad_line_error_names_file_and_line(tmp_path, bad, message):
  path = _write(tmp_path / "bad.jsonl", [json.dumps({"text": "fine"}), bad])
  with pytest.raises(ValueError, match=message) as err:
    read_jsonl(path)
  assert f"{path}:2:" in str(err.value)


@pytest.mark.fast
def test_missing_and_empty_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    read_jsonl(tmp_path / "nope.jsonl")
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="no records"):
    read_jsonl(tmp_path / "empty.jsonl")
